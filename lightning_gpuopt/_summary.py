"""The one-line run summary the ``gpuopt fit`` command prints at the end of training."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.batching import UnsplittableBatchError, batch_size_of
from lightning_gpuopt.memory import format_bytes, get_probe

__all__ = ["RunSummary"]


class RunSummary(Callback):
    """Measures training throughput and peak memory during ``fit`` and prints one line at its end.

    Throughput counts the samples of every training batch after the first (which pays for start-up)
    over the wall time between batch ends, data waiting included, validation excluded. Peak memory is
    the device's (or the simulated device's) peak allocated memory, read from the memory probe; on a
    CPU run it is the process's peak resident set size. The figures are in :attr:`values` after ``fit``.
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self._samples = 0
        self._seconds = 0.0
        self._last: float | None = None
        self._batches = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.values = {}
        self._samples, self._seconds, self._batches = 0, 0.0, 0
        get_probe(trainer.strategy.root_device).reset_peak()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None  # validation time is not training time

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._batches += 1
        if self._last is not None and self._batches > 1:
            try:
                self._samples += batch_size_of(batch)
                self._seconds += now - self._last
            except UnsplittableBatchError:
                pass  # a batch without a sample dimension: throughput is not defined for it
        self._last = now

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val") and v.numel() == 1
        }
        probe = get_probe(trainer.strategy.root_device)
        peak = probe.peak
        where = "peak host memory (RSS)" if probe.kind == "cpu" else f"peak {probe.kind} memory allocated"
        self.values = {
            **metrics,
            "samples_per_s": self._samples / self._seconds if self._seconds > 0 else None,
            "peak_memory_bytes": peak,
            "global_step": trainer.global_step,
        }
        parts = [f"{k} {v:.4f}" for k, v in sorted(metrics.items())]
        if self.values["samples_per_s"] is not None:
            parts.append(f"{self.values['samples_per_s']:.1f} samples/s")
        parts.append(f"{where} {format_bytes(peak)}")
        parts.append(f"{trainer.global_step} steps")
        rank_zero_info("gpuopt summary: " + " | ".join(parts))
