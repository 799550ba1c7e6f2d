"""The micro-batch engine: the one owner of k (micro-batches per training batch) for a Trainer.

One job a module (the file table and the engine's contract, what callbacks may call and read:
docs/architecture.md, "The engine's contract"). Callbacks attach to the engine as its users and answer
its questions (:class:`MicroBatchUser`); nothing outside the engine writes into it.

Installed by the first callback that needs it, it wraps ``trainer.strategy.training_step`` so that
each training batch runs as k micro-batches inside Lightning's own step: every micro-batch goes
forward through the original strategy step (autocast and the precision context intact) and backward
through the original ``LightningModule.backward`` (user overrides kept, the loss scaled by the
GradScaler when there is one), each loss weighted by its share of the batch. Lightning gets back one
detached loss for the whole batch and skips its own backward once; ``optimizer_zero_grad`` moves
before the first micro-batch. The optimizer step, clipping, schedulers and every hook after the
backward run as usual, once per batch.

When an attempt raises an out-of-memory error, the engine drops the attempt's partial gradients and
outputs, restores what the attempt touched (torchmetrics states, BatchNorm statistics, captured
``self.log`` calls), frees memory outside the ``except`` block and asks the user that decides on OOMs
(OOMRecovery) what to do, then runs the same batch again. Without one the error propagates. An attempt
that succeeded everywhere can be dropped and run again the same way when a user's attempt check asks
(PrecisionSwitch, after switching the precision on non-finite values).

After every attempt the ranks agree (:func:`~lightning_gpuopt.oom_policy.agree` over one vote per
rank, see ``exchange.py``): an OOM on any rank makes every rank retry the batch with the same k,
and proposals for the next batch (grow back, allocator thrashing) apply only when the ranks agree.
Under DDP every micro-batch runs under ``no_sync`` and the engine averages the gradients itself at the
optimizer-step boundary. Under FSDP2 (``ModelParallelStrategy``, :class:`~lightning_gpuopt.FSDP2Strategy`)
the ranks also vote before each of FSDP's collectives, so that a rank out of memory mid-step stops
the others at their next one. On a single device the vote is local and costs nothing.

Evaluation steps (validation, test, predict) are wrapped too: an OOM there splits that batch into
chunks, runs them, and puts their outputs back together in order.
"""

from lightning_gpuopt.microbatch.engine import (
    CHECKPOINTING,
    EVAL_STAGES,
    EngineState,
    KChange,
    MicroBatchBackward,
    MicroBatchEngine,
    MicroBatchUser,
    WeightFn,
)
from lightning_gpuopt.microbatch.errors import (
    LossWeightingError,
    MicroBatchOOMError,
    OptimizerStepOOMError,
    RankOutOfMemoryError,
)
from lightning_gpuopt.microbatch.rungs import ActivationCheckpointing, Rung
from lightning_gpuopt.microbatch.step import OptimizerStepHook
from lightning_gpuopt.support import unsupported_strategy

__all__ = [
    "CHECKPOINTING",
    "EVAL_STAGES",
    "ActivationCheckpointing",
    "EngineState",
    "KChange",
    "LossWeightingError",
    "MicroBatchBackward",
    "MicroBatchEngine",
    "MicroBatchOOMError",
    "MicroBatchUser",
    "OptimizerStepHook",
    "OptimizerStepOOMError",
    "RankOutOfMemoryError",
    "Rung",
    "WeightFn",
    "unsupported_strategy",
]
