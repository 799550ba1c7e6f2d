"""The micro-batch engine: the one owner of k (micro-batches per training batch) for a Trainer.

One job a module (the file table and the engine's contract, what callbacks may call and read:
docs/architecture.md, "The engine's contract"). Callbacks attach to the engine as its users and answer
its questions (:class:`MicroBatchUser`); nothing outside the engine writes into it.

Installed by the first callback that needs it, it wraps ``trainer.strategy.training_step`` so that each
training batch runs as k micro-batches inside Lightning's own step (forward through the original strategy
step, backward through the original ``LightningModule.backward``, each loss weighted by its share), and
Lightning's own backward is skipped once. An attempt that runs out of memory is dropped without a trace,
memory is freed outside the ``except`` block, the user that decides on OOMs (OOMRecovery) picks what to
change, and the same batch runs again; after every attempt the ranks agree (``exchange.py``), so every rank
retries alike. Evaluation steps split the same way. docs/oom-recovery.md ("How it works", "Distributed")
has the long form.
"""

from lightning_gpuopt._compiled import RecompileBudget
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
    "RecompileBudget",
    "Rung",
    "WeightFn",
    "unsupported_strategy",
]
