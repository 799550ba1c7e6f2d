"""The micro-batch engine: the one owner of k (micro-batches per training batch) for a Trainer.

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
``self.log`` calls), frees memory outside the ``except`` block and asks its OOM handler (OOMRecovery)
what to do, then runs the same batch again. Without a handler the error propagates. An attempt that
succeeded everywhere can be dropped and run again the same way when one of its ``attempt_checks`` asks
(PrecisionSwitch, after switching the precision on non-finite values).

After every attempt the ranks agree (:func:`~lightning_gpuopt.oom_policy.agree` over one vote per
rank, see ``_exchange.py``): an OOM on any rank makes every rank retry the batch with the same k,
and proposals for the next batch (grow back, allocator thrashing) apply only when the ranks agree.
Under DDP every micro-batch runs under ``no_sync`` and the engine averages the gradients itself at the
optimizer-step boundary. Under FSDP2 (``ModelParallelStrategy``, :class:`~lightning_gpuopt.FSDP2Strategy`)
the ranks also vote before each of FSDP's collectives, so that a rank out of memory mid-step stops
the others at their next one. On a single device the vote is local and costs nothing.

Evaluation steps (validation, test, predict) are wrapped too: an OOM there splits that batch into
chunks, runs them, and puts their outputs back together in order.

Callbacks talk to the engine through :meth:`MicroBatchEngine.attach`, :meth:`~MicroBatchEngine.propose`,
``next_proposal``, ``oom_handler``, ``attempt_checks``, ``enable_checkpointing`` and ``listeners``, and
read it through :meth:`~MicroBatchEngine.effective_k`, :meth:`~MicroBatchEngine.micro_batch_size`,
:meth:`~MicroBatchEngine.batch_size` and :meth:`~MicroBatchEngine.installed`; the rest is private, and
no component of the pack reads it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpuopt import _compat
from lightning_gpuopt._exchange import (
    DDPExchange,
    FSDP2Exchange,
    LocalExchange,
    PeerFailure,
)
from lightning_gpuopt.batching import (
    SPLIT_HOOK,
    UnsplittableBatchError,
    batch_size_of,
    merge_outputs,
    split_batch,
)
from lightning_gpuopt.memory import free_memory, get_probe, is_maybe_size_error, is_oom_error
from lightning_gpuopt.oom_policy import (
    Agreement,
    OOMFailure,
    Proposal,
    Recovery,
    Source,
    Status,
    Vote,
    agree,
    parse_tried_bytes,
)
from lightning_gpuopt.support import Feature, StrategyKind, strategy_kind, supports

__all__ = [
    "CHECKPOINTING",
    "EVAL_STAGES",
    "EngineState",
    "KChange",
    "MicroBatchEngine",
    "MicroBatchOOMError",
    "RankOutOfMemoryError",
    "WeightFn",
    "unsupported_strategy",
]

#: The name of the activation-checkpointing rung in the engine's state.
CHECKPOINTING = "activation checkpointing"

#: The evaluation steps the engine wraps, by the name of the strategy method.
EVAL_STAGES = ("validation", "test", "predict")

#: Counts what a micro-batch contributes to the batch's loss (samples, tokens, ...); normalised per batch.
WeightFn = Callable[[Any], "int | float | Tensor"]

_ENGINE_ATTR = "_gpuopt_microbatch_engine"
#: How often the attempt checks may send one batch back before the engine gives up (each re-run
#: follows a change the check made, such as one precision switch).
_MAX_RECHECKS = 8

try:  # torchmetrics is a dependency, but the engine must not break if a user removed it
    from torchmetrics import Metric as _Metric
except ImportError:  # pragma: no cover
    _Metric = None


@dataclass(frozen=True)
class KChange:
    """One change of k, as callbacks and the report see it.

    ``stage`` is ``"train"`` for the training k, or the evaluation stage (``"validation"``, ``"test"``,
    ``"predict"``) whose batches are split from now on.
    """

    step: int
    k_before: int
    k_after: int
    batch_size: int
    source: Source
    reason: str
    stage: str = "train"


@dataclass
class _Attempt:
    """The side effects of one attempt at a batch, kept so a failed attempt leaves no trace."""

    logs: list[tuple[str, Any, tuple, dict, float]] = field(default_factory=list)
    extras: list[dict[str, Any]] = field(default_factory=list)
    weight: float = 1.0


class _Refused(RuntimeError):
    """A training setup the engine cannot run; raised with the alternative named."""


class RankOutOfMemoryError(torch.OutOfMemoryError):
    """Another rank ran out of memory with nothing left to split: every rank stops with this error."""


class MicroBatchOOMError(torch.OutOfMemoryError):
    """Out of memory and nothing left to split: the message carries a memory breakdown and next steps."""


class EngineState(Callback):
    """Saves the micro-batch engine's state once per checkpoint: k, the evaluation k and the active rungs.

    Added to the Trainer by the first of the pack's callbacks that sets up for ``fit``
    (:meth:`ensure`), so that Lightning saves and restores it like any callback; the engine takes the
    restored state when a callback calls :meth:`MicroBatchEngine.resume`.
    """

    state_key = "MicroBatchEngine"

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._last: dict[str, Any] = {}
        self.restored: dict[str, Any] | None = None

    @classmethod
    def ensure(cls, trainer: pl.Trainer) -> EngineState:
        """The Trainer's holder of the engine state, added to its callbacks on first use."""
        holder = cls.of(trainer)
        if holder is None:
            holder = cls()
            trainer.callbacks.append(holder)
        holder._trainer = trainer
        return holder

    @classmethod
    def of(cls, trainer: pl.Trainer) -> EngineState | None:
        return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)

    def state_dict(self) -> dict[str, Any]:
        engine = MicroBatchEngine.get(self._trainer) if self._trainer is not None else None
        return engine.state_dict() if engine is not None else dict(self._last)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = dict(state_dict)
        self._last = dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_trainer": None}


class MicroBatchEngine:
    """Runs each training batch as k micro-batches; the only owner of k for one Trainer.

    Get it with :meth:`attach` (one engine per Trainer, shared by every callback of the pack) and give
    it back with :meth:`release`; the patches are removed when the last user releases it.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.k = 1
        #: The largest micro-batch size allowed (MemoryAwareBatchSize's budget); ``None``: no cap.
        self.max_micro_batch_size: int | None = None
        #: ``handler(failure, smallest_failed_size, splittable) -> Recovery`` (or a k) for the retry, or
        #: raises. ``None``: an OOM propagates unchanged.
        self.oom_handler: Callable[[OOMFailure, int, bool], Recovery | int] | None = None
        #: Turns activation checkpointing on (for a :class:`Recovery` that asks for it); returns whether
        #: anything changed.
        self.enable_checkpointing: Callable[[], bool] | None = None
        #: The :class:`~lightning_gpuopt.oom_policy.Proposal` a callback makes for the batch after the next vote (grow back,
        #: thrashing); consumed by that vote. The ranks' proposals are agreed with :func:`agree`.
        self.next_proposal: Proposal | None = None
        #: Counts a micro-batch's share of the loss; ``None``: samples (``batch_size_of``).
        self.weight_fn: WeightFn | None = None
        #: ``"mean"``: losses weighted by their share; ``"sum"``: summed unweighted.
        self.loss_reduction = "mean"
        #: Logged keys summed over micro-batches instead of averaged.
        self.sum_log_keys: frozenset[str] = frozenset()
        #: Whether the current batch may be split; a predicate on the batch.
        self.splittable: Callable[[Any], bool] = lambda batch: True
        #: Chunks per evaluation batch, per stage, after an OOM there.
        self.eval_k: dict[str, int] = {}
        #: ``check(batch_idx, loss) -> bool``, asked in order after every attempt that succeeded (``loss``: the
        #: attempt's detached loss for the whole batch, gradients in place); ``True`` drops the attempt like a
        #: failed one and runs the batch again, after the check changed what it runs under. Checks must answer
        #: alike on every rank.
        self.attempt_checks: list[Callable[[int, Tensor], bool]] = []
        self.history: list[KChange] = []
        #: The names of the recovery rungs turned on in this run beyond more micro-batches (saved with k).
        self.active_rungs: list[str] = []
        self.listeners: list[Callable[[KChange], None]] = []
        self._users: set[int] = set()
        self._resumed: dict[str, Any] | None = None
        #: The smallest micro-batch (samples) that ran in this fit, per stage.
        self._smallest_ran: dict[str, int] = {}
        self._installed: set[str] = set()
        self._attempt: _Attempt | None = None
        self._skip_backward = False
        self._skip_zero_grad = False
        self._phase = "forward"
        self.exchange: LocalExchange | DDPExchange | FSDP2Exchange = LocalExchange()

    # ------------------------------------------------------------------ public interface

    @classmethod
    def attach(cls, trainer: pl.Trainer, user: object, training: bool = True) -> MicroBatchEngine:
        """The Trainer's engine, created and installed on first use; ``user`` holds it until :meth:`release`.

        With ``training=False`` only the evaluation steps are wrapped (``validate``, ``test`` and
        ``predict`` outside of ``fit``); ``fit`` wraps both.
        """
        engine = getattr(trainer, _ENGINE_ATTR, None)
        if engine is None:
            engine = cls(trainer)
            setattr(trainer, _ENGINE_ATTR, engine)
        engine._users.add(id(user))
        try:
            engine._install(training)
        except BaseException:
            engine.release(user)
            raise
        return engine

    @classmethod
    def get(cls, trainer: pl.Trainer) -> MicroBatchEngine | None:
        """The Trainer's engine if one is attached."""
        return getattr(trainer, _ENGINE_ATTR, None)

    def release(self, user: object) -> None:
        """Stop using the engine; the last user's release removes every patch."""
        self._users.discard(id(user))
        if not self._users:
            holder = EngineState.of(self.trainer)
            if holder is not None:
                holder._last = self.state_dict()  # what a checkpoint written after this fit holds
            self._uninstall()
            if getattr(self.trainer, _ENGINE_ATTR, None) is self:
                delattr(self.trainer, _ENGINE_ATTR)

    def installed(self, stage: str) -> bool:
        """Whether the engine wraps ``stage``'s steps now (``"train"``, ``"validation"``, ``"test"``, ``"predict"``)."""
        return stage in self._installed

    def batch_size(self, batch: Any) -> int:
        """The samples in ``batch`` as the engine counts them (1 for a batch without a sample dimension)."""
        return self._batch_size(batch)

    def effective_k(self, batch: Any) -> int:
        """The micro-batches ``batch`` runs as now: k, raised to keep micro-batches within
        :attr:`max_micro_batch_size`, at most one per sample, 1 for a batch that may not be split."""
        return self._effective_k(self._batch_size(batch), batch)

    def micro_batch_size(self, batch: Any) -> int:
        """Samples in the largest micro-batch of ``batch`` now."""
        n = self._batch_size(batch)
        return math.ceil(n / self._effective_k(n, batch))

    def state_dict(self) -> dict[str, Any]:
        """The engine's decisions, plain values: k, the evaluation k per stage, the active rungs."""
        return {
            "k": self.k,
            "eval_k": [[stage, k] for stage, k in sorted(self.eval_k.items())],
            "rungs": list(self.active_rungs),
        }

    def resume(self) -> dict[str, Any] | None:
        """Apply the state restored from a checkpoint, once; returns that state to every caller (``None``: none).

        The callbacks call it once their listeners are in place, so that the change is announced like any
        other; a rung named in the state is for its owner to turn on again (see :attr:`active_rungs`).
        """
        holder = EngineState.of(self.trainer)
        state = holder.restored if holder is not None else None
        if state is None:
            return self._resumed
        holder.restored = None
        self._resumed = state
        for stage, k in state.get("eval_k", []):
            self.eval_k.setdefault(str(stage), int(k))
        k = int(state.get("k", 1))
        if k != self.k:
            self.propose(k, Source.RESUME, "restored from checkpoint")
        return state

    def propose(self, k: int, source: Source | str, reason: str, batch_size: int | None = None) -> int:
        """Ask for k micro-batches; returns the k now in force.

        Precedence: a proposal from ``"oom"`` raises k and always wins; any proposal that lowers k is
        capped so the micro-batch stays within :attr:`max_micro_batch_size` (when ``batch_size`` is known).
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` (micro-batches) must be a positive int, got {k!r}")
        source = (
            Source(source) if source in Source._value2member_map_ else source
        )  # a caller's own source stays
        if k < self.k and source is not Source.OOM and self.max_micro_batch_size and batch_size:
            k = max(k, math.ceil(batch_size / self.max_micro_batch_size))
        if k != self.k:
            change = KChange(self.trainer.global_step, self.k, k, batch_size or 0, source, reason)
            self.k = k
            self._notify(change)
        return self.k

    def _notify(self, change: KChange) -> None:
        self.history.append(change)
        for listener in self.listeners:
            listener(change)

    @property
    def world_size(self) -> int:
        """Ranks that vote on every batch (1 on a single device)."""
        return self.exchange.world_size

    def snapshot_bytes(self) -> int:
        """Device bytes the engine's own copies hold through a training step, for memory budgets.

        Before each batch the engine copies what a failed attempt must not change (BatchNorm statistics,
        torchmetrics tensor states); 0 until it is installed.
        """
        if not self._installed:
            return 0
        tensors = [b for norm in self._norms for b in norm.buffers(recurse=False) if b is not None]
        tensors += [
            v
            for metric in self._metrics
            for name in metric._defaults
            if isinstance(v := getattr(metric, name), Tensor)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ installation

    def _install(self, training: bool) -> None:
        trainer, module = self.trainer, self.trainer.lightning_module
        strategy = trainer.strategy
        if not self._installed:
            self._module = module
            self._orig_log = module.log
            module.log = self._log
            self._orig_eval = {}
            for stage in EVAL_STAGES:
                name = f"{stage}_step"
                self._orig_eval[stage] = getattr(strategy, name)
                setattr(strategy, name, self._eval_step_for(stage))
            self._metrics = [m for m in module.modules() if _Metric is not None and isinstance(m, _Metric)]
            self._norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
            self._installed.add("eval")
            if isinstance(strategy, ModelParallelStrategy):  # evaluation all-gathers too: the ranks vote
                _check_strategy(strategy, module)
                self.exchange = _make_exchange(strategy)
        if training and "train" not in self._installed:
            self._check_supported(trainer, module)
            if not isinstance(self.exchange, FSDP2Exchange):
                self.exchange = _make_exchange(strategy)
            self._orig_training_step = strategy.training_step
            self._orig_backward = module.backward
            self._orig_zero_grad = module.optimizer_zero_grad
            strategy.training_step = self._training_step
            module.backward = self._backward
            module.optimizer_zero_grad = self._optimizer_zero_grad
            ddp = strategy.model if isinstance(self.exchange, DDPExchange) else None
            # DDP would broadcast buffers at the start of a forward after a synced backward; the engine
            # never lets DDP sync and hands out rank 0's buffers itself at the optimizer-step boundary.
            self._ddp_forward_sync = getattr(ddp, "require_forward_param_sync", None)
            if ddp is not None:
                ddp.require_forward_param_sync = False
            self._installed.add("train")

    def _uninstall(self) -> None:
        if not self._installed:
            return
        strategy, module = self.trainer.strategy, self._module
        names = [(strategy, f"{stage}_step") for stage in EVAL_STAGES] + [(module, "log")]
        if "train" in self._installed:
            names += [(strategy, "training_step"), (module, "backward"), (module, "optimizer_zero_grad")]
            if self._ddp_forward_sync is not None:
                strategy.model.require_forward_param_sync = self._ddp_forward_sync
        if isinstance(self.exchange, FSDP2Exchange):
            self.exchange.uninstall()
        for obj, name in names:
            if name in vars(obj):
                delattr(obj, name)
        self.exchange = LocalExchange()
        self._installed = set()

    @staticmethod
    def _check_supported(trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not module.automatic_optimization:
            raise _Refused(
                "Micro-batching needs automatic optimization, but the LightningModule sets "
                "`automatic_optimization = False`. Split the batch yourself inside `training_step`, or use "
                "automatic optimization."
            )
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise _Refused(
                f"Micro-batching supports exactly one optimizer, got {len(optimizers)}. Combine the parameter "
                "groups into one optimizer, or remove OOMRecovery for this module."
            )
        if isinstance(optimizers[0], torch.optim.LBFGS):
            raise _Refused(
                "Micro-batching cannot run closure optimizers such as LBFGS (they re-evaluate the closure "
                "several times per step). Use a first-order optimizer such as SGD or AdamW."
            )
        _check_strategy(trainer.strategy, module)

    # ------------------------------------------------------------------ patched hooks

    def _backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        # Lightning's backward on the returned (detached) loss: the engine already ran every backward.
        if self._skip_backward:
            self._skip_backward = False
            return None
        return self._orig_backward(loss, *args, **kwargs)

    def _optimizer_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        # Lightning zeroes after training_step; the engine zeroed before the first micro-batch instead.
        if self._skip_zero_grad:
            self._skip_zero_grad = False
            return None
        return self._orig_zero_grad(*args, **kwargs)

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        attempt = self._attempt
        if attempt is None:
            return self._orig_log(name, value, *args, **kwargs)
        attempt.logs.append((name, value, args, kwargs, attempt.weight))
        return None

    # ------------------------------------------------------------------ the training step

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        self._skip_backward = self._skip_zero_grad = False
        batch = args[0] if args else kwargs["batch"]
        batch_idx = (
            args[1] if len(args) > 1 else kwargs.get("batch_idx", trainer.fit_loop.epoch_loop.batch_idx)
        )
        optimizer = trainer.optimizers[0]
        accumulate = trainer.accumulate_grad_batches
        first_in_window = batch_idx % accumulate == 0  # Lightning's own rule for zeroing
        boundary = not _compat.should_accumulate(trainer)  # the optimizer steps after this batch
        n = self._batch_size(batch)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if first_in_window:
            self._orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            stash = None
        else:  # keep the gradients of earlier batches of this window apart, so a failure drops only ours
            stash = [p.grad for p in params]
            for p in params:
                p.grad = None
        snapshot = self._snapshot()
        probe = get_probe(trainer.strategy.root_device)
        measured = probe.kind != "cpu"  # host RSS says nothing about one step; read device figures only
        smallest_failed = n + 1
        start_k = self.k
        proposal, self.next_proposal = self.next_proposal, None
        rechecks = 0
        first_size_error: BaseException | None = None
        while True:
            k = self._effective_k(n, batch)
            baseline = probe.allocated if measured else None
            failure: OOMFailure | None = None
            peer_votes = None  # the vote at which another rank's failure stopped this attempt (FSDP2)
            output = None
            try:
                self.exchange.begin(k)
                with self._no_sync():
                    output = self._run(batch, args[1:], kwargs, n, k, accumulate)
                self.exchange.prepare()
            except PeerFailure as err:
                peer_votes = err.votes
            except Exception as err:
                # cuDNN's CUDNN_STATUS_NOT_SUPPORTED is often a size limit: shrink once, then re-raise the original.
                size_error = is_maybe_size_error(err) and self.oom_handler is not None and k < n
                if size_error and first_size_error is not None:
                    self._restore_grads(params, stash)
                    raise first_size_error from None
                if self.oom_handler is None or not (is_oom_error(err) or size_error):
                    self._restore_grads(params, stash)
                    self._raise_if_too_small(err, n, k)
                    raise
                if size_error:
                    first_size_error = err.with_traceback(
                        None
                    )  # re-raised later; its frames must not pin memory
                failure = self._describe(err, probe if measured else None, batch_idx, n, k, baseline, params)
            fatal: BaseException | None = None
            if failure is not None or peer_votes is not None:
                # Outside the except block: the traceback and the activations it pinned are gone.
                output = None
                self._drop_attempt(params, snapshot)
                free_memory()
            if failure is None:
                status, voted_k = (proposal.status, proposal.k) if proposal is not None else (Status.NONE, k)
            else:
                smallest_failed = min(smallest_failed, failure.micro_batch_size)
                status, voted_k = Status.OOM, k
                try:
                    recovery = self.oom_handler(failure, smallest_failed, self.splittable(batch))
                except torch.OutOfMemoryError as err:  # nothing left to try (MicroBatchOOMError)
                    fatal, status = err, Status.FATAL
                else:
                    if isinstance(recovery, int):
                        recovery = Recovery(recovery)
                    voted_k = recovery.k or start_k
                    if recovery.checkpoint:
                        status |= Status.CHECKPOINT
            votes = peer_votes if peer_votes is not None else self.exchange.vote(status, voted_k)
            agreement = agree(votes, k)
            if agreement.fatal_ranks:
                self._restore_grads(params, stash)
                if fatal is not None:
                    raise fatal
                raise RankOutOfMemoryError(
                    f"Rank(s) {', '.join(map(str, agreement.fatal_ranks))} ran out of memory at step "
                    f"{trainer.global_step} with nothing left to split; every rank stops (the error on "
                    "those ranks has the memory breakdown and next steps)."
                )
            if not agreement.retry:
                # Every rank kept its attempt, so every rank asks the checks here, at the same point (a check
                # may all-reduce its own flags, and answers alike on every rank).
                if not self._recheck_asked(batch_idx, output):
                    break
                rechecks += 1
                if rechecks > _MAX_RECHECKS:
                    self._restore_grads(params, stash)
                    raise RuntimeError(
                        f"The micro-batch engine's attempt checks sent batch {batch_idx} back {_MAX_RECHECKS} times; "
                        "a check must change what the batch runs under before it asks again."
                    )
                output = None
                self._drop_attempt(params, snapshot)
                continue
            if (
                failure is None and peer_votes is None
            ):  # another rank ran out of memory: this attempt is redone too
                output = None
                self._drop_attempt(params, snapshot)
            self.exchange.recover()  # FSDP2, on every rank alike: reshard, reset FSDP's step state, drop its gradients
            if agreement.checkpoint and self.enable_checkpointing is not None and self.enable_checkpointing():
                smallest_failed = n + 1  # activations are cheaper now: sizes that failed may fit
                if CHECKPOINTING not in self.active_rungs:
                    self.active_rungs.append(CHECKPOINTING)
            self.propose(agreement.k, Source.OOM, self._reason(agreement, failure), batch_size=n)
        self._ran(n, k)
        self._emit_logs(*self._pending_logs)
        self._merge_grads(params, stash)
        if boundary:
            self.exchange.reduce()
        if agreement.source:
            self.propose(agreement.k, agreement.source, self._reason(agreement, None, proposal), batch_size=n)
        self._skip_backward = True
        self._skip_zero_grad = first_in_window
        return output

    def _reason(
        self, agreement: Agreement, failure: OOMFailure | None, proposal: Proposal | None = None
    ) -> str:
        step = self.trainer.global_step
        if agreement.source is Source.OOM:
            if failure is not None:
                return f"OOM at step {failure.step} ({failure.phase})"
            ranks = ", ".join(map(str, agreement.ranks))
            return f"OOM on rank {ranks} at step {step}"
        if proposal is not None and agreement.k == proposal.k:
            return proposal.reason
        return f"{agreement.source} (agreed by every rank) at step {step}"

    def _no_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.exchange, DDPExchange):
            return self.trainer.strategy.block_backward_sync()
        return contextlib.nullcontext()

    def _drop_attempt(self, params: list[Tensor], snapshot: list[tuple[Any, dict[str, Any]]]) -> None:
        for p in params:
            p.grad = None
        self._restore(snapshot)

    # ------------------------------------------------------------------ evaluation steps

    def _eval_step_for(self, stage: str) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            return self._eval_step(stage, args, kwargs)

        return step

    def _eval_step(self, stage: str, args: tuple, kwargs: dict) -> Any:
        original = self._orig_eval[stage]
        k = self.eval_k.get(stage, 1)
        voting = isinstance(
            self.exchange, FSDP2Exchange
        )  # ranks that all-gather in the forward vote on each step
        if k == 1 and self.oom_handler is None and not voting:
            return original(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        n = self._batch_size(batch)
        snapshot = self._snapshot() if self.oom_handler is not None else []
        probe = get_probe(self.trainer.strategy.root_device)
        measured = probe.kind != "cpu"
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        smallest_failed = n + 1
        while True:
            k = max(1, min(self.eval_k.get(stage, 1), n)) if self.splittable(batch) else 1
            baseline = probe.allocated if measured else None
            failure: OOMFailure | None = None
            peer_votes = None
            try:
                if voting:
                    self.exchange.begin(k)
                elif k == 1:
                    return original(*args, **kwargs)
                output, logs = self._run_eval(original, batch, args[1:], kwargs, n, k)
                if not voting:  # nobody else to agree with: a step that ran is kept
                    self._ran(n, k, stage)
                    self._emit_logs(*logs)
                    return output
            except PeerFailure as err:
                peer_votes = err.votes
            except Exception as err:
                if self.oom_handler is None or not is_oom_error(err):
                    self._raise_if_too_small(err, n, k, stage)
                    raise
                self._phase = stage
                failure = self._describe(err, probe if measured else None, batch_idx, n, k, baseline)
                smallest_failed = min(smallest_failed, failure.micro_batch_size)
            if failure is not None or peer_votes is not None:
                output = logs = None
            vote = self.exchange.vote if voting else (lambda status, voted_k: [Vote(status, voted_k)])
            if self._eval_agree(
                stage, batch, batch_idx, n, k, failure, peer_votes, snapshot, smallest_failed, vote
            ):
                self._ran(n, k, stage)
                self._emit_logs(*logs)  # every rank kept its attempt
                return output

    def _eval_agree(
        self,
        stage: str,
        batch: Any,
        batch_idx: int,
        n: int,
        k: int,
        failure: OOMFailure | None,
        peer_votes: list[Vote] | None,
        snapshot: list,
        smallest_failed: int,
        vote: Callable[[int, int], list[Vote]],
    ) -> bool:
        """The ranks' decision on an evaluation step: ``True`` keeps it; ``False`` retries it with a larger k.

        ``vote`` is the exchange's (FSDP2: every rank decides alike) or this process's own.
        """
        status, voted_k = Status.NONE, k
        fatal: BaseException | None = None
        if failure is not None or peer_votes is not None:
            self._restore(snapshot)
            free_memory()
        if failure is not None:
            status = Status.OOM
            try:
                recovery = self.oom_handler(failure, smallest_failed, self.splittable(batch))
            except torch.OutOfMemoryError as err:  # nothing left to try (MicroBatchOOMError)
                fatal, status = err, Status.FATAL
            else:
                proposed = recovery.k if isinstance(recovery, Recovery) else recovery
                voted_k = max(proposed or k + 1, k + 1)
        agreement = agree(peer_votes if peer_votes is not None else vote(status, voted_k), k)
        if agreement.fatal_ranks:
            if fatal is not None:
                raise fatal
            raise RankOutOfMemoryError(
                f"Rank(s) {', '.join(map(str, agreement.fatal_ranks))} ran out of memory in {stage} at batch "
                f"{batch_idx} with nothing left to split; every rank stops."
            )
        if not agreement.retry:
            return True
        if failure is None and peer_votes is None:  # another rank failed after its last collective
            self._restore(snapshot)
        self.exchange.recover()  # on every rank alike (FSDP2: the units' sharded state must match for the retry)
        new_k = max(
            agreement.k, k + 1
        )  # the same on every rank (a batch of fewer samples runs them as it can)
        if failure is not None:
            reason = f"OOM in {stage} at batch {batch_idx}"
        else:
            reason = f"OOM on rank {', '.join(map(str, agreement.ranks))} in {stage} at batch {batch_idx}"
        self._set_eval_k(stage, k, new_k, n, reason)
        return False

    def _set_eval_k(self, stage: str, k: int, new_k: int, n: int, reason: str) -> None:
        self.eval_k[stage] = new_k
        self._notify(KChange(self.trainer.global_step, k, new_k, n, Source.OOM, reason, stage))

    def _run_eval(
        self, original: Callable[..., Any], batch: Any, rest: tuple, kwargs: dict, n: int, k: int
    ) -> tuple[Any, tuple[list, list[float], int]]:
        """The step's output and its captured logs (emitted by the caller once the step is kept)."""
        chunks = self._micro_batches(batch, k)
        weights = self._weights(chunks)
        attempt = _Attempt()
        outputs = []
        self._attempt = attempt
        try:
            for chunk, weight in zip(chunks, weights):
                attempt.weight = weight
                outputs.append(original(chunk, *rest, **kwargs))
        finally:
            self._attempt = None
        output = None if all(o is None for o in outputs) else merge_outputs(outputs, weights)
        return output, (attempt.logs, weights, n)

    def _recheck_asked(self, batch_idx: int, output: Any) -> bool:
        if not self.attempt_checks:
            return False
        loss = output.get("loss") if isinstance(output, Mapping) else output
        return any(check(batch_idx, loss) for check in list(self.attempt_checks))

    def _effective_k(self, n: int, batch: Any) -> int:
        if not self.splittable(batch):
            return 1
        k = self.k
        if self.max_micro_batch_size:
            k = max(k, math.ceil(n / self.max_micro_batch_size))
        return max(1, min(k, n))

    def _batch_size(self, batch: Any) -> int:
        try:
            return batch_size_of(batch)
        except UnsplittableBatchError:
            return 1  # no sample dimension: the batch runs whole

    def _micro_batches(self, batch: Any, k: int) -> list[Any]:
        if k == 1:
            return [batch]
        for owner in (self._module, getattr(self.trainer, "datamodule", None)):
            hook = getattr(owner, SPLIT_HOOK, None) if owner is not None else None
            if callable(hook):
                chunks = list(hook(batch, k))
                if len(chunks) != k:
                    raise ValueError(
                        f"`{type(owner).__name__}.{SPLIT_HOOK}(batch, k={k})` must return {k} micro-batches, "
                        f"got {len(chunks)}"
                    )
                return chunks
        return split_batch(batch, k).chunks

    def _weights(self, chunks: list[Any]) -> list[float]:
        if len(chunks) == 1:
            return [1.0]
        if self.loss_reduction == "sum":
            return [1.0] * len(chunks)
        counts = [
            float(self.weight_fn(c)) if self.weight_fn is not None else float(batch_size_of(c))
            for c in chunks
        ]
        total = sum(counts)
        if total <= 0:
            raise ValueError(
                f"The micro-batch weights sum to {total}: the weight function found nothing to count "
                "(no samples or tokens) in this batch. Check `weight_fn` / the token key."
            )
        return [c / total for c in counts]

    def _run(self, batch: Any, rest: tuple, kwargs: dict, n: int, k: int, accumulate: int) -> Any:
        chunks = self._micro_batches(batch, k)
        weights = self._weights(chunks)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        attempt = _Attempt()
        total: Tensor | None = None
        self._attempt = attempt
        try:
            for chunk, weight in zip(chunks, weights):
                self._phase = "forward"
                attempt.weight = weight
                out = self._orig_training_step(chunk, *rest, **kwargs)
                loss, extra = _split_output(out)
                if loss is None:
                    raise _Refused(
                        "training_step returned None (skipping the batch) or no 'loss', which micro-batching "
                        "cannot split. Return the loss for every batch, or remove OOMRecovery (and pass "
                        "PrecisionSwitch(rerun=False))."
                    )
                attempt.extras.append(extra)
                self._phase = "backward"
                scaled = loss if weight == 1.0 else loss * weight
                if accumulate != 1:
                    scaled = scaled / accumulate
                if scaler is not None:
                    scaled = scaler.scale(scaled)
                self._orig_backward(scaled)
                part = loss.detach() if weight == 1.0 else loss.detach() * weight
                total = part if total is None else total + part
                del out, loss, scaled
        finally:
            self._attempt = None
        self._pending_logs = (attempt.logs, weights, n)  # emitted once every rank keeps the attempt
        loss_out = total.clone().requires_grad_(True)  # a leaf: Lightning's own backward on it is skipped
        if attempt.extras and attempt.extras[0] is not None:
            return {"loss": loss_out, **merge_outputs(attempt.extras, weights)}
        return loss_out

    def _emit_logs(
        self, logs: list[tuple[str, Any, tuple, dict, float]], weights: list[float], n: int
    ) -> None:
        if len(weights) == 1:
            for name, value, args, kwargs, _ in logs:
                self._orig_log(name, value, *args, **kwargs)
            return
        grouped: dict[str, list[tuple[Any, tuple, dict, float]]] = {}
        for name, value, args, kwargs, weight in logs:
            grouped.setdefault(name, []).append((value, args, kwargs, weight))
        for name, entries in grouped.items():
            value, args, kwargs, _ = entries[-1]
            if not isinstance(value, (Tensor, int, float)):  # a Metric: its state already holds every sample
                self._orig_log(name, value, *args, **kwargs)
                continue
            values = [torch.as_tensor(v).detach() for v, *_ in entries]
            if name in self.sum_log_keys:
                combined = torch.stack([v.double() for v in values]).sum().to(values[0].dtype)
            else:
                share = sum(w for *_, w in entries)
                combined = sum(v.double() * w for v, (*_, w) in zip(values, entries)) / share
                combined = combined.to(
                    values[0].dtype if values[0].is_floating_point() else torch.get_default_dtype()
                )
            kwargs = dict(kwargs)
            if kwargs.get("batch_size") is not None:
                kwargs["batch_size"] = n
            self._orig_log(name, combined, *args, **kwargs)

    # ------------------------------------------------------------------ side effects of an attempt

    def _snapshot(self) -> list[tuple[Any, dict[str, Any]]]:
        saved: list[tuple[Any, dict[str, Any]]] = []
        for metric in self._metrics:
            state = {name: _copy_state(getattr(metric, name)) for name in _compat.metric_state_names(metric)}
            state["_update_count"] = metric._update_count
            state["_computed"] = metric._computed
            saved.append((metric, state))
        for norm in self._norms:
            saved.append(
                (
                    norm,
                    {name: buf.clone() for name, buf in norm.named_buffers(recurse=False) if buf is not None},
                )
            )
        return saved

    @staticmethod
    def _restore(snapshot: list[tuple[Any, dict[str, Any]]]) -> None:
        for obj, state in snapshot:
            if isinstance(obj, _BatchNorm):
                for name, value in state.items():
                    getattr(obj, name).copy_(value)
            else:
                for name, value in state.items():
                    setattr(obj, name, _copy_state(value))

    @staticmethod
    def _restore_grads(params: list[Tensor], stash: list[Tensor | None] | None) -> None:
        if stash is not None:
            for p, old in zip(params, stash):
                p.grad = old

    @staticmethod
    def _merge_grads(params: list[Tensor], stash: list[Tensor | None] | None) -> None:
        if stash is None:
            return
        for p, old in zip(params, stash):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)

    def _ran(self, n: int, k: int, stage: str = "train") -> None:
        """Remember the smallest micro-batch that ran in this fit (per stage)."""
        size = n // k
        if size >= 1:
            self._smallest_ran[stage] = min(self._smallest_ran.get(stage, size), size)

    def _raise_if_too_small(self, err: BaseException, n: int, k: int, stage: str = "train") -> None:
        """Turn an error at micro-batches smaller than any that ran in this fit into :class:`MicroBatchOOMError`.

        Only after a split the handler (OOMRecovery) asked for: such an error (BatchNorm's "Expected more
        than 1 value per channel", a shape a model cannot take) says the model cannot run micro-batches
        this small, not that the user's code is wrong.
        """
        if self.oom_handler is None or k <= 1 or isinstance(err, torch.OutOfMemoryError):
            return
        size = n // k
        smallest = self._smallest_ran.get(stage)
        if smallest is not None and size >= smallest:
            return
        ran = (
            f"the smallest that ran in this fit had {smallest}" if smallest is not None else "none ran before"
        )
        raise MicroBatchOOMError(
            f"{type(err).__name__} in {stage} at micro-batches of {size} sample(s) (k {k} for a batch of {n}), "
            f"smaller than any that ran ({ran}): the model cannot run micro-batches this small; it needs at least "
            f"{size + 1} samples per micro-batch (BatchNorm in training mode needs 2). Set "
            f"OOMRecovery(min_micro_batch_size={size + 1}), and lower the memory a sample needs (a lower-memory "
            f"precision, activation checkpointing, a sharded strategy). Original error: {err}"
        ) from err

    def _describe(
        self,
        err: BaseException,
        probe: Any,
        batch_idx: int,
        n: int,
        k: int,
        baseline: int | None,
        params: list[Tensor] | None = None,
    ) -> OOMFailure:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        allocated = limit = None
        if probe is not None:
            try:
                allocated, limit = probe.allocated, probe.total
            except Exception:  # a probe that cannot answer must not hide the OOM
                pass
        return OOMFailure(
            step=self.trainer.global_step,
            batch_idx=batch_idx,
            phase=self._phase,
            batch_size=n,
            k=k,
            micro_batch_size=math.ceil(n / k),
            baseline_bytes=baseline,
            allocated_bytes=allocated,
            tried_bytes=parse_tried_bytes(str(err)),
            limit_bytes=limit or None,
            message=message,
            gradient_bytes=None if params is None or probe is None else _gradient_bytes(params),
            held_gradient_bytes=(
                None
                if params is None or probe is None
                else sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            ),
        )


def _gradient_bytes(params: list[Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def _split_output(out: Any) -> tuple[Tensor | None, dict[str, Any] | None]:
    if isinstance(out, Mapping):
        return out.get("loss"), {key: value for key, value in out.items() if key != "loss"}
    return out, None


def _copy_state(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, list):
        return list(value)
    return value


def unsupported_strategy(strategy: Any, sharded: bool = False) -> str | None:
    """Why the engine cannot run under ``strategy``, naming the alternative; ``None`` when it can.

    The answer comes from :mod:`lightning_gpuopt.support`: with ``sharded=True`` for OOMRecovery (single
    device, DDP and FSDP2 without tensor parallelism, on a torch that can reset FSDP2 after an interrupted
    step), else for MemoryAwareBatchSize (single device and DDP). Not under FSDP1 (``FSDPStrategy``) or
    DeepSpeed, whose collectives inside the step cannot be kept in step when one rank runs out of memory.
    """
    feature = Feature.OOM_RECOVERY if sharded else Feature.BATCH_SIZE_SEARCH
    answer = supports(feature, strategy)
    if answer.supported:
        return None
    name = type(strategy).__name__
    kind = strategy_kind(strategy)
    if sharded and kind is StrategyKind.TENSOR_PARALLEL:
        return (
            f"micro-batching under {name} supports FSDP2 data parallelism only, got tensor_parallel_size="
            f"{_compat.tensor_parallel_size(strategy)} (tensor-parallel collectives inside the forward cannot be kept in "
            "step). Use tensor_parallel_size=1, or train without OOMRecovery here."
        )
    if sharded and kind is StrategyKind.FSDP2:
        return f"{answer.reason}, or train without OOMRecovery under {name}."
    supported = (
        "single-device, DDP and FSDP2 (ModelParallelStrategy) training"
        if sharded
        else "single-device and DDP training"
    )
    return (
        f"micro-batching supports {supported}, got {name} ({answer.reason}). Use strategy='ddp' (or one device)"
        + (", or FSDP2Strategy for a sharded model" if sharded else "")
        + ", or train without the pack's micro-batching callbacks (OOMRecovery, MemoryAwareBatchSize) here."
    )


def _check_strategy(strategy: Any, module: pl.LightningModule) -> None:
    """Refuse the strategies and settings under which the engine cannot keep ranks in step."""
    if isinstance(strategy, SingleDeviceStrategy):
        return
    reason = unsupported_strategy(strategy, sharded=True)
    if reason is not None:
        raise _Refused(reason[0].upper() + reason[1:])
    sync_norms = [type(m).__name__ for m in module.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    kind = "FSDP2" if isinstance(strategy, ModelParallelStrategy) else "DDP"
    if sync_norms:
        raise _Refused(
            f"Micro-batching under {kind} cannot run SyncBatchNorm: it communicates inside the forward, so a rank "
            "that runs out of memory mid-forward would leave the other ranks waiting. Use plain BatchNorm "
            "(Trainer(sync_batchnorm=False)), or remove OOMRecovery for this run."
        )
    if isinstance(strategy, ModelParallelStrategy):
        return  # the DDP settings below do not apply; the exchange checks the sharded model when it is built
    ddp = strategy.model
    if getattr(strategy, "_ddp_comm_hook", None) is not None or getattr(ddp, "_comm_hooks", None):
        raise _Refused(
            "Micro-batching under DDP averages the gradients itself at the optimizer step, so a DDP "
            "communication hook (`ddp_comm_hook`) would never run. Remove the hook, or remove OOMRecovery."
        )
    if getattr(ddp, "static_graph", False):
        raise _Refused(
            "Micro-batching under DDP cannot run with `static_graph=True`: DDP would all-reduce inside the "
            "first backward, which the engine keeps free of collectives. Use DDPStrategy(static_graph=False)."
        )


def _make_exchange(strategy: Any) -> LocalExchange | DDPExchange | FSDP2Exchange:
    if isinstance(strategy, ModelParallelStrategy):
        try:
            return FSDP2Exchange(strategy.model)
        except ValueError as err:
            raise _Refused(
                f"Micro-batching under {type(strategy).__name__} needs the model sharded with FSDP2 `fully_shard`: "
                f"{err}. Use FSDP2Strategy (it shards an unchanged module), or train without OOMRecovery here."
            ) from err
    if isinstance(strategy, DDPStrategy):
        bucket_mb = _compat.ddp_kwargs(strategy).get("bucket_cap_mb", 25) or 25
        return DDPExchange(strategy.model, bucket_bytes=int(bucket_mb * 2**20))
    return LocalExchange()
