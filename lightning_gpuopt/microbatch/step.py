"""The optimizer step, intercepted once per Trainer, after the closure.

Lightning's precision plugin runs the closure (the training step and its backward), then the
optimizer's ``step``: directly with the plain plugins, through ``GradScaler.step`` with ``16-mixed``.
:class:`OptimizerStepHook` wraps each optimizer's ``step`` there, so that it runs with the gradients
final (unscaled, clipped): first the **guards** (PrecisionSwitch holds a step with non-finite values
back), then the step itself.

With OOM recovery on (OOMRecovery is attached), an out-of-memory error inside the step is handled here,
where smaller micro-batches cannot help:

- The step is retried once, after freeing memory, only when it wrote nothing yet: no parameter,
  gradient or optimizer-state tensor has a new ``_version``. Adam creates its state at the first step
  and then, per parameter, increments its step count and moments before it writes the parameter, so an
  OOM while it creates its state is retried (the partly created state is dropped first), and one after it
  began updating is not. The retry repeats only ``optimizer.step``: the GradScaler has already unscaled
  and checked the gradients, and keeps that for the retry.
- When no retry is possible, or the retry runs out of memory too, the step ends with
  :class:`~lightning_gpuopt.microbatch.OptimizerStepOOMError`, naming the optimizer state and the fixes;
  the GradScaler's record of the step is reset first.
- With several ranks, every rank votes after each optimizer step (in ``strategy.optimizer_step``, which
  every rank runs): a rank that could not step stops every rank with the same error, and none hangs.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gpuopt import _compat
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory import forensics, format_bytes, free_memory, is_oom_error
from lightning_gpuopt.microbatch.errors import OptimizerStepOOMError
from lightning_gpuopt.oom_record import stop_reason
from lightning_gpuopt.votes import Status, Vote

__all__ = ["OptimizerStepHook", "StepGuard"]

#: ``guard(optimizer, loss) -> bool``: ``True`` holds this optimizer step back (the parameters stay as they are).
#: ``loss`` is the closure's (``None`` with a GradScaler, which ran the closure before). Guards run in order,
#: on every rank, and must answer alike on every rank.
StepGuard = Callable[[torch.optim.Optimizer, "Tensor | None"], bool]

_HOOK_ATTR = "_gpuopt_optimizer_step_hook"


class OptimizerStepHook:
    """The one wrapper of ``optimizer.step`` for a Trainer, shared by the engine and PrecisionSwitch.

    Get it with :meth:`attach` and give it back with :meth:`release`; the wrappers go when the last user
    releases it.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self._guards: tuple[StepGuard, ...] = ()
        #: ``() -> vote`` for OOM recovery inside the step: ``None`` lets an OOM there propagate unchanged. The
        #: engine sets it when OOMRecovery is attached; ``vote(status, k)`` returns every rank's vote.
        self.recovery: Callable[[], Callable[[int, int], list[Vote]] | None] | None = None
        #: Optimizer steps that ran out of memory and succeeded when retried, in this fit.
        self.retried_steps = 0
        self._users: set[int] = set()
        self._wrapped: list[tuple[torch.optim.Optimizer, bool, Any]] = []
        self._strategy_step: Any = None

    @property
    def guards(self) -> tuple[StepGuard, ...]:
        """Asked before each step, in the order they were added (see :data:`StepGuard`)."""
        return self._guards

    def add_guard(self, guard: StepGuard) -> None:
        """Ask ``guard`` before each step, after the guards added before it (once)."""
        if guard not in self._guards:
            self._guards = (*self._guards, guard)

    def remove_guard(self, guard: StepGuard) -> None:
        self._guards = tuple(g for g in self._guards if g != guard)

    # ------------------------------------------------------------------ attach and release

    @classmethod
    def attach(cls, trainer: pl.Trainer, user: object) -> OptimizerStepHook:
        """The Trainer's hook, wrapping every optimizer of ``trainer.optimizers`` on first use."""
        hook = getattr(trainer, _HOOK_ATTR, None)
        if hook is None:
            hook = cls(trainer)
            setattr(trainer, _HOOK_ATTR, hook)
            hook._install()
        hook._users.add(id(user))
        return hook

    @classmethod
    def get(cls, trainer: pl.Trainer) -> OptimizerStepHook | None:
        """The Trainer's hook if one is attached."""
        return getattr(trainer, _HOOK_ATTR, None)

    def release(self, user: object) -> None:
        """Stop using the hook; the last user's release unwraps every optimizer."""
        self._users.discard(id(user))
        if self._users:
            return
        for optimizer, had, previous in self._wrapped:
            if had:
                optimizer.step = previous
            elif "step" in vars(optimizer):
                del optimizer.step
        self._wrapped = []
        strategy = self.trainer.strategy
        if "optimizer_step" in vars(strategy):
            del strategy.optimizer_step
        if getattr(self.trainer, _HOOK_ATTR, None) is self:
            delattr(self.trainer, _HOOK_ATTR)

    def _install(self) -> None:
        for optimizer in self.trainer.optimizers:
            self._wrap(optimizer)
        strategy = self.trainer.strategy
        self._strategy_step = strategy.optimizer_step
        strategy.optimizer_step = self._strategy_optimizer_step

    def _wrap(self, optimizer: torch.optim.Optimizer) -> None:
        had = "step" in vars(optimizer)  # an LR scheduler may have wrapped it already
        previous = vars(optimizer).get("step")
        original = optimizer.step
        hook = self

        def step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            return hook._step(opt, original, closure, kwargs)

        # An LR scheduler created before us wrapped `step` and checks its mark; one created later wraps ours
        # (it reads `step.__func__`, hence a bound method).
        if _compat.lr_scheduler_mark(original):
            _compat.set_lr_scheduler_mark(step)
        optimizer.step = types.MethodType(step, optimizer)
        self._wrapped.append((optimizer, had, previous))

    # ------------------------------------------------------------------ every rank, once per optimizer step

    def _strategy_optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any
    ) -> Any:
        vote = self.recovery() if self.recovery is not None else None
        if vote is None:
            return self._strategy_step(optimizer, closure, *args, **kwargs)
        try:
            out = self._strategy_step(optimizer, closure, *args, **kwargs)
        except OptimizerStepOOMError:
            self._agree(vote, Status.OOM | Status.FATAL)
            raise
        except Exception:
            self._agree(vote, Status.FATAL)
            raise
        self._agree(vote, Status.NONE)
        return out

    def _agree(self, vote: Callable[[int, int], list[Vote]], status: Status) -> None:
        votes = vote(int(status), 0)
        if len(votes) < 2 or status is not Status.NONE:
            return
        failed = [rank for rank, v in enumerate(votes) if v.status & Status.FATAL]
        if not failed:
            return
        ranks = ", ".join(map(str, failed))
        if any(votes[rank].status & Status.OOM for rank in failed):
            raise OptimizerStepOOMError(
                f"Rank(s) {ranks} ran out of memory in the optimizer step at step {self.trainer.global_step}; every "
                "rank stops (the error on those ranks names the optimizer state and the fixes)."
            )
        raise RuntimeError(
            f"Rank(s) {ranks} failed in the optimizer step at step {self.trainer.global_step}; every rank stops (see "
            "the error on those ranks)."
        )

    # ------------------------------------------------------------------ the step itself

    def _step(
        self,
        optimizer: torch.optim.Optimizer,
        original: Callable[..., Any],
        closure: Callable[[], Any] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        loss = None
        if closure is not None:  # run it here, so the step can still be held back after seeing the gradients
            with torch.enable_grad():
                loss = closure()
        for guard in self._guards:
            if guard(optimizer, loss):
                return loss
        if self.recovery is None or self.recovery() is None:
            out = original(**kwargs)
            return loss if out is None else out
        versions = _versions(optimizer)
        state_keys = {id(p): set(state) for p, state in optimizer.state.items()}
        message = None
        try:
            out = original(**kwargs)
        except Exception as err:
            if not is_oom_error(err):
                raise
            message = _first_line(err)
            self._tell_caught(err)
        if message is None:
            return loss if out is None else out
        # Outside the except block: the traceback and what it pinned are gone.
        written = _changed(optimizer, versions)
        if not written:
            _drop_new_state(optimizer, state_keys)
            free_memory()
            forensics.action_taken(
                "optimizer step retried once after freeing memory (it had written nothing)"
            )
            try:
                out = original(**kwargs)
            except Exception as err:
                if not is_oom_error(err):
                    raise
                retry_message: str | None = _first_line(err)
                self._tell_caught(err)
            else:
                retry_message = None
            if retry_message is None:
                self.retried_steps += 1
                record_decision(
                    self.trainer,
                    "oom",
                    "MicroBatchEngine",
                    f"optimizer step {self.trainer.global_step} ran out of memory before it wrote anything "
                    f"({message}); retried once after freeing memory, and it ran",
                )
                return loss if out is None else out
            message = f"{message}; retried once after freeing memory: {retry_message}"
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            _compat.reset_grad_scaler(scaler, optimizer)
        error = OptimizerStepOOMError(_explain(self.trainer, optimizer, message, written))
        forensics.action_taken(stop_reason(error))
        raise error

    def _tell_caught(self, err: BaseException) -> None:
        """Tell the OOM listener (GPUOptReport) of an OOM in the step, while what the step made is alive."""
        forensics.failure_caught(err, stage="train", phase="optimizer step", step=self.trainer.global_step)


def _tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every parameter, gradient and optimizer-state tensor the step may write (local shards under FSDP2)."""
    out: list[Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
            out.extend(v for v in optimizer.state.get(p, {}).values() if isinstance(v, Tensor))
    return [_compat.local_tensor(t) for t in out]


def _versions(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {id(t): _compat.tensor_version(t) for t in _tensors(optimizer)}


def _changed(optimizer: torch.optim.Optimizer, versions: dict[int, int]) -> bool:
    """Whether the step wrote a tensor that existed before it (new state tensors do not count)."""
    return any(
        versions.get(id(t), _compat.tensor_version(t)) != _compat.tensor_version(t)
        for t in _tensors(optimizer)
    )


def _drop_new_state(optimizer: torch.optim.Optimizer, before: dict[int, set[Any]]) -> None:
    """Forget the state the failed step began to create, so that the retry creates it whole."""
    for p in list(optimizer.state):
        kept = before.get(id(p), set())
        state = optimizer.state[p]
        for key in [key for key in state if key not in kept]:
            del state[key]
        if not state:
            del optimizer.state[p]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _explain(trainer: pl.Trainer, optimizer: torch.optim.Optimizer, message: str, written: bool) -> str:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, Tensor)
    )
    name = type(optimizer).__name__
    when = (
        "after it had begun writing its state or the parameters, so it could not be retried"
        if written
        else "before it wrote anything"
    )
    return (
        f"Out of memory in the optimizer step ({name}.step) at step {trainer.global_step}, {when}: {message}. "
        f"The optimizer state holds {format_bytes(state_bytes)} for {format_bytes(param_bytes)} of parameters "
        "(Adam-style optimizers keep two moments per parameter, twice the parameters' bytes). Smaller micro-batches "
        "cannot help here: the step's memory does not depend on the batch. Shard the parameters and optimizer state "
        "(FSDP2Strategy, or `gpuopt plan` to pick a sharded plan), offload the optimizer state to the CPU "
        "(FSDP2Strategy(cpu_offload=True)), or use an 8-bit or factored optimizer (bitsandbytes' AdamW8bit, "
        "Adafactor)."
    )
