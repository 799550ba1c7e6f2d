"""The micro-batch engine's loop: each training batch as k micro-batches, retried until every rank agrees.

See :mod:`lightning_gpuopt.microbatch` for what the engine does and its contract; an attempt's side
effects live in ``attempt.py``, where it can run in ``setup_checks.py``, the optimizer step in ``step.py``,
the recovery rungs in ``rungs.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor

from lightning_gpuopt import _compat
from lightning_gpuopt._compiled import (
    RecompileBudget,
    caused_compilations,
    compilations_since,
    compile_marker,
    is_compiled_anywhere,
    mark_batch_dynamic,
)
from lightning_gpuopt.batching import (
    SPLIT_HOOK,
    UnsplittableBatchError,
    batch_size_of,
    merge_outputs,
    split_batch,
)
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory import free_memory, get_probe, is_maybe_size_error, is_oom_error
from lightning_gpuopt.microbatch.attempt import (
    Attempt,
    SideEffects,
    emit_logs,
    merge_grads,
    restore_grads,
    split_output,
)
from lightning_gpuopt.microbatch.errors import (
    LossWeightingError,
    MicroBatchOOMError,
    RankOutOfMemoryError,
    Refused,
)
from lightning_gpuopt.microbatch.exchange import (
    DDPExchange,
    FSDP2Exchange,
    LocalExchange,
    PeerFailure,
    register_exit_grace,
)
from lightning_gpuopt.microbatch.loss_weighting import LossWeighting
from lightning_gpuopt.microbatch.rungs import ActivationCheckpointing, Rung
from lightning_gpuopt.microbatch.setup_checks import check_strategy, check_supported, make_exchange
from lightning_gpuopt.microbatch.step import OptimizerStepHook
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
    rung_bits,
)

__all__ = ["CHECKPOINTING", "EVAL_STAGES", "EngineState", "KChange", "MicroBatchEngine", "WeightFn"]

#: The name of the activation-checkpointing rung in the engine's state.
CHECKPOINTING = ActivationCheckpointing.name

#: The evaluation steps the engine wraps, by the name of the strategy method.
EVAL_STAGES = ("validation", "test", "predict")

#: Counts what a micro-batch contributes to the batch's loss (samples, tokens, ...); normalised per batch.
WeightFn = Callable[[Any], "int | float | Tensor"]

_ENGINE_ATTR = "_gpuopt_microbatch_engine"
#: How often the attempt checks may send one batch back before the engine gives up (each re-run
#: follows a change the check made, such as one precision switch).
_MAX_RECHECKS = 8


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
        self.rungs: list[Rung] = []
        #: ``listener(rung, reason)``, told after a rung was turned on (by an OOM, or on resume).
        self.rung_listeners: list[Callable[[Rung, str], None]] = []
        self._spent_rungs: set[str] = set()
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
        #: The names of the recovery rungs turned on in this run beyond more micro-batches (saved with k).
        self.active_rungs: list[str] = []
        self.listeners: list[Callable[[KChange], None]] = []
        self._users: set[int] = set()
        self._resumed: dict[str, Any] | None = None
        #: The smallest micro-batch (samples) that ran in this fit, per stage.
        self._smallest_ran: dict[str, int] = {}
        self._installed: set[str] = set()
        self._attempt: Attempt | None = None
        self._skip_backward = False
        self._skip_zero_grad = False
        self._phase = "forward"
        #: The Trainer's optimizer-step hook (``step.py``), attached with the training step.
        self.step_hook: OptimizerStepHook | None = None
        self.exchange: LocalExchange | DDPExchange | FSDP2Exchange = LocalExchange()
        #: Whether the module has compiled parts (``_compiled.py``): splits mark the batch dimension dynamic.
        self.compiled = False
        #: The recompilations the pack caused in this fit (splits, precision switches).
        self.recompiles = RecompileBudget()
        self._compile_causes: dict[str, str] = {}  # per stage: why its next attempt may recompile
        self._last_k: dict[str, int] = {}
        self._single_ok: set[str] = set()  # stages where a micro-batch of 2 failed under compile

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
            if name in self._rung_names() and not self.rungs[self._rung_index(name)].active:
                self.turn_on(name, "restored from checkpoint", state.get("rung_state", {}).get(name))
        return state

    def add_rung(self, rung: Rung) -> None:
        """Add ``rung`` to the end of the recovery ladder (once per name); a rung restored on resume needs to be
        added before :meth:`resume`."""
        if not isinstance(rung, Rung) or not rung.name:
            raise TypeError(
                f"a recovery rung must be a named `Rung` (lightning_gpuopt.microbatch.rungs), got {rung!r}"
            )
        if rung.name not in self._rung_names():
            self.rungs.append(rung)

    def turn_on(self, name: str, reason: str, state: dict[str, Any] | None = None) -> bool:
        """Turn the rung ``name`` on now, on this rank (the engine does it on every rank after an agreed OOM);
        returns whether anything changed."""
        if state:
            self.rungs[self._rung_index(name)].load_state_dict(state)
        return self._turn_on((self._rung_index(name),), reason)

    def _rung_names(self) -> list[str]:
        return [rung.name for rung in self.rungs]

    def _rung_index(self, name: str) -> int:
        try:
            return self._rung_names().index(name)
        except ValueError:
            raise ValueError(
                f"no recovery rung named {name!r} in this run's ladder ({self._rung_names()}); add it with "
                "`MicroBatchEngine.add_rung` (OOMRecovery(rungs=[...]) does)"
            ) from None

    def available_rungs(self) -> list[Rung]:
        """The rungs of the ladder still to try, in order: off, and not found unable to change anything."""
        return [rung for rung in self.rungs if not rung.active and rung.name not in self._spent_rungs]

    def _turn_on(self, indices: tuple[int, ...], reason: str) -> bool:
        changed = False
        for i in indices:
            rung = self.rungs[i]
            if rung.active:
                continue
            if not rung.apply(self.trainer, reason):
                self._spent_rungs.add(rung.name)  # nothing to change: not asked again in this fit
                continue
            rung.active = changed = True
            if rung.name not in self.active_rungs:
                self.active_rungs.append(rung.name)
            for listener in list(self.rung_listeners):
                listener(rung, reason)
        return changed

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

    @contextlib.contextmanager
    def leave_no_trace(self) -> Iterator[None]:
        """Run extra forwards whose side effects are undone (the loss-weighting check uses it).

        Values logged with ``self.log`` inside are dropped, and torchmetrics states and BatchNorm
        statistics are restored on exit, with the same snapshot a failed attempt is undone with.
        """
        snapshot = self._effects.snapshot()
        previous, self._attempt = self._attempt, Attempt()
        try:
            yield
        finally:
            self._attempt = previous
            SideEffects.restore(snapshot)

    def snapshot_bytes(self) -> int:
        """Device bytes the engine's own copies hold through a training step, for memory budgets.

        Before each batch the engine copies what a failed attempt must not change (BatchNorm statistics,
        torchmetrics tensor states); 0 until it is installed.
        """
        return self._effects.nbytes() if self._installed else 0

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
            self._effects = SideEffects(module)
            self.compiled = is_compiled_anywhere(module)
            self._installed.add("eval")
            if isinstance(strategy, ModelParallelStrategy):  # evaluation all-gathers too: the ranks vote
                check_strategy(strategy, module)
                self.exchange = make_exchange(strategy)
        if training and "train" not in self._installed:
            check_supported(trainer, module)
            if not isinstance(self.exchange, FSDP2Exchange):
                self.exchange = make_exchange(strategy)
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
            self.step_hook = OptimizerStepHook.attach(trainer, self)
            self.step_hook.recovery = self._step_recovery
            self._installed.add("train")

    def _uninstall(self) -> None:
        if not self._installed:
            return
        strategy, module = self.trainer.strategy, self._module
        names = [(strategy, f"{stage}_step") for stage in EVAL_STAGES] + [(module, "log")]
        for rung in self.rungs:
            if rung.active:
                rung.undo(self.trainer)
                rung.active = False
        if "train" in self._installed:
            names += [(strategy, "training_step"), (module, "backward"), (module, "optimizer_zero_grad")]
            if self.step_hook.recovery == self._step_recovery:
                self.step_hook.recovery = None
            self.step_hook.release(self)
            if self._ddp_forward_sync is not None:
                strategy.model.require_forward_param_sync = self._ddp_forward_sync
        if isinstance(self.exchange, FSDP2Exchange):
            self.exchange.uninstall()
        for obj, name in names:
            if name in vars(obj):
                delattr(obj, name)
        self.exchange = LocalExchange()
        self._installed = set()

    def _step_recovery(self) -> Callable[[int, int], list[Vote]] | None:
        """How the optimizer step's OOM recovery votes; ``None`` while no OOM handler is set."""
        return self.exchange.vote if self.oom_handler is not None else None

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
        attempt.calls.append((name, value, args, kwargs))
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
        snapshot = self._effects.snapshot()
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
            marker = self._before_attempt()
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
                    restore_grads(params, stash)
                    raise first_size_error from None
                if isinstance(
                    err, LossWeightingError
                ):  # the loss-weighting check refused to split: not an OOM to retry
                    restore_grads(params, stash)
                    raise
                if self.oom_handler is None or not (is_oom_error(err) or size_error):
                    restore_grads(params, stash)
                    self._raise_if_too_small(err, n, k)
                    raise
                if size_error:
                    first_size_error = err.with_traceback(
                        None
                    )  # re-raised later; its frames must not pin memory
                failure = self._describe(err, probe if measured else None, batch_idx, n, k, baseline, params)
            self._after_attempt(marker, "train", n, k)
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
                status, recovery, fatal = self._ask_handler(failure, smallest_failed, batch)
                voted_k = (recovery.k or start_k) if recovery is not None else k
            try:
                agreement = self._settle(
                    self.exchange.vote,
                    status,
                    voted_k,
                    k,
                    peer_votes,
                    fatal,
                    f"at step {trainer.global_step}",
                )
            except torch.OutOfMemoryError:
                restore_grads(params, stash)
                raise
            if not agreement.retry:
                # Every rank kept its attempt, so every rank asks the checks here, at the same point (a check
                # may all-reduce its own flags, and answers alike on every rank).
                if not self._recheck_asked(batch_idx, output):
                    break
                rechecks += 1
                if rechecks > _MAX_RECHECKS:
                    restore_grads(params, stash)
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
            if self._at_compile_cap(n, k, "train"):  # 2 samples a micro-batch did not fit: 1 may now
                self._single_ok.add("train")
            if self._turn_on(
                agreement.rungs,
                f"{self._reason(agreement, failure)}, and the micro-batches cannot get smaller",
            ):
                smallest_failed = n + 1  # a sample needs less memory now: sizes that failed may fit
            self.propose(agreement.k, Source.OOM, self._reason(agreement, failure), batch_size=n)
        self._ran(n, k)
        self._emit_logs(*self._pending_logs)
        merge_grads(params, stash)
        if boundary:
            self.exchange.reduce()
        if agreement.source:
            self.propose(agreement.k, agreement.source, self._reason(agreement, None, proposal), batch_size=n)
        self._skip_backward = True
        self._skip_zero_grad = first_in_window
        return output

    # ------------------------------------------------------------------ the retry path (training and evaluation)

    def _ask_handler(
        self, failure: OOMFailure, smallest_failed: int, batch: Any
    ) -> tuple[Status, Recovery | None, BaseException | None]:
        """This rank's say after an OOM: (the vote's flags, the handler's :class:`Recovery`, the error that
        ends the run on this rank when nothing is left to try)."""
        try:
            recovery = self.oom_handler(failure, smallest_failed, self.splittable(batch))
        except torch.OutOfMemoryError as err:  # nothing left to try (MicroBatchOOMError)
            return Status.FATAL, None, err
        if isinstance(recovery, int):
            recovery = Recovery(recovery)
        return Status.OOM | rung_bits(self._rung_index(name) for name in recovery.rungs), recovery, None

    @staticmethod
    def _settle(
        vote: Callable[[int, int], list[Vote]],
        status: Status,
        voted_k: int,
        k: int,
        peer_votes: list[Vote] | None,
        fatal: BaseException | None,
        where: str,
    ) -> Agreement:
        """Every rank's decision on an attempt; raises on every rank alike when any rank has nothing left to try.

        ``peer_votes``: the votes at which another rank's failure already stopped this attempt (FSDP2).
        """
        agreement = agree(peer_votes if peer_votes is not None else vote(status, voted_k), k)
        if agreement.fatal_ranks:
            if fatal is not None:
                raise fatal
            raise RankOutOfMemoryError(
                f"Rank(s) {', '.join(map(str, agreement.fatal_ranks))} ran out of memory {where} with nothing "
                "left to split; every rank stops (the error on those ranks has the memory breakdown and next "
                "steps)."
            )
        return agreement

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
        SideEffects.restore(snapshot)

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
        snapshot = self._effects.snapshot() if self.oom_handler is not None else []
        probe = get_probe(self.trainer.strategy.root_device)
        measured = probe.kind != "cpu"
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        smallest_failed = n + 1
        while True:
            k = max(1, min(self.eval_k.get(stage, 1), n)) if self.splittable(batch) else 1
            k = self._compile_cap(n, k, stage)
            baseline = probe.allocated if measured else None
            failure: OOMFailure | None = None
            peer_votes = None
            marker = self._before_attempt()
            try:
                try:
                    if voting:
                        self.exchange.begin(k)
                    elif k == 1:
                        return original(*args, **kwargs)
                    output, logs = self._run_eval(original, batch, args[1:], kwargs, n, k)
                finally:  # once, however the attempt ended
                    self._after_attempt(marker, stage, n, k)
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
            SideEffects.restore(snapshot)
            free_memory()
        if failure is not None:
            status, recovery, fatal = self._ask_handler(failure, smallest_failed, batch)
            if recovery is not None:
                voted_k = max(recovery.k or k + 1, k + 1)
        agreement = self._settle(
            vote, status, voted_k, k, peer_votes, fatal, f"in {stage} at batch {batch_idx}"
        )
        if not agreement.retry:
            return True
        if failure is None and peer_votes is None:  # another rank failed after its last collective
            SideEffects.restore(snapshot)
        if self._at_compile_cap(n, k, stage):
            self._single_ok.add(stage)
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
        self._mark_dynamic(chunks)
        weights = self.loss_weighting.weights(self, chunks)  # the training's decision, or its fallback
        attempt = Attempt()
        outputs = []
        self._attempt = attempt
        try:
            for chunk, weight in zip(chunks, weights):
                attempt.start()
                outputs.append(original(chunk, *rest, **kwargs))
                attempt.keep(weight)
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
        return self._compile_cap(n, max(1, min(k, n)), "train")

    def _compile_cap(self, n: int, k: int, stage: str) -> int:
        """``k``, lowered under compile so that no micro-batch has 1 sample while 2 may fit: dynamo specialises a
        size of 1, so it would recompile once more."""
        if not self.compiled or stage in self._single_ok or n < 4:
            return k
        return min(k, n // 2)

    def _at_compile_cap(self, n: int, k: int, stage: str) -> bool:
        return self.compiled and stage not in self._single_ok and n >= 4 and k == n // 2

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

    def _run(self, batch: Any, rest: tuple, kwargs: dict, n: int, k: int, accumulate: int) -> Any:
        chunks = self._micro_batches(batch, k)
        self._mark_dynamic(chunks)
        # The loss weighting's one call site: at the first split it runs the step on a piece of the batch.
        weights = self.loss_weighting.weights(
            self, chunks, lambda piece: self._orig_training_step(piece, *rest, **kwargs), batch
        )
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        attempt = Attempt()
        total: Tensor | None = None
        self._attempt = attempt
        try:
            for chunk, weight in zip(chunks, weights):
                self._phase = "forward"
                attempt.start()
                out = self._orig_training_step(chunk, *rest, **kwargs)
                loss, extra = split_output(out)
                if loss is None:
                    raise Refused(
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
                attempt.keep(weight)  # what the step and its backward logged
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

    # ------------------------------------------------------------------ compiled models

    def _mark_dynamic(self, chunks: list[Any]) -> None:
        """Under compile, a split marks the batch dimension dynamic: one recompilation serves every later size."""
        if self.compiled and len(chunks) > 1:
            for chunk in chunks:
                mark_batch_dynamic(chunk, self._batch_size(chunk))

    @property
    def compile_cause(self) -> str | None:
        """Why the next training attempt may recompile besides a new micro-batch size (a precision switch sets
        it); set, it holds for the next attempt of every stage (each stage's compiled frames recompile once)."""
        return self._compile_causes.get("train")

    @compile_cause.setter
    def compile_cause(self, cause: str | None) -> None:
        for stage in ("train", *EVAL_STAGES):
            if cause is None:
                self._compile_causes.pop(stage, None)
            else:
                self._compile_causes[stage] = cause

    def _before_attempt(self) -> tuple[int, Any] | None:
        return compile_marker() if self.compiled else None

    def _after_attempt(self, marker: tuple[int, Any] | None, stage: str, n: int, k: int) -> None:
        """Count what dynamo compiled during an attempt, and record what the pack's change caused."""
        if marker is None:
            return
        self.recompiles.seen(compilations_since(marker))  # every compilation uses up dynamo's per-frame limit
        last = self._last_k.get(stage)
        self._last_k[stage] = k
        cause = self._compile_causes.pop(stage, None)
        if last is None:  # the stage's first attempt in this fit: its compilation is the model's own
            return
        if k != last:
            before, after = math.ceil(n / last), math.ceil(n / k)
            where = "" if stage == "train" else f" in {stage}"
            cause = f"{'split' if k > last else 'growing back'} {before} → {after}{where}"
            if last == 1:
                cause += " (batch dimension dynamic from now on)"
        if cause is None:
            return
        new, names = caused_compilations(marker)
        if not new:
            return
        self.recompiles.add(new, cause, names)
        record_decision(
            self.trainer,
            "recompilation",
            "torch.compile",
            f"recompiled after {cause}" + (f" ({new} frames)" if new > 1 else ""),
            frames=new,
            cause=cause,
            stage=stage,
        )

    def _emit_logs(self, logs: list, weights: list[float], n: int) -> None:
        emit_logs(self._orig_log, logs, weights, n, self.sum_log_keys)

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
