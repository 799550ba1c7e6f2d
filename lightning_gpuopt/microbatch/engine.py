"""The micro-batch engine: the one owner of k for a Trainer, its state, and what callbacks read and change.

See :mod:`lightning_gpuopt.microbatch` for what the engine does and its contract. The batches run in
``attempt_loop.py`` (an attempt's side effects in ``attempt.py``); the setups it refuses are in
``setup_checks.py``, the optimizer step in ``step.py``, the recovery rungs in ``rungs.py``, torch.compile's
part in ``compile_watch.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor

from lightning_gpuopt._compiled import RecompileBudget, is_compiled_anywhere
from lightning_gpuopt._validate import positive_int
from lightning_gpuopt.microbatch.attempt import batch_samples
from lightning_gpuopt.microbatch.attempt_loop import EVAL_STAGES, AttemptLoop
from lightning_gpuopt.microbatch.batches import MicroBatchBackward
from lightning_gpuopt.microbatch.compile_watch import CompileWatch
from lightning_gpuopt.microbatch.exchange import (
    DDPExchange,
    FSDP2Exchange,
    LocalExchange,
    make_exchange,
    register_exit_grace,
)
from lightning_gpuopt.microbatch.loss_weighting import LossWeighting
from lightning_gpuopt.microbatch.rungs import ActivationCheckpointing, Ladder, Rung
from lightning_gpuopt.microbatch.setup_checks import check_strategy, check_supported
from lightning_gpuopt.microbatch.step import OptimizerStepHook
from lightning_gpuopt.oom_policy import OOMFailure, Proposal, Recovery, Source, Vote

__all__ = [
    "CHECKPOINTING",
    "EVAL_STAGES",
    "EngineState",
    "KChange",
    "MicroBatchBackward",
    "MicroBatchEngine",
    "WeightFn",
]

#: The name of the activation-checkpointing rung in the engine's state.
CHECKPOINTING = ActivationCheckpointing.name

#: Counts what a micro-batch contributes to the batch's loss (samples, tokens, ...); normalised per batch.
WeightFn = Callable[[Any], "int | float | Tensor"]

_ENGINE_ATTR = "_gpuopt_microbatch_engine"


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
        #: The recovery ladder past more micro-batches, in order (``rungs.py``): the OOM handler names the rung to
        #: turn on in its :class:`Recovery`; every callback's rungs must be registered alike on every rank.
        self.ladder = Ladder(trainer)
        #: The :class:`~lightning_gpuopt.oom_policy.Proposal` a callback makes for the batch after the next vote (grow back,
        #: thrashing); consumed by that vote. The ranks' proposals are agreed with :func:`agree`.
        self.next_proposal: Proposal | None = None
        #: How micro-batch losses are weighted (``loss_weighting.py``): ``"auto"`` checks the user's loss at
        #: the first split; OOMRecovery replaces it with its own settings.
        self.loss_weighting = LossWeighting(source="MicroBatchEngine")
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
        #: ``listener(MicroBatchBackward)``, told after each micro-batch's backward in a training attempt (the
        #: gradients of this batch so far in ``.grad``): GradientNoiseScale reads the first micro-batch's there.
        self.backward_listeners: list[Callable[[MicroBatchBackward], None]] = []
        #: ``ask(batch_idx) -> bool``: run this training batch, first of its accumulation window and due to run
        #: whole (k = 1), as 2 micro-batches instead, for a measurement; k is unchanged. Only for steps whose
        #: update a split leaves unchanged (the asker's to know); ``None``: never.
        self.measure_split: Callable[[int], bool] | None = None
        #: ``told(why)`` when the loss-weighting check refused such a split (the batch then ran whole, and
        #: ``measure_split`` is reset to ``None``).
        self.measure_refused: Callable[[str], None] | None = None
        self.listeners: list[Callable[[KChange], None]] = []
        #: The Trainer's optimizer-step hook (``step.py``), attached with the training step.
        self.step_hook: OptimizerStepHook | None = None
        self.exchange: LocalExchange | DDPExchange | FSDP2Exchange = LocalExchange()
        #: What torch.compile means for the attempts (``compile_watch.py``).
        self.compile_watch = CompileWatch()
        self._loop = AttemptLoop(self)
        self._users: set[int] = set()
        self._resumed: dict[str, Any] | None = None
        self._installed: set[str] = set()

    # ------------------------------------------------------------------ get it

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
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            register_exit_grace()  # the pack's callbacks run collectives here (see register_exit_grace)
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

    # ------------------------------------------------------------------ read it

    def installed(self, stage: str) -> bool:
        """Whether the engine wraps ``stage``'s steps now (``"train"``, ``"validation"``, ``"test"``, ``"predict"``)."""
        return stage in self._installed

    def batch_size(self, batch: Any) -> int:
        """The samples in ``batch`` as the engine counts them (1 for a batch without a sample dimension)."""
        return batch_samples(batch)

    def effective_k(self, batch: Any) -> int:
        """The micro-batches ``batch`` runs as now: k, raised to keep micro-batches within
        :attr:`max_micro_batch_size`, at most one per sample, 1 for a batch that may not be split."""
        return self._effective_k(batch_samples(batch), batch)

    def micro_batch_size(self, batch: Any) -> int:
        """Samples in the largest micro-batch of ``batch`` now."""
        n = batch_samples(batch)
        return math.ceil(n / self._effective_k(n, batch))

    def _effective_k(self, n: int, batch: Any) -> int:
        if not self.splittable(batch):
            return 1
        k = self.k
        if self.max_micro_batch_size:
            k = max(k, math.ceil(n / self.max_micro_batch_size))
        return self.compile_watch.cap(n, max(1, min(k, n)), "train")

    @property
    def world_size(self) -> int:
        """Ranks that vote on every batch (1 on a single device)."""
        return self.exchange.world_size

    @property
    def compiled(self) -> bool:
        """Whether the module has compiled parts (``_compiled.py``): splits mark the batch dimension dynamic."""
        return self.compile_watch.compiled

    @property
    def recompiles(self) -> RecompileBudget:
        """The recompilations the pack caused in this fit (splits, precision switches)."""
        return self.compile_watch.recompiles

    @property
    def rungs(self) -> list[Rung]:
        """The recovery rungs past more micro-batches, in order."""
        return self.ladder.rungs

    @property
    def active_rungs(self) -> list[str]:
        """The names of the recovery rungs turned on in this run beyond more micro-batches (saved with k)."""
        return self.ladder.active

    @property
    def rung_listeners(self) -> list[Callable[[Rung, str], None]]:
        """``listener(rung, reason)``, told after a rung was turned on (by an OOM, or on resume)."""
        return self.ladder.listeners

    def available_rungs(self) -> list[Rung]:
        """The rungs of the ladder still to try, in order: off, and not found unable to change anything."""
        return self.ladder.available()

    def snapshot_bytes(self) -> int:
        """Device bytes the engine's own copies hold through a training step, for memory budgets.

        Before each batch the engine copies what a failed attempt must not change (BatchNorm statistics,
        torchmetrics tensor states); 0 until it is installed.
        """
        return self._loop.side_effects.nbytes() if self._installed else 0

    # ------------------------------------------------------------------ change it

    def propose(self, k: int, source: Source | str, reason: str, batch_size: int | None = None) -> int:
        """Ask for k micro-batches; returns the k now in force.

        Precedence: a proposal from ``"oom"`` raises k and always wins; any proposal that lowers k is
        capped so the micro-batch stays within :attr:`max_micro_batch_size` (when ``batch_size`` is known).
        """
        positive_int("k", k, unit="micro-batches")
        source = _as_source(source)  # a caller's own source stays
        if k < self.k and source is not Source.OOM and self.max_micro_batch_size and batch_size:
            k = max(k, math.ceil(batch_size / self.max_micro_batch_size))
        if k != self.k:
            change = KChange(self.trainer.global_step, self.k, k, batch_size or 0, source, reason)
            self.k = k
            self._notify(change)
        return self.k

    def set_eval_k(self, stage: str, k: int, reason: str, batch_size: int) -> None:
        """Split ``stage``'s batches into ``k`` chunks from now on (the attempt loop's, after an agreed OOM)."""
        change = KChange(
            self.trainer.global_step, self.eval_k.get(stage, 1), k, batch_size, Source.OOM, reason, stage
        )
        self.eval_k[stage] = k
        self._notify(change)

    def _notify(self, change: KChange) -> None:
        self.history.append(change)
        for listener in self.listeners:
            listener(change)

    def add_rung(self, rung: Rung) -> None:
        """Add ``rung`` to the end of the recovery ladder (once per name); a rung restored on resume needs to be
        added before :meth:`resume`."""
        self.ladder.add(rung)

    def turn_on(self, name: str, reason: str, state: dict[str, Any] | None = None) -> bool:
        """Turn the rung ``name`` on now, on this rank (the engine does it on every rank after an agreed OOM);
        returns whether anything changed."""
        index = self.ladder.index(name)
        if state:
            self.rungs[index].load_state_dict(state)
        return self.ladder.turn_on((index,), reason)

    @property
    def compile_cause(self) -> str | None:
        """Why the next training attempt may recompile besides a new micro-batch size (a precision switch sets
        it); set, it holds for the next attempt of every stage (each stage's compiled frames recompile once)."""
        return self.compile_watch.cause("train")

    @compile_cause.setter
    def compile_cause(self, cause: str | None) -> None:
        self.compile_watch.set_cause(cause, ("train", *EVAL_STAGES))

    def leave_no_trace(self) -> contextlib.AbstractContextManager[None]:
        """Run extra forwards whose side effects are undone (the loss-weighting check uses it).

        Values logged with ``self.log`` inside are dropped, and torchmetrics states and BatchNorm
        statistics are restored on exit, with the same snapshot a failed attempt is undone with.
        """
        return self._loop.leave_no_trace()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The engine's decisions, plain values: k, the evaluation k per stage, the active rungs."""
        return {
            "k": self.k,
            "eval_k": [[stage, k] for stage, k in sorted(self.eval_k.items())],
            "rungs": list(self.active_rungs),
            "rung_state": {rung.name: rung.state_dict() for rung in self.rungs if rung.active},
        }

    def resume(self) -> dict[str, Any] | None:
        """Apply the state restored from a checkpoint, once; returns that state to every caller (``None``: none).

        The callbacks call it once their listeners are in place, so that the change is announced like any
        other; the rungs named in the state are turned on again (those added with :meth:`add_rung` by then).
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
        for name in state.get("rungs", []):
            if name in self.ladder.names() and not self.rungs[self.ladder.index(name)].active:
                self.turn_on(name, "restored from checkpoint", state.get("rung_state", {}).get(name))
        return state

    # ------------------------------------------------------------------ installation

    def _install(self, training: bool) -> None:
        trainer, module = self.trainer, self.trainer.lightning_module
        strategy = trainer.strategy
        if not self._installed:
            self._loop.patch_evaluation(module)
            self.compile_watch.compiled = is_compiled_anywhere(module)
            self._installed.add("eval")
            if isinstance(strategy, ModelParallelStrategy):  # evaluation all-gathers too: the ranks vote
                check_strategy(strategy, module)
                self.exchange = make_exchange(strategy)
        if training and "train" not in self._installed:
            check_supported(trainer, module)
            if not isinstance(self.exchange, FSDP2Exchange):
                self.exchange = make_exchange(strategy)
            self._loop.patch_training(strategy.model if isinstance(self.exchange, DDPExchange) else None)
            self.step_hook = OptimizerStepHook.attach(trainer, self)
            self.step_hook.recovery = self._step_recovery
            self._installed.add("train")

    def _uninstall(self) -> None:
        if not self._installed:
            return
        self.ladder.turn_off()
        if "train" in self._installed:
            if self.step_hook.recovery == self._step_recovery:
                self.step_hook.recovery = None
            self.step_hook.release(self)
        if isinstance(self.exchange, FSDP2Exchange):
            self.exchange.uninstall()
        self._loop.unpatch()
        self.exchange = LocalExchange()
        self._installed = set()

    def _step_recovery(self) -> Callable[[int, int], list[Vote]] | None:
        """How the optimizer step's OOM recovery votes; ``None`` while no OOM handler is set."""
        return self.exchange.vote if self.oom_handler is not None else None


def _as_source(source: Source | str) -> Source | str:
    """``source`` as a :class:`Source` when it names one; a caller's own source as it is."""
    try:
        return Source(source)
    except ValueError:
        return source
