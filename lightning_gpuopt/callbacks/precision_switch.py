"""PrecisionSwitch: the fastest precision the hardware does well, and a safe fallback on numerical trouble.

A thin callback: its decisions are ``precision_switching.py``'s (the choice, switching down and up, the resume,
the non-finite guard's rule, the record), the ladder ``precision.py``'s, the plugins ``precision_plugins.py``'s
and the global TF32 switch ``tf32_switch.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_gpuopt import _compat
from lightning_gpuopt._metrics import log_metrics
from lightning_gpuopt._validate import keep_options
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.microbatch import MicroBatchEngine, MicroBatchUser
from lightning_gpuopt.microbatch.step import OptimizerStepHook
from lightning_gpuopt.precision import (
    DeviceInfo,
    StabilityWatch,
    StepOutcome,
    any_nonfinite,
    device_info,
    grad_norms,
    precision_index,
    tf32_wanted,
)
from lightning_gpuopt.precision_plugins import SpentScaler, plugin_for, why_precision_fixed
from lightning_gpuopt.precision_switching import (
    Initial,
    PrecisionChange,
    PrecisionSwitchOptions,
    SwitchRecord,
    check_ladder_runs,
    fallback_note,
    fallbacks,
    fsdp2_policy_plan,
    initial_precision,
    switch_verdict,
)
from lightning_gpuopt.strategy import FSDP2Strategy
from lightning_gpuopt.support import StrategyKind, strategy_kind
from lightning_gpuopt.tf32_switch import restore_tf32, turn_on_tf32

__all__ = ["Initial", "PrecisionChange", "PrecisionSwitch", "PrecisionSwitchOptions"]

_METRIC = "gpuopt/precision_index"


class PrecisionSwitch(MicroBatchUser, Callback):
    """Trains in the fastest precision the hardware does well; falls back to a more stable one on trouble.

    At setup, ``initial="auto"`` picks by compute capability (sm >= 8.0: ``bf16-mixed``; sm 7.x:
    ``16-mixed``; a CPU: ``32-true``, with TF32 matmuls where they exist). While training, a step with
    non-finite values is never applied; ``patience`` of them in a row switch down the ladder at a window
    boundary, on every rank alike, and the batch runs again in the new precision. The choice, the
    switches and the held-back steps are decisions in the report; a checkpoint resumes the precision.
    The long form (FSDP2's mixed-precision policy, what each strategy allows): ``docs/precision.md``.

    Args:
        initial: ``"auto"``, ``"keep"``, or one of ``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``.
        ladder: the precisions to fall back through, fastest first (a subset of
            ``("16-mixed", "bf16-mixed", "32-true")``); default: all that the device runs natively.
        patience: troubled optimizer steps in a row that switch precision (>= 1).
        min_scale: the GradScaler scale below which ``16-mixed`` is given up (> 0).
        retry_after: optimizer steps after a fallback before the faster precision is tried again;
            ``None``: never.
        rerun: with ``accumulate_grad_batches`` = 1, run the batch that triggered a switch again in the
            new precision (``False``: it is dropped and counted, and the engine is not used).
        cpu_bf16: ``initial="auto"`` on a CPU picks ``bf16-mixed`` instead of ``32-true``.
        tf32: turn TF32 matmuls on for ``32-true`` runs on sm >= 8.0 (while nothing else chose).
        fp8: ``initial="auto"`` picks ``transformer-engine`` where installed and sm >= 8.9.
        fsdp2_policy: under the pack's FSDP2Strategy, run ``bf16-mixed`` as FSDP2's
            ``MixedPrecisionPolicy`` (bfloat16 all-gathers, float32 reductions; no runtime fallback);
            ``False``: bfloat16 autocast over float32 parameters, with the runtime fallback.
        verbose: print the rank-zero lines.

    Raises:
        ValueError: an unknown name, a ladder out of order, or a number out of range (in ``__init__``);
            in ``setup``, a ``ladder`` or ``initial`` precision the device cannot run, naming an alternative.
        TypeError: an argument of the wrong type.
        ImportError: ``fp8=True`` without Transformer Engine installed.
        FloatingPointError: non-finite steps persist in the last precision of the ladder.

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_gpuopt import PrecisionSwitch
        >>> switch = PrecisionSwitch()  # bf16-mixed on sm >= 8.0, 16-mixed on sm 7.x, 32-true on a CPU
        >>> trainer = pl.Trainer(max_steps=2, accelerator="cpu", callbacks=[switch], logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(BoringModel())
        >>> switch.precision, switch.switches
        ('32-true', [])
    """

    def __init__(
        self,
        initial: Initial = "auto",
        ladder: Sequence[str] | None = None,
        patience: int = 2,
        min_scale: float = 1.0,
        retry_after: int | None = None,
        rerun: bool = True,
        cpu_bf16: bool = False,
        tf32: bool = True,
        fp8: bool = False,
        fsdp2_policy: bool = True,
        verbose: bool = True,
    ) -> None:
        options = PrecisionSwitchOptions(
            initial=initial,
            ladder=ladder,
            patience=patience,
            min_scale=min_scale,
            retry_after=retry_after,
            rerun=rerun,
            cpu_bf16=cpu_bf16,
            tf32=tf32,
            fp8=fp8,
            fsdp2_policy=fsdp2_policy,
            verbose=verbose,
        )
        keep_options(self, options)  # as .options, and each as an attribute
        self._ladder_given = ladder is not None
        self._resume: str | None = None
        self._record = SwitchRecord(retry_after)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._info: DeviceInfo | None = None
        self._watch = StabilityWatch(self.patience, self.min_scale)
        self._why_fixed: str | None = None  # why precision cannot change at runtime; None: it can
        self._policy: str | None = None  # FSDP2's MixedPrecisionPolicy set at setup: watched, never switched
        self._watching = False
        self._hook: OptimizerStepHook | None = None
        self._engine: MicroBatchEngine | None = None
        self._tf32_previous: str | bool | None = None
        self._step_attempted = False
        self._applied = False
        self._found_inf: Tensor | None = None
        self._verdict: bool | None = None
        self._losses: list[Tensor] = []  # this window's losses, detached: read only when needed
        self._logged: str | None = None

    # ------------------------------------------------------------------ what users read

    @property
    def precision(self) -> str | None:
        """The precision in force (``None`` before the first fit)."""
        return self._record.precision

    @property
    def switches(self) -> list[PrecisionChange]:
        """Every change of precision of this fit (resumed ones included), in order."""
        return self._record.switches

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps not applied: skipped by the GradScaler or held back for non-finite values."""
        return self._record.skipped_steps

    @property
    def nonfinite_steps(self) -> int:
        """Of :attr:`skipped_steps`, those held back by this callback (non-finite values without a GradScaler)."""
        return self._record.nonfinite_steps

    @property
    def rerun_batches(self) -> int:
        """Batches run again in a new precision after a switch (``accumulate_grad_batches`` = 1)."""
        return self._record.rerun_batches

    def state_dict(self) -> dict[str, Any]:
        return self._record.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._record.load_state_dict(state_dict)
        self._resume = self._record.precision

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._resume is None:  # a state loaded before this fit (not from its checkpoint) is kept
            self._record = SwitchRecord(self.retry_after)
        self._reset_runtime()
        self._trainer = trainer
        strategy = trainer.strategy
        info = self._info = device_info(strategy.root_device)
        if self._ladder_given:
            check_ladder_runs(self.ladder, info)
        before = trainer.precision
        target, reason = initial_precision(self.initial, before, info, cpu_bf16=self.cpu_bf16, fp8=self.fp8)
        if target != before:
            plugin = plugin_for(target, strategy)
            if plugin is None:
                reason += f"; kept {before}: {type(strategy).__name__} cannot take {target}"
            else:
                strategy.precision_plugin = plugin
        record = self._record
        record.precision = trainer.precision
        if record.start is None:
            record.start = record.precision
        policy_note = self._set_fsdp2_policy(strategy, pl_module)
        if tf32_wanted(info, record.precision, self.tf32):
            self._tf32_previous = turn_on_tf32()
        self._why_fixed = why_precision_fixed(strategy, pl_module)
        change = f"{before} → {record.precision}" if record.precision != before else record.precision
        tf32_note = "TF32 matmuls on (torch.backends.cuda.matmul), restored at teardown"
        self._say(
            f"PrecisionSwitch: precision {change} ({reason})",
            policy_note,
            tf32_note if self._tf32_previous is not None else "",
            fallback_note(self._why_fixed, self._policy, record.precision, self._fallbacks()),
        )

    def _set_fsdp2_policy(self, strategy: Strategy, pl_module: pl.LightningModule) -> str:
        """Under the pack's FSDP2Strategy, hand ``bf16-mixed`` to FSDP2's ``MixedPrecisionPolicy`` (before it shards)."""
        if not isinstance(strategy, FSDP2Strategy) or strategy_kind(strategy) is not StrategyKind.FSDP2:
            return ""
        shards_itself = type(pl_module).__name__ if is_overridden("configure_model", pl_module) else None
        plan = fsdp2_policy_plan(self._record.precision, strategy.mp_policy, shards_itself, self.fsdp2_policy)
        if plan.policy is not None:
            strategy.mp_policy = plan.policy
        self._policy = plan.fixed
        return plan.note

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._trainer is not trainer:
            return
        self._resume_precision(trainer)
        record = self._record
        if record.start is None:
            record.start = record.precision
        if self._why_fixed is not None:
            return
        if any(isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers):
            self._why_fixed = "closure optimizers such as LBFGS re-evaluate the loss inside their step"
            self._say(f"PrecisionSwitch: no runtime fallback: {self._why_fixed}.")
            return
        self._hook = OptimizerStepHook.attach(trainer, self)
        self._hook.add_guard(self._guard)
        self._watching = True
        can_switch = bool(self._fallbacks(record.start)) or record.start != record.precision
        if self.rerun and can_switch and trainer.accumulate_grad_batches == 1:
            try:
                engine = MicroBatchEngine.attach(trainer, self)
            except RuntimeError as err:
                self._say(
                    f"PrecisionSwitch: a batch that triggers a switch will be dropped, not run again: {err}"
                )
            else:
                self._engine = engine

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        precision = self._record.precision
        if self._trainer is trainer and precision != self._logged:
            self._logged = precision
            log_metrics(trainer, {_METRIC: float(precision_index(precision))})

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._watching:
            self._losses.append(loss.detach())

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._watching:
            self._step_attempted = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._watching or not self._step_attempted:
            return
        applied = self._applied
        if (
            self._found_inf is not None
        ):  # a fused optimizer skipped by itself or not: read once, after its step
            applied = not bool(self._found_inf.item())
        losses, self._losses = self._losses, []
        self._step_attempted = self._applied = False
        self._found_inf = self._verdict = None
        if applied:
            self._watch.record(StepOutcome(applied=True))
            self._maybe_retry(trainer)
        else:
            self._not_applied(trainer, losses)

    def _not_applied(self, trainer: pl.Trainer, losses: list[Tensor]) -> None:
        """A step not applied: count it; switch down when the watch says so, else say it was held back."""
        # A step not applied is the same event on every rank (all-reduced gradients): read what is known once.
        scaler = self._scaler()
        loss_finite = not self._agreed(any_nonfinite(losses, trainer.strategy.root_device))[0]
        scale = float(scaler.get_scale()) if scaler is not None else None
        record = self._record
        record.skipped_steps += 1
        if scaler is None:
            record.nonfinite_steps += 1
        outcome = StepOutcome(applied=False, scaler=scaler is not None, loss_finite=loss_finite, scale=scale)
        reason = self._watch.observe(outcome)
        if trainer.strategy.reduce_boolean_decision(reason is not None, all=False):
            self._switch_down(trainer, reason or "another rank asked", rerun=False)
        elif scaler is None:
            what = "loss" if not loss_finite else "gradients"
            held = (
                f"step {trainer.global_step - 1} not applied: non-finite {what} in {record.precision} "
                f"({self._watch.consecutive} in a row; patience {self.patience})"
            )
            record_decision(
                trainer,
                "held back",
                "PrecisionSwitch",
                held,
                held_step=trainer.global_step - 1,
                nonfinite=what,
            )
            self._say(f"PrecisionSwitch: {held}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._trainer is trainer:
            self._say(self._record.summary() or "")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._trainer is not trainer:
            return
        if self._hook is not None:
            self._hook.remove_guard(self._guard)
            self._hook.release(self)
            self._hook = None
        if self._engine is not None:
            self._engine.release(self)
            self._engine = None
        restore_tf32(self._tf32_previous)
        self._tf32_previous = None
        self._watching = False
        self._trainer = None

    # ------------------------------------------------------------------ the optimizer step

    def _guard(self, optimizer: torch.optim.Optimizer, loss: Tensor | None) -> bool:
        """The optimizer-step hook asks before each step: hold it back (non-finite values)?"""
        if not self._watching:
            return False
        if self._scaler() is not None:
            # The GradScaler found the gradients finite (it calls step only then), or, for an optimizer that
            # unscales inside its own step, passes found_inf for it to skip on: read after the step.
            if _compat.optimizer_unscales_itself(optimizer):
                self._found_inf = getattr(optimizer, "found_inf", None)
            self._applied = True
            return False
        bad = self._verdict
        if bad is None:
            bad = self._agreed(self._nonfinite(self._losses, optimizer))[0]
        self._verdict = None
        if bad:
            return True
        self._applied = True
        return False

    def check_attempt(self, batch_idx: int, loss: Tensor | None) -> bool:
        """The engine asks after each attempt (A = 1): switch now and run the batch again?"""
        trainer = self._trainer
        if not self._watching or trainer is None or trainer.accumulate_grad_batches != 1 or loss is None:
            return False
        scaler = self._scaler()
        if scaler is not None and not self._watch.armed(scaler.get_backoff_factor()):
            return False  # the GradScaler will tell after the step, for free; nothing to pre-empt yet
        optimizer, device = trainer.optimizers[0], trainer.strategy.root_device
        if scaler is None:  # the check the step needs anyway; told apart below only when it fails
            self._verdict = self._agreed(self._nonfinite([loss], optimizer))[0]
            if not self._verdict:
                return False
        loss_bad, grads_bad = self._agreed(
            torch.stack(
                [any_nonfinite([loss], device), any_nonfinite(grad_norms(self._grads(optimizer)), device)]
            )
        )
        reason = switch_verdict(
            self._watch,
            scaler=scaler is not None,
            loss_bad=loss_bad,
            grads_bad=grads_bad,
            backoff=scaler.get_backoff_factor() if scaler is not None else None,
        )
        # Same inputs on every rank (all-reduced flags, the same history): the same answer everywhere.
        if reason is None or not self._fallbacks():
            return False  # the step is skipped or held back, and counted (or raises) at the batch's end
        self._switch_down(trainer, reason, rerun=True, batch_idx=batch_idx)
        self._verdict = None
        return True

    # ------------------------------------------------------------------ switching

    def _switch_down(
        self, trainer: pl.Trainer, reason: str, rerun: bool, batch_idx: int | None = None
    ) -> None:
        record = self._record
        before = record.precision
        target = record.down_target(reason, self._fallbacks(), self.ladder, self._policy)
        step = trainer.global_step
        old = trainer.precision_plugin
        self._install(trainer, target, reason)
        if rerun:
            if getattr(old, "scaler", None) is not None:
                old.scaler = SpentScaler()  # its optimizer step is still running, on the new gradients
            record.rerun_batches += 1
            what = f"batch {batch_idx} runs again in {target}"
        else:
            accumulate = trainer.accumulate_grad_batches
            what = (
                f"the batch of step {step - 1} was not applied"
                if accumulate == 1
                else f"the window of step {step - 1} ({accumulate} batches) was not applied"
            )
            what += f" ({record.skipped_steps} step(s) not applied in this fit)"
        self._say(f"PrecisionSwitch: precision {before} → {target} at step {step}: {reason}; {what}")

    def _maybe_retry(self, trainer: pl.Trainer) -> None:
        record = self._record
        target = record.retry_target(trainer.global_step, self.ladder, self._info)
        if target is None or not trainer.strategy.reduce_boolean_decision(True, all=True):
            return
        before = record.precision
        reason = f"trying the faster precision again after {record.retry_interval} stable steps"
        self._install(trainer, target, reason)
        self._say(f"PrecisionSwitch: precision {before} → {target} at step {trainer.global_step}: {reason}")

    def _install(self, trainer: pl.Trainer, precision: str, reason: str) -> None:
        trainer.strategy.precision_plugin = plugin_for(precision, trainer.strategy)
        before = self._record.precision
        record_decision(
            trainer,
            "precision",
            "PrecisionSwitch",
            f"precision {before} -> {precision}: {reason}",
            before=before,
            after=precision,
        )
        engine = MicroBatchEngine.get(trainer)
        if engine is not None:  # under torch.compile the next step may recompile for the new autocast state
            engine.expect_recompile(f"precision switch {before} → {precision}")
        self._record.switched(trainer.global_step, precision, reason)
        self._watch.reset()

    def _resume_precision(self, trainer: pl.Trainer) -> None:
        restored, self._resume = self._resume, None
        if restored is not None and restored != trainer.precision:
            fixed = self._why_fixed or self._policy
            plugin = plugin_for(restored, trainer.strategy) if fixed is None else None
            if plugin is None:
                self._say(
                    f"PrecisionSwitch: the checkpoint was saved in {restored}, but this run stays in {trainer.precision}: "
                    f"{fixed or type(trainer.strategy).__name__ + ' cannot take it'}"
                )
            else:
                before = trainer.precision
                trainer.strategy.precision_plugin = plugin
                self._say(f"PrecisionSwitch: precision {before} → {restored} (restored from the checkpoint)")
        self._record.precision = trainer.precision

    # ------------------------------------------------------------------ helpers

    def _fallbacks(self, current: str | None = None) -> tuple[str, ...]:
        """The precisions this run can still fall back to from ``current`` (default: the one in force)."""
        return fallbacks(current or self._record.precision, self.ladder, self._info, self._policy)

    def _scaler(self) -> Any:
        return getattr(self._trainer.precision_plugin, "scaler", None) if self._trainer is not None else None

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer) -> list[Tensor | None]:
        return [p.grad for group in optimizer.param_groups for p in group["params"]]

    def _nonfinite(self, losses: list[Tensor], optimizer: torch.optim.Optimizer) -> Tensor:
        """One device flag: a loss or a gradient is not finite (no host sync yet)."""
        return any_nonfinite(
            [*losses, *grad_norms(self._grads(optimizer))], self._trainer.strategy.root_device
        )

    def _agreed(self, flags: Tensor) -> list[bool]:
        """Device flags, all-reduced over ranks, read with one host sync."""
        trainer = self._trainer
        if trainer.world_size > 1:
            flags = trainer.strategy.reduce(flags.clone(), reduce_op="sum")
        return [value > 0 for value in flags.reshape(-1).tolist()]

    def _say(self, *parts: str) -> None:
        if self.verbose:
            line = "; ".join(p for p in parts if p)
            if line:
                rank_zero_info(line)
