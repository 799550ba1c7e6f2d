"""The micro-batch engine: the one owner of k for a Trainer, its state, and what callbacks read and propose.

See :mod:`lightning_gpuopt.microbatch` for what the engine does and its contract. Callbacks attach to it as
its users and answer its questions (``users.py``); nothing outside the engine writes into it. The batches
run in ``attempt_loop.py`` (an attempt's side effects in ``side_effects.py``); k lives in ``splits.py``; the
setups it refuses are in ``setup_checks.py``, the optimizer step in ``step.py``, the recovery rungs in
``rungs.py``, torch.compile's part in ``compile_watch.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_gpuopt._compiled import RecompileBudget, is_compiled_anywhere
from lightning_gpuopt.microbatch.attempt_loop import EVAL_STAGES, AttemptLoop
from lightning_gpuopt.microbatch.batch_runs import Exchange, MicroBatchBackward
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
from lightning_gpuopt.microbatch.side_effects import batch_samples
from lightning_gpuopt.microbatch.splits import KChange, Splits
from lightning_gpuopt.microbatch.step import OptimizerStepHook
from lightning_gpuopt.microbatch.users import MicroBatchUser, Users
from lightning_gpuopt.votes import Source, Vote

__all__ = [
    "CHECKPOINTING",
    "EVAL_STAGES",
    "EngineState",
    "KChange",
    "MicroBatchBackward",
    "MicroBatchEngine",
    "MicroBatchUser",
    "WeightFn",
]

#: The name of the activation-checkpointing rung in the engine's state.
CHECKPOINTING = ActivationCheckpointing.name

#: Counts what a micro-batch contributes to the batch's loss (samples, tokens, ...); normalised per batch.
WeightFn = Callable[[Any], "int | float | torch.Tensor"]

_ENGINE_ATTR = "_gpuopt_microbatch_engine"

#: What the engine's former writable slots are now: the user method that answers, or the method that changes it.
_NOW = {
    "oom_handler": "MicroBatchUser.decide_oom",
    "splittable": "MicroBatchUser.may_split",
    "loss_weighting": "MicroBatchUser.weighting",
    "sum_log_keys": "MicroBatchUser.log_keys_to_sum",
    "next_proposal": "MicroBatchUser.next_proposal",
    "max_micro_batch_size": "MicroBatchUser.micro_batch_cap",
    "measure_split": "MicroBatchUser.measure_split",
    "measure_refused": "MicroBatchUser.measure_refused",
    "attempt_checks": "MicroBatchUser.check_attempt",
    "listeners": "MicroBatchUser.k_changed",
    "rung_listeners": "MicroBatchUser.rung_turned_on",
    "backward_listeners": "MicroBatchUser.after_backward",
    "compile_cause": "MicroBatchEngine.expect_recompile",
    "k": "MicroBatchEngine.propose",
    "eval_k": "MicroBatchEngine.restore_eval_k",
}


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
    it back with :meth:`release`; the patches are removed when the last user releases it. Its state is read
    only from outside: a user answers the engine's questions (:class:`MicroBatchUser`), and proposes changes
    through its methods (:meth:`propose`, :meth:`turn_on`, :meth:`expect_recompile`).
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        #: How micro-batch losses are weighted while no user gives a weighting (``"auto"``: checked at the first split).
        self._users = Users(LossWeighting(source="MicroBatchEngine"))
        #: What torch.compile means for the attempts (``compile_watch.py``).
        self._compile_watch = CompileWatch()
        users = self._users
        self._splits = Splits(
            trainer, self._compile_watch, users.may_split, users.micro_batch_cap, users.k_changed
        )
        #: The recovery ladder past more micro-batches, in order (``rungs.py``): the OOM decider names the rung to
        #: turn on in its ``Recovery``; every callback's rungs must be registered alike on every rank.
        self._ladder = Ladder(trainer)
        self._ladder.listeners.append(self._users.rung_turned_on)
        self._loop = AttemptLoop(trainer, self._users, self._splits, self._ladder, self._compile_watch)
        #: The Trainer's optimizer-step hook (``step.py``), attached with the training step.
        self._step_hook: OptimizerStepHook | None = None
        self._resumed: dict[str, Any] | None = None
        self._installed: set[str] = set()

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_"):
            raise AttributeError(_read_only(name))
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if not name.startswith("_"):
            raise AttributeError(_read_only(name))
        object.__delattr__(self, name)

    # ------------------------------------------------------------------ get it

    @classmethod
    def attach(cls, trainer: pl.Trainer, user: object, training: bool = True) -> MicroBatchEngine:
        """The Trainer's engine, created and installed on first use; ``user`` holds it until :meth:`release`.

        A :class:`MicroBatchUser` answers the engine's questions from now on (its answers composed with the other
        users', in the order they attached); one whose answers cannot compose with another's is refused here, in
        one line naming both. With ``training=False`` only the evaluation steps are wrapped (``validate``,
        ``test`` and ``predict`` outside of ``fit``); ``fit`` wraps both.
        """
        engine = getattr(trainer, _ENGINE_ATTR, None)
        if engine is None:
            engine = cls(trainer)
            setattr(trainer, _ENGINE_ATTR, engine)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            register_exit_grace()  # the pack's callbacks run collectives here (see register_exit_grace)
        try:
            engine._users.add(user)
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
        """Stop using the engine (``user`` is asked nothing more); the last user's release removes every patch."""
        self._users.remove(user)
        if not len(self._users):
            holder = EngineState.of(self._trainer)
            if holder is not None:
                holder._last = self.state_dict()  # what a checkpoint written after this fit holds
            self._uninstall()
            if getattr(self._trainer, _ENGINE_ATTR, None) is self:
                delattr(self._trainer, _ENGINE_ATTR)

    # ------------------------------------------------------------------ read it

    @property
    def trainer(self) -> pl.Trainer:
        return self._trainer

    @property
    def users(self) -> tuple[object, ...]:
        """The engine's users, in the order they attached (the order it asks them in)."""
        return self._users.all

    @property
    def k(self) -> int:
        """Micro-batches per training batch (before :meth:`effective_k`'s cap and the batch's samples)."""
        return self._splits.k

    @property
    def eval_k(self) -> Mapping[str, int]:
        """Chunks per evaluation batch, per stage, after an OOM there (a read-only view)."""
        return MappingProxyType(self._splits.eval_k)

    @property
    def history(self) -> tuple[KChange, ...]:
        """Every change of k in this fit, in order."""
        return tuple(self._splits.history)

    @property
    def max_micro_batch_size(self) -> int | None:
        """The largest micro-batch allowed (the smallest of the users' caps: MemoryAwareBatchSize's budget)."""
        return self._users.micro_batch_cap()

    @property
    def loss_weighting(self) -> LossWeighting:
        """How micro-batch losses are weighted (a user's, else the engine's own ``"auto"``)."""
        return self._users.weighting

    @property
    def sum_log_keys(self) -> frozenset[str]:
        """Logged keys summed over micro-batches instead of averaged (every user's)."""
        return self._users.sum_log_keys

    def splittable(self, batch: Any) -> bool:
        """Whether ``batch`` may be split (every user allows it)."""
        return self._users.may_split(batch)

    def installed(self, stage: str) -> bool:
        """Whether the engine wraps ``stage``'s steps now (``"train"``, ``"validation"``, ``"test"``, ``"predict"``)."""
        return stage in self._installed

    def batch_size(self, batch: Any) -> int:
        """The samples in ``batch`` as the engine counts them (1 for a batch without a sample dimension)."""
        return batch_samples(batch)

    def effective_k(self, batch: Any) -> int:
        """The micro-batches ``batch`` runs as now: k, raised to keep micro-batches within
        :attr:`max_micro_batch_size`, at most one per sample, 1 for a batch that may not be split."""
        return self._splits.effective_k(batch_samples(batch), batch)

    def micro_batch_size(self, batch: Any) -> int:
        """Samples in the largest micro-batch of ``batch`` now."""
        n = batch_samples(batch)
        return math.ceil(n / self._splits.effective_k(n, batch))

    @property
    def exchange(self) -> Exchange:
        """How the ranks vote and reduce (``exchange.py``)."""
        return self._loop.exchange

    @property
    def step_tokens(self) -> float | None:
        """The last optimizer step's tokens on all ranks, where its batches are shared by tokens (``None``: they are
        not, or no step finished yet)."""
        return self._loop.shares.last_total

    @property
    def step_hook(self) -> OptimizerStepHook | None:
        """The Trainer's optimizer-step hook (``step.py``), attached with the training step."""
        return self._step_hook

    @property
    def world_size(self) -> int:
        """Ranks that vote on every batch (1 on a single device)."""
        return self._loop.exchange.world_size

    @property
    def compiled(self) -> bool:
        """Whether the module has compiled parts (``_compiled.py``): splits mark the batch dimension dynamic."""
        return self._compile_watch.compiled

    @property
    def recompiles(self) -> RecompileBudget:
        """The recompilations the pack caused in this fit (splits, precision switches)."""
        return self._compile_watch.recompiles

    @property
    def compile_cause(self) -> str | None:
        """Why the next training attempt may recompile besides a new micro-batch size (:meth:`expect_recompile`)."""
        return self._compile_watch.cause("train")

    @property
    def rungs(self) -> tuple[Rung, ...]:
        """The recovery rungs past more micro-batches, in order."""
        return tuple(self._ladder.rungs)

    @property
    def active_rungs(self) -> tuple[str, ...]:
        """The names of the recovery rungs turned on in this run beyond more micro-batches (saved with k)."""
        return tuple(self._ladder.active)

    def available_rungs(self) -> list[Rung]:
        """The rungs of the ladder still to try, in order: off, and not found unable to change anything."""
        return self._ladder.available()

    def snapshot_bytes(self) -> int:
        """Device bytes the engine's own copies hold through a training step, for memory budgets.

        Before each batch the engine copies what a failed attempt must not change (BatchNorm statistics,
        torchmetrics tensor states); 0 until it is installed.
        """
        return self._loop.steps.side_effects.nbytes() if self._installed else 0

    # ------------------------------------------------------------------ change it

    def propose(self, k: int, source: Source | str, reason: str, batch_size: int | None = None) -> int:
        """Ask for k micro-batches; returns the k now in force.

        Precedence: a proposal from ``"oom"`` raises k and always wins; any proposal that lowers k is
        capped so the micro-batch stays within :attr:`max_micro_batch_size` (when ``batch_size`` is known).
        """
        return self._splits.propose(k, source, reason, batch_size)

    def restore_eval_k(self, eval_k: Mapping[str, int]) -> None:
        """Take evaluation k's a callback restored from an older checkpoint, for stages that have none yet."""
        self._splits.restore_eval_k(dict(eval_k))

    def add_rung(self, rung: Rung) -> None:
        """Add ``rung`` to the end of the recovery ladder (once per name); a rung restored on resume needs to be
        added before :meth:`resume`."""
        self._ladder.add(rung)

    def turn_on(self, name: str, reason: str, state: dict[str, Any] | None = None) -> bool:
        """Turn the rung ``name`` on now, on this rank (the engine does it on every rank after an agreed OOM);
        returns whether anything changed."""
        index = self._ladder.index(name)
        if state:
            self._ladder.rungs[index].load_state_dict(state)
        return self._ladder.turn_on((index,), reason)

    def expect_recompile(self, cause: str) -> None:
        """The next attempt of every stage may recompile because of ``cause`` (a precision switch says so), besides
        a new micro-batch size (which the engine notes itself); each stage's compiled frames recompile once."""
        self._compile_watch.set_cause(cause, ("train", *EVAL_STAGES))

    def leave_no_trace(self) -> contextlib.AbstractContextManager[None]:
        """Run extra forwards whose side effects are undone (the loss-weighting check uses it).

        Values logged with ``self.log`` inside are dropped, and torchmetrics states and BatchNorm
        statistics are restored on exit, with the same snapshot a failed attempt is undone with.
        """
        return self._loop.steps.leave_no_trace()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The engine's decisions, plain values: k, the evaluation k per stage, the active rungs."""
        return {
            "k": self._splits.k,
            "eval_k": [[stage, k] for stage, k in sorted(self._splits.eval_k.items())],
            "rungs": list(self._ladder.active),
            "rung_state": {rung.name: rung.state_dict() for rung in self._ladder.rungs if rung.active},
        }

    def resume(self) -> dict[str, Any] | None:
        """Apply the state restored from a checkpoint, once; returns that state to every caller (``None``: none).

        The callbacks call it once they attached, so that the change is announced to the users like any other;
        the rungs named in the state are turned on again (those added with :meth:`add_rung` by then).
        """
        holder = EngineState.of(self._trainer)
        state = holder.restored if holder is not None else None
        if state is None:
            return self._resumed
        holder.restored = None
        self._resumed = state
        self._splits.restore_eval_k({str(stage): int(k) for stage, k in state.get("eval_k", [])})
        k = int(state.get("k", 1))
        if k != self._splits.k:
            self.propose(k, Source.RESUME, "restored from checkpoint")
        for name in state.get("rungs", []):
            if name in self._ladder.names() and not self._ladder.rungs[self._ladder.index(name)].active:
                self.turn_on(name, "restored from checkpoint", state.get("rung_state", {}).get(name))
        return state

    # ------------------------------------------------------------------ installation

    def _install(self, training: bool) -> None:
        trainer, module = self._trainer, self._trainer.lightning_module
        strategy, loop = trainer.strategy, self._loop
        if not self._installed:
            loop.patch_evaluation(module)
            self._compile_watch.compiled = is_compiled_anywhere(module)
            self._installed.add("eval")
            if isinstance(strategy, ModelParallelStrategy):  # evaluation all-gathers too: the ranks vote
                check_strategy(strategy, module)
                loop.exchange = make_exchange(strategy)
        if training and "train" not in self._installed:
            check_supported(trainer, module)
            if not isinstance(loop.exchange, FSDP2Exchange):
                loop.exchange = make_exchange(strategy)
            loop.patch_training(strategy.model if isinstance(loop.exchange, DDPExchange) else None)
            self._step_hook = OptimizerStepHook.attach(trainer, self)
            self._step_hook.recovery = self._step_recovery
            self._installed.add("train")

    def _uninstall(self) -> None:
        if not self._installed:
            return
        self._ladder.turn_off()
        if "train" in self._installed:
            if self._step_hook.recovery == self._step_recovery:
                self._step_hook.recovery = None
            self._step_hook.release(self)
        if isinstance(self._loop.exchange, FSDP2Exchange):
            self._loop.exchange.uninstall()
        self._loop.unpatch()
        self._loop.exchange = LocalExchange()
        self._installed = set()

    def _step_recovery(self) -> Callable[[int, int], list[Vote]] | None:
        """How the optimizer step's OOM recovery votes; ``None`` while no user decides on OOMs."""
        return self._loop.exchange.vote if self._users.decide_oom is not None else None


def _read_only(name: str) -> str:
    """Why ``MicroBatchEngine.<name>`` cannot be set, and what to do instead."""
    instead = _NOW.get(name)
    how = f"use {instead}" if instead else "attach a MicroBatchUser that answers the engine's question"
    return (
        f"MicroBatchEngine.{name} cannot be set from outside: the engine asks its users "
        f"(MicroBatchEngine.attach(trainer, user)) and changes its own state; {how}."
    )
