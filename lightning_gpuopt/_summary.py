"""The one-line run summary the ``gpuopt fit`` command prints at the end of training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.batch_split import UnsplittableBatchError, batch_size_of
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.memory import format_bytes, get_probe
from lightning_gpuopt.report import StepClock, run_peak_bytes, run_samples_per_s

__all__ = ["RunSummary"]


class RunSummary(Callback):
    """One line at the end of ``fit``: the final validation metrics, training samples/s, peak memory, steps.

    Samples/s and peak memory are the report's figures (docs/report.md: :func:`~lightning_gpuopt.report.
    run_samples_per_s`, :func:`~lightning_gpuopt.report.run_peak_bytes`), read from ``steps`` (the record
    of the run's GPUOptReport) when one is given, so the line and the report's table never disagree;
    without one, this callback times the steps itself, by the same :class:`~lightning_gpuopt.report.
    StepClock`. The figures are in :attr:`values` after :meth:`finish`.

    Args:
        steps: returns the report's per-step record after ``fit``; ``None``: measure here.
    """

    def __init__(self, steps: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.values: dict[str, Any] = {}
        self._source = steps
        self._steps: list[dict[str, Any]] = []
        self._clock = StepClock()

    @property
    def _measuring(self) -> bool:
        return self._source is None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.values, self._steps, self._clock = {}, [], StepClock()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._measuring:
            self._clock.restart()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._measuring:
            self._clock.restart()  # validation time is not training time

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring:
            self._clock.start_batch()
            get_probe(trainer.strategy.root_device).reset_peak()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._measuring:
            return
        _, seconds = self._clock.end_batch(batch_idx)
        try:
            samples = batch_size_of(batch)
        except UnsplittableBatchError:
            samples = 1  # as the report counts a batch without a sample dimension
        peak = get_probe(trainer.strategy.root_device).peak
        self._steps.append({"samples": samples, "step_time_s": seconds, "peak_bytes": peak})

    def finish(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Fill :attr:`values` and print the line (rank zero); called once ``fit`` has returned."""
        metrics = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val") and v.numel() == 1
        }
        steps = self._source() if self._source is not None else self._steps
        probe = get_probe(trainer.strategy.root_device)
        peak = run_peak_bytes(steps)
        self.values = {
            **metrics,
            "samples_per_s": run_samples_per_s(steps),
            "peak_memory_bytes": peak,
            "global_step": trainer.global_step,
        }
        where = "peak host memory (RSS)" if probe.kind == "cpu" else f"peak {probe.kind} memory allocated"
        parts = [f"{k} {v:.4f}" for k, v in sorted(metrics.items())]
        if self.values["samples_per_s"] is not None:
            parts.append(f"{self.values['samples_per_s']:.1f} samples/s")
        if peak is not None:
            parts.append(f"{where} {format_bytes(peak)}")
        parts.append(f"{trainer.global_step} steps")
        stop = next((d for d in reversed(decisions(trainer)) if d.kind == "stop"), None)
        if stop is not None:
            how = (
                "the same command resumes"
                if stop.data.get("same_command_resumes")
                else f"resume with --ckpt_path {stop.data.get('path')}"
            )
            parts.append(f"stopped by {stop.data.get('signal', 'a signal')}: {how}")
        rank_zero_info("gpuopt summary: " + " | ".join(parts))
        return self.values
