"""DataStallMonitor: how long each training step waits for data, what to change, and optional worker autotuning."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_gpuopt import _compat
from lightning_gpuopt._metrics import log_metrics
from lightning_gpuopt._validate import fraction, positive_int
from lightning_gpuopt._warnings import warn
from lightning_gpuopt.data import GPUOptDataModule, available_cpus
from lightning_gpuopt.data.stall import (
    LoaderSettings,
    StallMeasurement,
    autotune_num_workers,
    max_useful_workers,
    stall_advice,
    stall_message,
)
from lightning_gpuopt.decisions import record_decision

__all__ = ["DataStallMonitor"]

_METRIC = "gpuopt/data_wait_fraction"


class _HostClock:
    """Wall-clock marks (``time.perf_counter``): what the host waited, for CPU training."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def done(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        pass


class _CudaEventClock:
    """CUDA events recorded on the current stream: the device's own timeline.

    A gap between the event after step *i − 1* and the event before step *i* is time the GPU sat idle
    waiting for the next batch (and its copy); when the host runs ahead of the GPU, the gap is near
    zero even if the host spent time fetching, because the GPU had work queued. Marks are read when
    the GPU has passed them, so nothing here synchronises the host with the device in steady state.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def done(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()


class DataStallMonitor(Callback):
    """Measures how long each training step waits for data, logs it, advises once, and can tune ``num_workers``.

    Per training step it measures the *wait* (from the end of one step to the start of the next: the fetch
    and the copy to the device) and the *compute* (the step), from CUDA events on CUDA, else the wall clock.
    ``gpuopt/data_wait_fraction`` over the last ``window`` steps goes to the loggers (read it as
    :attr:`wait_fraction`; per-epoch figures in :attr:`history`); above ``threshold`` a
    :class:`~lightning_gpuopt.GPUOptWarning` names what to change, once per fit. With ``autotune=True`` and a
    :class:`~lightning_gpuopt.GPUOptDataModule`, ``num_workers`` is tuned between epochs by measurement (kept in
    checkpoints); other loaders are measured and advised only. The long form: docs/data.md.

    Args:
        threshold: the wait fraction above which the loop counts as stalled, in (0, 1).
        window: steps per judgement and in the logged moving fraction; autotune needs an epoch with at
            least this many measured steps.
        autotune: tune ``num_workers`` of a GPUOptDataModule between epochs.
        max_workers: the most workers autotune tries; ``None``: the CPUs this process may use per local
            device, minus one.

    Raises:
        ValueError: an argument is out of range.

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> monitor = DataStallMonitor()
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=6, callbacks=[monitor], logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(BoringModel())
        >>> monitor.history[0].steps  # 6 steps, the first one not counted
        5
        >>> 0.0 <= monitor.wait_fraction <= 1.0
        True
    """

    def __init__(
        self, threshold: float = 0.1, window: int = 50, autotune: bool = False, max_workers: int | None = None
    ) -> None:
        fraction("threshold", threshold, closed_high=False)
        positive_int("window", window)
        if not isinstance(autotune, bool):
            raise ValueError(f"`autotune` must be True or False, got {autotune!r}")
        positive_int("max_workers", max_workers, allow_none=True)
        self.threshold = float(threshold)
        self.window = window
        self.autotune = autotune
        self.max_workers = max_workers
        #: One :class:`~lightning_gpuopt.data.StallMeasurement` per training epoch of the current fit.
        self.history: list[StallMeasurement] = []
        # Autotune's decisions (checkpointed): the chosen count, the trials behind it, whether it settled.
        self._num_workers: int | None = None
        self._trials: list[list[float]] = []
        self._converged = False
        self._tunable = False
        self._reset_fit()

    def _reset_fit(self) -> None:
        self._clock: Any = None
        self._pending: deque[tuple[Any, Any, Any]] = deque()
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.window)
        self._last_end: Any = None
        self._start: Any = None
        self._first_in_epoch = True
        self._epoch_steps = 0
        self._epoch_wait = self._epoch_compute = 0.0
        self._epoch_workers: int | None = None
        self._warned = False

    # ------------------------------------------------------------------ what users read

    @property
    def measured(self) -> bool:
        """Whether any step was measured yet (in the recent window or in a finished trial)."""
        return bool(self.history or self._recent)

    @property
    def wait_fraction(self) -> float:
        """The wait fraction of the recent window (what is logged); 0 before anything was measured."""
        wait = sum(w for w, _ in self._recent)
        compute = sum(c for _, c in self._recent)
        return StallMeasurement(len(self._recent), wait, compute).fraction

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_workers": self._num_workers,
            "trials": [list(t) for t in self._trials],
            "converged": self._converged,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        workers = state_dict.get("num_workers")
        self._num_workers = None if workers is None else int(workers)
        self._trials = [[int(t[0]), float(t[1]), float(t[2])] for t in state_dict.get("trials", [])]
        self._converged = bool(state_dict.get("converged", False))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_clock"], state["_pending"], state["_last_end"], state["_start"] = None, deque(), None, None
        return state

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        self._tunable = self.autotune and isinstance(trainer.datamodule, GPUOptDataModule)
        if self.autotune and not self._tunable and trainer.is_global_zero:
            source = (
                type(trainer.datamodule).__name__
                if trainer.datamodule is not None
                else "dataloaders passed to fit"
            )
            warn(
                f"DataStallMonitor(autotune=True) tunes `num_workers` of a GPUOptDataModule; this run's data comes "
                f"from {source}, whose loaders it cannot rebuild, so it measures and advises only. Set `num_workers` "
                "in your loader as the advice says, or subclass GPUOptDataModule."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_fit()
        self.history = []
        device = trainer.strategy.root_device
        self._clock = _CudaEventClock(device) if device.type == "cuda" else _HostClock()
        if self._tunable and self._num_workers is not None:
            trainer.datamodule.num_workers = self._num_workers
            rank_zero_info(
                f"DataStallMonitor: num_workers={self._num_workers} restored from the checkpoint (autotune)."
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_in_epoch = True
        self._epoch_steps = 0
        self._epoch_wait = self._epoch_compute = 0.0
        loader = _train_loader(trainer)
        self._epoch_workers = getattr(loader, "num_workers", None)
        self._last_end = self._clock.mark() if self._clock is not None else None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is not None:
            self._start = self._clock.mark()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = self._clock
        if clock is None or self._start is None:
            return
        end = clock.mark()
        if not self._first_in_epoch and self._last_end is not None:
            self._pending.append((self._last_end, self._start, end))
        self._first_in_epoch = False
        self._last_end, self._start = end, None
        if self._resolve(wait_all=False):
            self._log(trainer)
            self._judge(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation inside fit runs between training steps; the next wait starts when it ends.
        if self._clock is not None and trainer.state.fn == TrainerFn.FITTING:
            self._last_end = self._clock.mark()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is None:
            return
        self._resolve(wait_all=True)
        measured = StallMeasurement(
            self._epoch_steps,
            self._epoch_wait,
            self._epoch_compute,
            trainer.current_epoch,
            self._epoch_workers,
        )
        self.history.append(measured)
        if (
            self._tunable
            and not self._converged
            and measured.steps >= self.window
            and measured.num_workers is not None
        ):
            self._autotune_step(trainer, measured)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING:
            self._clock, self._pending, self._last_end, self._start = None, deque(), None, None

    # ------------------------------------------------------------------ measuring and deciding

    def _resolve(self, wait_all: bool) -> bool:
        """Turn the marks the device has passed into step figures; True when any step was added."""
        clock, added = self._clock, False
        if wait_all and self._pending:
            clock.wait(self._pending[-1][2])
        while self._pending and clock.done(self._pending[0][2]):
            previous_end, start, end = self._pending.popleft()
            wait, compute = max(0.0, clock.seconds(previous_end, start)), max(0.0, clock.seconds(start, end))
            self._recent.append((wait, compute))
            self._epoch_steps += 1
            self._epoch_wait += wait
            self._epoch_compute += compute
            added = True
        return added

    def _log(self, trainer: pl.Trainer) -> None:
        log_metrics(trainer, {_METRIC: self.wait_fraction}, every_n_steps=True)

    def _judge(self, trainer: pl.Trainer) -> None:
        if self._warned or len(self._recent) < self.window:
            return
        if self._tunable and not self._converged:
            return  # autotune is still searching; its log lines say what it changes
        wait, compute = sum(w for w, _ in self._recent), sum(c for _, c in self._recent)
        measured = StallMeasurement(len(self._recent), wait, compute)
        if not measured.stalled(self.threshold):
            return
        self._warned = True
        if not trainer.is_global_zero:
            return
        settings = _settings(trainer)
        advice = stall_advice(settings)
        if self._tunable:  # autotune settled on the count; the rest of the advice still applies
            advice = [a for a in advice if a.knob != "num_workers"]
        where = f"epoch {trainer.current_epoch}, up to step {trainer.global_step}"
        message = stall_message(measured, self.threshold, advice, where)
        if settings.owner == "GPUOptDataModule" and not self.autotune:
            message += " `DataStallMonitor(autotune=True)` tunes num_workers by measurement."
        record_decision(trainer, "data stall", "DataStallMonitor", message, wait_fraction=measured.fraction)
        warn(message)

    def _autotune_step(self, trainer: pl.Trainer, measured: StallMeasurement) -> None:
        datamodule: GPUOptDataModule = trainer.datamodule
        limit = self.max_workers or max_useful_workers(available_cpus(), max(1, trainer.num_devices))
        self._trials.append([int(measured.num_workers), float(measured.step_s), float(measured.fraction)])
        step = autotune_num_workers(self._trials, self.threshold, limit)
        # Rank zero decides for every rank, so all ranks load alike.
        workers, converged = trainer.strategy.broadcast((step.num_workers, step.converged), src=0)
        self._converged = bool(converged)
        self._num_workers = int(workers)
        if workers != measured.num_workers:
            datamodule.num_workers = int(workers)
            _compat.drop_train_loader(trainer.fit_loop)  # Lightning rebuilds it at the next epoch's start
        change = (
            f"num_workers {measured.num_workers} -> {workers}"
            if workers != measured.num_workers
            else f"keeping num_workers={workers}"
        )
        message = f"DataStallMonitor: {change} after epoch {measured.epoch} ({step.reason}){'; autotune settled' if converged else ''}."
        record_decision(
            trainer, "workers", "DataStallMonitor", message, before=measured.num_workers, after=int(workers)
        )
        rank_zero_info(message)


def _train_loader(trainer: pl.Trainer) -> Any:
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        loaders = next(iter(loaders.values()), None)
    elif isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return loaders


def _settings(trainer: pl.Trainer) -> LoaderSettings:
    datamodule = trainer.datamodule
    ours = isinstance(datamodule, GPUOptDataModule)
    loader = _train_loader(trainer)
    on_cuda = trainer.strategy.root_device.type == "cuda"
    context = {
        "cpus": available_cpus(),
        "local_devices": max(1, trainer.num_devices),
        "on_cuda": on_cuda,
        "device_prefetch": datamodule.resolved_device_prefetch() if ours else None,
        "owner": "GPUOptDataModule" if ours else "DataLoader",
    }
    if loader is None:
        loader = DataLoader([])  # nothing known: advise from defaults
    return LoaderSettings.from_loader(loader, **context)
