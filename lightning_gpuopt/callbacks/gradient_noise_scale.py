"""GradientNoiseScale: the simple noise scale B_simple of a run, from gradients it computes anyway.

The math is in :mod:`lightning_gpuopt.goodput.estimator`; this callback finds the two batch sizes:

* the first micro-batch of an accumulation window (told by the micro-batch engine right after its backward),
  against the whole window in ``on_before_optimizer_step`` (unscaled, unclipped), when the window has several
  micro-batches (k >= 2, or ``accumulate_grad_batches`` >= 2);
* under DDP, this rank's first micro-batch against the all-reduced window: the ranks average the small norm in
  one extra all-reduce of three scalars;
* at k = 1 on one device, the engine runs every measured step as 2 micro-batches (it asks ``measure_split``), for steps
  whose update that leaves unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt import _compat
from lightning_gpuopt._metrics import log_metrics
from lightning_gpuopt._validate import fraction, positive_int
from lightning_gpuopt.goodput.estimator import NoiseScaleEMA, noise_scale_terms
from lightning_gpuopt.microbatch import (
    EngineState,
    MicroBatchBackward,
    MicroBatchEngine,
    MicroBatchUser,
)
from lightning_gpuopt.microbatch.replay import RandomDraws
from lightning_gpuopt.refusals import refuse_unsupported
from lightning_gpuopt.support import Feature

__all__ = ["GradientNoiseScale"]

#: The metrics this callback logs (no other callback logs them).
METRIC_ESTIMATE = "gpuopt/noise_scale"
METRIC_RELATIVE_ERROR = "gpuopt/noise_scale_rel_error"
METRIC_LOWER_BOUND = "gpuopt/noise_scale_lower_bound"

_DROPOUT = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


class GradientNoiseScale(MicroBatchUser, Callback):
    """Measures the simple gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (in samples) during ``fit``.

    ``B_simple`` predicts the critical batch size (McCandlish et al. 2018): well below it a larger batch trains
    in proportionally fewer steps; above it, extra samples per step buy little. It is measured from gradients
    the run computes anyway: within an accumulation window, across DDP ranks, or, at k = 1 on one device, by
    running a measured step as 2 micro-batches where that leaves the update unchanged (no BatchNorm, dropout
    or random draws in the step). Under FSDP2 it measures at k >= 2 only. The two terms are averaged
    separately (bias-corrected moving averages) and their ratio given once trusted; it measures every step
    until then, every ``every``-th step after. At each measurement it logs ``gpuopt/noise_scale`` (the trusted
    estimate, NaN until trusted), ``gpuopt/noise_scale_rel_error`` and ``gpuopt/noise_scale_lower_bound`` (NaN
    until known) at Lightning's step numbers, and it ends a fit with one line: the
    estimate, or why it is not trusted yet and what to do. docs/batch-size.md ("Worth it? The noise scale") has
    the long form.

    Args:
        every: once trusted, measure every ``every``-th optimizer step (default 10).
        split_every: once trusted, and where a measurement needs the k = 1 split, measure every ``split_every``-th
            optimizer step (default 100).
        beta: the moving averages' decay per measurement (default 0.99: about the last 100 measurements).
        trust: the relative standard error of the ratio below which :attr:`estimate` is given (default 0.1).
        min_measurements: measurements before :attr:`estimate` is given, however small the error (default 20).
        split: at k = 1 on one device, run measured steps as 2 micro-batches when that leaves the update
            unchanged (default ``True``); ``False``: measure only where a window has several micro-batches.

    Attributes:
        estimate: ``B_simple`` in samples once trusted, else ``None``.
        history: ``[step, B_simple or None, relative error]`` per measurement.

    Example:
        >>> import lightning as L
        >>> from lightning_gpuopt import GradientNoiseScale
        >>> noise = GradientNoiseScale()
        >>> trainer = L.Trainer(callbacks=[noise], logger=False, enable_progress_bar=False)
        >>> noise.estimate is None
        True
    """

    def __init__(
        self,
        every: int = 10,
        split_every: int = 100,
        beta: float = 0.99,
        trust: float = 0.1,
        min_measurements: int = 20,
        split: bool = True,
    ) -> None:
        positive_int("every", every, unit="optimizer steps")
        positive_int("split_every", split_every, unit="optimizer steps")
        fraction("beta", beta, closed_high=False)
        if isinstance(trust, bool) or not isinstance(trust, (int, float)) or trust <= 0:
            raise ValueError(f"`trust` must be a positive number (a relative standard error), got {trust!r}")
        positive_int("min_measurements", min_measurements)
        if not isinstance(split, bool):
            raise TypeError(f"`split` must be a bool, got {split!r}")
        self.every, self.split_every = every, split_every
        self.split = split
        self.ema = NoiseScaleEMA(beta=beta, min_count=min_measurements, trust=float(trust))
        self.history: list[list[Any]] = []
        self._engine: MicroBatchEngine | None = None
        #: Whether this fit asks the engine for measurement splits at k = 1.
        self._asks_split = False
        self._split_ok: bool | None = None
        self._draws: RandomDraws | None = None
        self._recording: Any = None
        #: This window's first micro-batch: (squared norm of its mean gradient, its samples, the window's samples).
        self._small: tuple[float, float, float] | None = None
        self._said_no_split = False
        #: Why a step at k = 1 is not split (``None``: it is, or was not asked).
        self._no_split_why: str | None = None
        self._sharded = False
        #: The last measured optimizer batch (in samples, as the loss weighting counts them; or in tokens).
        self._batch = 0.0
        #: What the noise scale and the batches are counted in: ``"samples"``, or ``"tokens"`` where the optimizer
        #: step's loss is shared by tokens (a token-mean loss over several ranks, accumulation or token batches).
        self.unit = "samples"
        self._fit_start_step = 0

    # ------------------------------------------------------------------ reads

    @property
    def estimate(self) -> float | None:
        """``B_simple`` in samples (loss-weighting units of a sample), or in tokens (:attr:`unit`); ``None`` until
        trusted."""
        return self.ema.estimate

    def lower_bound(self, sigmas: float = 2.0) -> float | None:
        """A cautious ``B_simple`` even before it is trusted: ``tr(Sigma)`` less ``sigmas`` standard errors over
        ``|G|^2`` plus ``sigmas`` standard errors (``None`` before ``min_measurements``, or while it says nothing:
        :meth:`~lightning_gpuopt.goodput.NoiseScaleEMA.lower_bound`)."""
        if self.ema.count < self.ema.min_count:
            return None
        return self.ema.lower_bound(sigmas)

    @property
    def relative_error(self) -> float:
        """The estimate's relative standard error now (``inf`` before two measurements)."""
        return self.ema.relative_error

    def due(self, step: int, split: bool = False) -> bool:
        """Whether the optimizer step ``step`` is measured: every step until trusted, then every ``every``-th (every
        ``split_every``-th where the measurement needs the k = 1 split)."""
        dense = not self.ema.trusted and self.ema.count < 3 / (
            1 - self.ema.beta
        )  # until trusted, or three windows
        return dense or step % (self.split_every if split else self.every) == 0

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        EngineState.ensure(trainer)
        if stage != "fit":
            return
        refuse_unsupported(Feature.OOM_RECOVERY, trainer, "GradientNoiseScale")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            engine = MicroBatchEngine.attach(trainer, self, training=True)
        except RuntimeError as err:
            raise RuntimeError(f"GradientNoiseScale: {err}") from None
        self._engine = engine
        engine.resume()
        self._asks_split = False
        self._sharded = isinstance(trainer.strategy, ModelParallelStrategy)
        self._small = None
        self._split_ok = None
        self._no_split_why = None
        self._fit_start_step = trainer.global_step
        if not self.split or engine.world_size > 1 or self._sharded:
            return
        why = _split_changes_update(pl_module, engine.compiled)
        if why is not None:
            self._no_split(why)
            return
        self._asks_split = True

    def _no_split(self, why: str) -> None:
        self._split_ok = False
        self._no_split_why = why
        self._asks_split = False
        if not self._said_no_split:
            self._said_no_split = True
            rank_zero_info(
                f"GradientNoiseScale: a measured step is not split into 2 micro-batches because {why}; the noise "
                "scale is measured only in accumulation windows of several micro-batches or across ranks."
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_recording()
        engine, self._engine = self._engine, None
        self._asks_split = False
        if engine is None:
            return
        engine.release(self)

    # ------------------------------------------------------------------ the k = 1 split

    def measure_split(self, batch_idx: int) -> bool:
        """The engine asks at k = 1: split this step into 2 micro-batches to measure it?"""
        engine = self._engine
        return bool(
            self._asks_split
            and self._split_ok
            and engine is not None
            and self.due(engine.trainer.global_step, split=True)
        )

    def measure_refused(self, why: str) -> None:
        """The loss-weighting check refused the split: measure only where the run has several micro-batches."""
        self._no_split(why)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        if self._split_ok is None and engine is not None and self._asks_split:
            # The first step runs whole with its random draws watched: a step that draws is never split.
            self._draws = RandomDraws(1)
            self._recording = self._draws.record()
            self._recording.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._recording is None:
            return
        draws = self._stop_recording()
        if draws is not None and (draws.drew or draws.host is not None):
            source = f"draws from {draws.host}" if draws.host else "draws random numbers"
            self._no_split(f"the training step {source} (dropout, noise)")
        elif self._split_ok is None:
            self._split_ok = True

    def _stop_recording(self) -> RandomDraws | None:
        recording, self._recording = self._recording, None
        draws, self._draws = self._draws, None
        if recording is not None:
            recording.__exit__(None, None, None)
        if draws is not None:
            drew = draws.drew
            draws.clear()
            draws.draws = [None] if drew else []  # keep the answer, let the tensors go
        return draws

    # ------------------------------------------------------------------ the measurement

    def after_backward(self, told: MicroBatchBackward) -> None:
        if not told.first_in_window or told.index != 0:
            return
        engine = self._engine
        step = engine.trainer.global_step if engine is not None else 0
        self._small = None
        whole = told.count == 1 and told.accumulate == 1
        if not self.due(step, split=told.measuring) or (whole and (engine is None or engine.world_size == 1)):
            return
        if self._sharded and told.count == 1:
            return  # FSDP2: a rank's gradient is never whole; measure inside a window of k >= 2 only
        share = told.weight * told.share / told.accumulate * told.scale
        sq = _grad_sq(told.params)
        if self._sharded:
            sq = float(engine.trainer.strategy.reduce(torch.tensor(sq, dtype=torch.float64), reduce_op="sum"))
        # Batch sizes in what the loss averages over: tokens where the step is shared by tokens, else samples.
        unit = "tokens" if told.tokens is not None and not self._sharded else "samples"
        if (
            unit != self.unit and self.ema.count
        ):  # decided after the first measurements: start again in tokens
            self.ema.load_state_dict({})
            self.history.clear()
        self.unit = unit
        size = told.tokens if self.unit == "tokens" else told.samples
        self._small = (sq / (share * share), told.weight * size, float(size * told.accumulate))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        small, self._small = self._small, None
        if small is None or self._engine is None:
            return
        engine = self._engine
        params = [p for group in optimizer.param_groups for p in group["params"]]
        big_sq = _grad_sq(params)
        small_sq, b_small, b_big = small
        if self._sharded:
            big_sq = float(
                trainer.strategy.reduce(torch.tensor(big_sq, dtype=torch.float64), reduce_op="sum")
            )
            b_small *= engine.world_size  # FSDP2 reduces each micro-batch's gradient over the ranks
            b_big *= engine.world_size
        elif engine.world_size > 1:  # the ranks' small norms averaged: one extra all-reduce of three scalars
            total = trainer.strategy.reduce(
                torch.tensor([small_sq, b_small, b_big], dtype=torch.float64), reduce_op="sum"
            )
            world = engine.world_size
            small_sq, b_small, b_big = float(total[0]) / world, float(total[1]) / world, float(total[2])
        if self.unit == "tokens":  # the step's own count: its batches' tokens differ
            b_big = engine.step_tokens or b_big
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)) or not 0 < b_small < b_big:
            return
        g2, trace = noise_scale_terms(small_sq, b_small, big_sq, b_big)
        self.ema.update(g2, trace)
        self._batch = b_big
        value = self.ema.estimate
        self.history.append([trainer.global_step, value, min(self.ema.relative_error, 1e9)])
        self._log(trainer, value)

    def _log(self, trainer: pl.Trainer, value: float | None) -> None:
        """The state after a measurement, at Lightning's step for this batch.

        All three at every measurement, NaN (an unknown error: inf) where there is no value, so that a row never
        pairs a new figure with an old one.
        """
        bound = self.lower_bound()
        metrics = {
            METRIC_ESTIMATE: math.nan if value is None else value,
            METRIC_RELATIVE_ERROR: self.ema.relative_error,
            METRIC_LOWER_BOUND: math.nan if bound is None else bound,
        }
        log_metrics(trainer, metrics)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = trainer.global_step - self._fit_start_step
        rank_zero_info(f"GradientNoiseScale: {self.summary(steps)}")

    def summary(self, steps: int | None = None) -> str:
        """The line a fit ends with: the estimate, or why it is not given yet and what to do.

        ``steps``: the optimizer steps of the fit, said when nothing was measured.
        """
        ema = self.ema
        count, error, trust = ema.count, ema.relative_error, ema.trust
        batch = f"the optimizer batch is {self._batch:,.0f}{' tokens' if self.unit == 'tokens' else ''}"
        if count == 0:
            return self._nothing_measured(steps)
        if ema.trusted:
            return (
                f"noise scale {ema.value:,.0f} {self.unit} after {count} measurements (relative error {error:.3g} <= "
                f"trust {trust:g}); {batch}"
            )
        why = f"relative error {error:.3g} {'>' if error > trust else '<='} trust {trust:g}"
        if count == 1:
            why += ": one measurement has no spread"
        elif not math.isfinite(error):
            why += ": the |G|^2 average is not positive yet, the batch is far below the noise scale"
        if count < ema.min_count:
            why += f"; fewer than min_measurements={ema.min_count}"
        bound = self.lower_bound()
        line = f"not trusted yet after {count} measurements ({why}); " + (
            f"lower bound {bound:,.0f} {self.unit}" if bound is not None else "no lower bound yet"
        )
        return f"{line}; {batch}{self._what_to_do()}"

    def _what_to_do(self) -> str:
        """What reaches ``trust``, from the spread of the measurements so far."""
        ema = self.ema
        needed, effective = ema.needed, ema.needed_effective
        if needed is not None and math.isfinite(needed):
            total = max(math.ceil(needed), ema.min_count)
            return f"; at this spread trust {ema.trust:g} needs about {total:,} measurements: train longer"
        if effective is not None and effective <= 10 * ema.memory:
            beta = (2 * effective - 1) / (2 * effective + 1)  # an average that keeps twice what is needed
            return (
                f"; at this spread trust {ema.trust:g} needs about {effective:,.0f} measurements averaged, more than "
                f"the {ema.memory:.0f} that beta={ema.beta:g} keeps: raise beta to {_round_up(beta)} and train "
                "longer, or read the lower bound"
            )
        bound = self.lower_bound()
        if bound is None or not self._batch:
            return ""
        ratio = f"{bound / self._batch:.3g}x the optimizer batch"
        if effective is None:
            return f"; meanwhile read the lower bound, {ratio}"
        return (
            f"; trust {ema.trust:g} is out of reach at this batch (about {effective:,.0f} measurements averaged, "
            f"beta={ema.beta:g} keeps {ema.memory:.0f}): read the lower bound, {ratio}"
        )

    def _nothing_measured(self, steps: int | None) -> str:
        during = "" if steps is None else f" in {steps} optimizer steps"
        if self._no_split_why is not None:
            why = f"a step at k = 1 is not split into 2 micro-batches because {self._no_split_why}"
        elif not self.split:
            why = "split=False and no accumulation window had several micro-batches"
        elif self._sharded:
            why = "under FSDP2 it measures only in windows of k >= 2 micro-batches"
        else:
            why = "no step had two batch sizes to compare"
        return (
            f"nothing measured{during}: {why}. To measure, set accumulate_grad_batches >= 2 (halve batch_size to "
            "keep the optimizer batch) or train on several devices"
        )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.ema.state_dict(),
            "history": [list(h) for h in self.history],
            "batch": self._batch,
            "unit": self.unit,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ema.load_state_dict(state_dict)
        self.history = [list(h) for h in state_dict.get("history", [])]
        self._batch = float(state_dict.get("batch", 0.0))
        self.unit = str(state_dict.get("unit", "samples"))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_engine": None, "_draws": None, "_recording": None}


def _round_up(beta: float) -> str:
    """``beta`` rounded up, to one significant digit of ``1 - beta`` (0.99937 -> "0.9994")."""
    exponent = math.floor(math.log10(1 - beta))
    rest = math.floor((1 - beta) / 10**exponent + 1e-9) * 10**exponent
    return f"{1 - rest:.{-exponent}f}"


def _grad_sq(params: list[torch.Tensor] | tuple) -> float:
    """The squared L2 norm of the parameters' gradients on this rank (a DTensor's local shard)."""
    grads = [_compat.local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = _compat.foreach_norm(grads, None)
    return float(torch.stack([n.double().to(norms[0].device) for n in norms]).square().sum())


def _split_changes_update(module: torch.nn.Module, compiled: bool) -> str | None:
    """Why splitting a step into 2 micro-batches would change its update (``None``: it would not)."""
    if compiled:
        return "the module is compiled (a split would recompile it)"
    for name, m in module.named_modules():
        if isinstance(m, _compat.batch_norm_types()):
            return f"it has BatchNorm ({name or 'the module'}), whose batch statistics depend on the split"
        if isinstance(m, _DROPOUT) and m.p > 0:
            return f"it has dropout ({name}, p={m.p})"
    return None
