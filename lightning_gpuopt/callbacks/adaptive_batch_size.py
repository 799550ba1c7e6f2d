"""AdaptiveBatchSize: grow the optimizer batch, through accumulation, while the noise scale says it pays.

A thin callback over :mod:`lightning_gpuopt.goodput.schedule`; the noise scale comes from a
:class:`~lightning_gpuopt.GradientNoiseScale` on the Trainer (one is added when there is none).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt._metrics import log_metrics
from lightning_gpuopt._validate import choice, fraction, positive_int
from lightning_gpuopt.callbacks.gradient_noise_scale import GradientNoiseScale
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.goodput.schedule import held_because, lr_factor, next_accumulation
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.refusals import refuse_unsupported
from lightning_gpuopt.support import Feature

__all__ = ["AdaptiveBatchSize", "LRScaling"]

LRScaling = Literal["auto", "sqrt", "linear", "none"]

#: The optimizer batch of each step, in samples (no other callback logs it).
METRIC = "gpuopt/optimizer_batch"
_NOT_MEASURED = "no noise scale was measured (GradientNoiseScale's line says why)"


class AdaptiveBatchSize(Callback):
    """Grows the optimizer batch while the measured noise scale says a larger batch wastes no samples (opt-in).

    The target optimizer batch is ``target_fraction`` x B_simple (measured by :class:`GradientNoiseScale`, taken
    cautiously), clamped to ``[min_batch, max_batch]``; the batch moves towards it one ``factor`` at a time, at
    most once every ``interval`` optimizer steps. The micro-batch stays as chosen: the growth comes through
    ``accumulate_grad_batches``, changed at a window boundary, with the learning rate scaled through the
    schedulers' ``base_lrs``. Each change is a decision, agreed by the ranks and saved in checkpoints; the
    batch never shrinks below the user's unless ``min_batch`` asks for it. Each step's optimizer batch is logged
    as ``gpuopt/optimizer_batch`` at Lightning's step numbers, and a fit ends with one line: how far the batch grew and
    why not further. Long form: docs/batch-size.md.

    Args:
        max_batch: the largest optimizer batch in samples (``None``: 64 times the user's); in tokens where
            GradientNoiseScale counts tokens (a token-mean loss shared by tokens), as ``min_batch``.
        min_batch: the smallest optimizer batch (``None``: the user's, batch_size x accumulate_grad_batches x
            world size).
        target_fraction: the target batch as a fraction of B_simple (default 0.25; B_simple overestimates the
            critical batch, and at the critical batch a run spends twice the fewest samples).
        factor: the batch changes by this integer factor (default 2).
        interval: optimizer steps between two changes at least (default 50).
        lr_scaling: ``"auto"`` (linear for SGD, square root for the others: Adam-family), ``"sqrt"``,
            ``"linear"``, ``"none"``, or ``f(ratio) -> factor``.

    Example:
        >>> import lightning as L
        >>> from lightning_gpuopt import AdaptiveBatchSize
        >>> trainer = L.Trainer(callbacks=[AdaptiveBatchSize(max_batch=4096)], logger=False)
    """

    def __init__(
        self,
        max_batch: int | None = None,
        min_batch: int | None = None,
        target_fraction: float = 0.25,
        factor: int = 2,
        interval: int = 50,
        lr_scaling: LRScaling | Callable[[float], float] = "auto",
    ) -> None:
        positive_int("max_batch", max_batch, unit="samples", allow_none=True)
        positive_int("min_batch", min_batch, unit="samples", allow_none=True)
        if max_batch is not None and min_batch is not None and min_batch > max_batch:
            raise ValueError(
                f"`min_batch` must be <= `max_batch`, got min_batch={min_batch}, max_batch={max_batch}"
            )
        fraction("target_fraction", target_fraction)
        positive_int("factor", factor)
        if factor < 2:
            raise ValueError(f"`factor` must be an int >= 2, got {factor}")
        positive_int("interval", interval, unit="optimizer steps")
        if not callable(lr_scaling):
            choice("lr_scaling", lr_scaling, LRScaling)
        self.max_batch, self.min_batch = max_batch, min_batch
        self.target_fraction, self.factor, self.interval = float(target_fraction), factor, interval
        self.lr_scaling = lr_scaling
        #: The user's ``accumulate_grad_batches``, and the one in force now.
        self.base_accumulate: int | None = None
        self.accumulate: int | None = None
        #: An agreed accumulation waiting for its window boundary.
        self.pending: int | None = None
        #: Optimizer samples seen in this run (the unit of a step-based schedule).
        self.samples = 0
        #: ``[step, batch before, batch after, accumulation after, noise scale, lr factor]`` per change.
        self.changes: list[list[Any]] = []
        self.last_change_step = 0
        self._unit: int | None = None
        self._measure_unit = False
        #: Where the optimizer step is shared by tokens (GradientNoiseScale then counts tokens): the mean real
        #: tokens of one batch on every rank, over the steps so far.
        self._tokens_per_batch = 0.0
        self._token_steps = 0
        self._noise: GradientNoiseScale | None = None
        self._last_step: int | None = None
        self._measured = 0
        #: Why the batch did not grow at the last decision (said at fit end).
        self._held = _NOT_MEASURED

    # ------------------------------------------------------------------ reads

    @property
    def optimizer_batch(self) -> int | None:
        """The optimizer batch in samples now (``None`` before the first batch)."""
        if self._unit is None or self.accumulate is None:
            return None
        return self._unit * self.accumulate

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if pl_module.automatic_optimization is False:
            raise RuntimeError(
                "AdaptiveBatchSize needs automatic optimization (it changes accumulate_grad_batches); remove it "
                "for a module with manual optimization."
            )
        refuse_unsupported(Feature.ADAPTIVE_BATCH_SIZE, trainer, "AdaptiveBatchSize")
        noise = next((cb for cb in trainer.callbacks if isinstance(cb, GradientNoiseScale)), None)
        if noise is None:
            noise = GradientNoiseScale()
            trainer.callbacks.append(noise)
        self._noise = noise

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.base_accumulate is None:
            self.base_accumulate = int(trainer.accumulate_grad_batches)
        if self.accumulate is None:
            self.accumulate = self.base_accumulate
        trainer.accumulate_grad_batches = self.accumulate
        self._last_step = trainer.global_step
        self._measured = len(self._noise.history) if self._noise is not None else 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A checkpoint's state is loaded after `on_fit_start` in some strategies: take it before the first batch.
        self.on_fit_start(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._unit is None or self._measure_unit:
            self._unit = MicroBatchEngine.get(trainer).batch_size(batch) * trainer.world_size
            self._measure_unit = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # inside an accumulation window
        self._last_step = trainer.global_step
        self.samples += self._unit * self.accumulate
        tokens = MicroBatchEngine.get(trainer).step_tokens
        if tokens:  # the step is shared by tokens: batches in tokens, the mean of the steps so far
            self._token_steps += 1
            self._tokens_per_batch += (tokens / self.accumulate - self._tokens_per_batch) / self._token_steps
        # The batch this step used, in the row Lightning writes for it.
        log_metrics(trainer, {METRIC: float(self._unit * self.accumulate)}, every_n_steps=True)
        self._advance_schedulers(trainer)
        ready = batch_idx + 1
        if self.pending is None:
            self._decide(trainer)
        if self.pending is not None and ready % self.pending == 0:
            self._apply(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.pending is not None:  # a new epoch starts a new window
            self._apply(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank_zero_info(f"AdaptiveBatchSize: {self.summary()}")

    def summary(self) -> str:
        """The line a fit ends with: how the optimizer batch moved, and why it did not grow (further)."""
        if self.optimizer_batch is None:
            return "no batch was trained"
        per, unit = self._per_batch(), self._unit_name()
        now = self.accumulate * per
        if self.pending is not None:
            held = f"a change to {self.pending * per:,}{unit} waits for its window boundary"
        else:
            held = self._held
        if not self.changes:
            return f"the optimizer batch stayed {now:,}{unit}: {held}"
        first = self.changes[0][1]
        return f"optimizer batch {first:,} -> {now:,}{unit} in {len(self.changes)} change(s); not grown further: {held}"

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.base_accumulate is not None:
            trainer.accumulate_grad_batches = self.base_accumulate

    # ------------------------------------------------------------------ the decision

    def _decide(self, trainer: pl.Trainer) -> None:
        noise = self._noise
        if noise is None or len(noise.history) == self._measured:
            return  # nothing new measured (every rank measures at the same steps)
        self._measured = len(noise.history)
        proposal = self.accumulate
        estimate = noise.lower_bound()  # cautious: tr(Sigma)'s lower end over |G|^2's upper end
        counted = noise.ema.count >= noise.ema.min_count
        if estimate is None and counted and self.accumulate < self._min_accumulate():
            estimate = 0.0  # up to min_batch from min_measurements on, whatever the noise scale
        if estimate is None:
            self._held = (
                "the noise scale's lower bound is not known yet (its averages are still too noisy)"
                if counted
                else f"the noise scale has {noise.ema.count} of min_measurements={noise.ema.min_count} measurements"
            )
        else:
            unit = self._per_batch()
            grown = next_accumulation(
                self.accumulate,
                unit,
                estimate,
                target_fraction=self.target_fraction,
                factor=self.factor,
                min_accumulate=self._min_accumulate(),
                max_accumulate=self._max_accumulate(),
            )
            since = trainer.global_step - self.last_change_step
            if since >= self.interval:
                proposal = grown
            if grown <= self.accumulate:
                self._held = held_because(
                    self.accumulate,
                    unit,
                    estimate,
                    target_fraction=self.target_fraction,
                    factor=self.factor,
                    max_accumulate=self._max_accumulate(),
                    label="the noise scale's lower bound",
                )
            elif since < self.interval:
                self._held = (
                    f"{since} optimizer steps since the {'last change' if self.changes else 'start'}, fewer than "
                    f"interval={self.interval} (the noise scale's lower bound {estimate:,.0f} would grow it)"
                )
            else:
                self._held = "the run ended before the next decision"
        proposal = int(trainer.strategy.broadcast(proposal, src=0))  # rank 0 decides for every rank
        if proposal != self.accumulate:
            self.pending = proposal

    def _unit_name(self) -> str:
        """``" tokens"`` where the batches are counted in tokens (a mean), else ``""`` (samples, said as ever)."""
        return " tokens" if self._in_tokens() else ""

    def _in_tokens(self) -> bool:
        return self._noise is not None and self._noise.unit == "tokens" and self._token_steps > 0

    def _per_batch(self) -> int:
        """One batch on every rank in the noise scale's unit: samples, or (GradientNoiseScale counting tokens) the
        mean real tokens of a batch so far."""
        return max(1, round(self._tokens_per_batch)) if self._in_tokens() else self._unit

    def _min_accumulate(self) -> int:
        unit = self._per_batch()
        floor = self.min_batch if self.min_batch is not None else unit * self.base_accumulate
        return max(1, math.ceil(floor / unit))

    def _max_accumulate(self) -> int:
        unit = self._per_batch()
        ceiling = self.max_batch if self.max_batch is not None else 64 * unit * self.base_accumulate
        return max(self._min_accumulate(), ceiling // unit)

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        new, old = self.pending, self.accumulate
        self.pending = None
        if new == old:
            return
        scale = lr_factor(new / old, self._rule(trainer))
        _scale_learning_rates(trainer, scale)
        self.accumulate = new
        trainer.accumulate_grad_batches = new
        self.last_change_step = trainer.global_step
        estimate = self._noise.ema.value if self._noise is not None else None
        per, unit = self._per_batch(), self._unit_name()
        before, after = old * per, new * per
        self.changes.append([trainer.global_step, before, after, new, estimate, scale])
        message = (
            f"optimizer batch {before:,} -> {after:,}{unit} (accumulation {old} -> {new}) at step "
            f"{trainer.global_step}: noise scale {estimate:.0f} {unit.strip() or 'samples'}, target "
            f"{self.target_fraction:g} of it; learning rate x{scale:.3g}"
        )
        record_decision(
            trainer,
            "batch size",
            "AdaptiveBatchSize",
            message,
            before=before,
            after=after,
            noise_scale=estimate,
        )
        rank_zero_info(f"AdaptiveBatchSize: {message}")

    def _rule(self, trainer: pl.Trainer) -> str | Callable[[float], float]:
        if self.lr_scaling != "auto":
            return self.lr_scaling
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        return "linear" if isinstance(optimizer, torch.optim.SGD) else "sqrt"

    def _advance_schedulers(self, trainer: pl.Trainer) -> None:
        """A step-based schedule counts batches of the user's optimizer batch: one extra step per extra one."""
        extra = self.accumulate // self.base_accumulate - 1
        if extra <= 0:
            return
        for config in trainer.lr_scheduler_configs:
            if config.interval != "step" or config.reduce_on_plateau:
                continue
            for _ in range(extra):
                config.scheduler.step()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "base_accumulate": self.base_accumulate,
            "accumulate": self.accumulate,
            "pending": self.pending,
            "samples": self.samples,
            "changes": [list(c) for c in self.changes],
            "last_change_step": self.last_change_step,
            "unit": self._unit,
            "tokens_per_batch": self._tokens_per_batch,
            "token_steps": self._token_steps,
            "held": self._held,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_accumulate = state_dict.get("base_accumulate")
        self.accumulate = state_dict.get("accumulate")
        self.pending = state_dict.get("pending")
        self.samples = int(state_dict.get("samples", 0))
        self.changes = [list(c) for c in state_dict.get("changes", [])]
        self.last_change_step = int(state_dict.get("last_change_step", 0))
        self._unit = state_dict.get("unit")
        self._measure_unit = True  # again at the first batch: resumed on another number of ranks, it changes
        self._tokens_per_batch = float(state_dict.get("tokens_per_batch", 0.0))
        self._token_steps = int(state_dict.get("token_steps", 0))
        self._held = str(state_dict.get("held", _NOT_MEASURED))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_noise": None}


def _scale_learning_rates(trainer: pl.Trainer, scale: float) -> None:
    """Multiply the learning rate by ``scale`` where a schedule reads it (``base_lrs``) and where it is now."""
    if scale == 1.0:
        return
    for config in trainer.lr_scheduler_configs:
        base = getattr(config.scheduler, "base_lrs", None)
        if base is not None:
            config.scheduler.base_lrs = [lr * scale for lr in base]
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * scale
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * scale
