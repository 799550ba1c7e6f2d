"""The rules behind DataStallMonitor: when the loop is starved of data, what to change, and the next worker count.

Pure functions over plain values (no Trainer), so each rule is tested on its own:

- :func:`data_wait_fraction` / :func:`is_data_stalled`: the classification.
- :func:`stall_advice`: concrete changes (which knob, which value, why) for a loader's settings.
- :func:`autotune_num_workers`: one step of the between-epochs search for ``num_workers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt.data.datamodule import auto_num_workers

__all__ = [
    "Advice",
    "AutotuneStep",
    "LoaderSettings",
    "StallMeasurement",
    "autotune_num_workers",
    "data_wait_fraction",
    "is_data_stalled",
    "max_useful_workers",
    "stall_advice",
    "stall_message",
]

#: Prefetch factor suggested when the workers are already at the CPU limit.
_DEEP_PREFETCH = 4


def data_wait_fraction(wait_s: float, compute_s: float) -> float:
    """The share of step time spent waiting for data: ``wait / (wait + compute)``; 0 when nothing was measured.

    Example:
        >>> data_wait_fraction(wait_s=1.0, compute_s=3.0)
        0.25
    """
    total = wait_s + compute_s
    return 0.0 if total <= 0 else max(0.0, wait_s) / total


def is_data_stalled(wait_s: float, compute_s: float, threshold: float) -> bool:
    """Whether the loop waited for data more than ``threshold`` of the time.

    Example:
        >>> is_data_stalled(wait_s=0.4, compute_s=0.6, threshold=0.1), is_data_stalled(0.01, 0.99, 0.1)
        (True, False)
    """
    return data_wait_fraction(wait_s, compute_s) > threshold


@dataclass(frozen=True)
class StallMeasurement:
    """How long the training loop waited for data and computed, over ``steps`` steps.

    Attributes:
        steps: training steps measured.
        wait_s: seconds between steps (the loop waiting for the next batch).
        compute_s: seconds inside steps.
        epoch: the epoch measured, when the figure covers one.
        num_workers: the loader's worker count during the measurement, when known.
    """

    steps: int
    wait_s: float
    compute_s: float
    epoch: int | None = None
    num_workers: int | None = None

    @property
    def fraction(self) -> float:
        """:func:`data_wait_fraction` of this measurement."""
        return data_wait_fraction(self.wait_s, self.compute_s)

    @property
    def step_s(self) -> float:
        """Mean seconds per step, waiting included (0 without steps)."""
        return (self.wait_s + self.compute_s) / self.steps if self.steps else 0.0

    def stalled(self, threshold: float) -> bool:
        """:func:`is_data_stalled` of this measurement."""
        return is_data_stalled(self.wait_s, self.compute_s, threshold)


@dataclass(frozen=True)
class LoaderSettings:
    """What the advice needs to know about a training loader and the machine.

    Attributes:
        num_workers: the loader's worker processes.
        pin_memory: whether it pins host memory.
        persistent_workers: whether its workers live across epochs.
        prefetch_factor: batches each worker loads ahead (``None`` without workers).
        cpus: CPUs this process may use.
        local_devices: devices on this machine sharing those CPUs.
        on_cuda: whether training runs on CUDA.
        device_prefetch: whether batches are copied to the device ahead of use; ``None`` where the
            loaders do not come from a GPUOptDataModule (no such knob).
        owner: what to name in the advice: ``"GPUOptDataModule"`` or ``"DataLoader"``.
        is_dataloader: ``False`` when the training data is not a ``torch.utils.data.DataLoader``.
    """

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    cpus: int
    local_devices: int = 1
    on_cuda: bool = False
    device_prefetch: bool | None = None
    owner: str = "DataLoader"
    is_dataloader: bool = True

    @classmethod
    def from_loader(cls, loader: Any, **context: Any) -> LoaderSettings:
        """Read the settings of a DataLoader (or any object with the same attributes); ``context`` fills the rest."""
        from torch.utils.data import DataLoader

        workers = int(getattr(loader, "num_workers", 0) or 0)
        return cls(
            num_workers=workers,
            pin_memory=bool(getattr(loader, "pin_memory", False)),
            persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            prefetch_factor=getattr(loader, "prefetch_factor", None) if workers > 0 else None,
            is_dataloader=isinstance(loader, DataLoader),
            **context,
        )


def max_useful_workers(cpus: int, local_devices: int = 1) -> int:
    """The most loader workers per device the CPUs can run beside the main process (at least 1).

    Example:
        >>> max_useful_workers(cpus=16, local_devices=2), max_useful_workers(cpus=1)
        (7, 1)
    """
    return max(1, cpus // max(1, local_devices) - 1)


@dataclass(frozen=True)
class Advice:
    """One concrete change: set ``knob`` from ``current`` to ``suggested``, because ``reason``."""

    knob: str
    current: Any
    suggested: Any
    reason: str

    def __str__(self) -> str:
        if isinstance(self.suggested, (bool, int, float)):
            return f"`{self.knob}={self.suggested!r}` (now {self.current!r}): {self.reason}"
        return f"{self.suggested} (now {self.current}): {self.reason}"


def stall_advice(settings: LoaderSettings) -> list[Advice]:
    """What to change when the loop waits for data, most effective first.

    Example:
        >>> s = LoaderSettings(num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None,
        ...                    cpus=8, on_cuda=True, device_prefetch=False, owner="GPUOptDataModule")
        >>> [str(a).split(" (")[0] for a in stall_advice(s)]
        ['`num_workers=7`', '`pin_memory=True`', '`device_prefetch=True`']
    """
    advice: list[Advice] = []
    if not settings.is_dataloader:
        return [
            Advice(
                "training data",
                "not a torch DataLoader",
                "a DataLoader with worker processes (`num_workers`), or a GPUOptDataModule",
                "an iterable without worker processes loads every batch in the training process",
            )
        ]
    workers, limit = settings.num_workers, max_useful_workers(settings.cpus, settings.local_devices)
    cpus = f"{settings.cpus} CPUs for {settings.local_devices} device(s)"
    if workers == 0:
        suggested = max(1, auto_num_workers(settings.cpus, settings.local_devices, cap=limit))
        advice.append(
            Advice(
                "num_workers",
                0,
                suggested,
                f"batches are loaded in the training process; {cpus} leave {limit} for workers",
            )
        )
    elif workers < limit:
        advice.append(
            Advice(
                "num_workers",
                workers,
                min(limit, 2 * workers),
                f"more workers load in parallel; {cpus} run up to {limit}",
            )
        )
    if workers > 0 and not settings.persistent_workers:
        advice.append(Advice("persistent_workers", False, True, "workers are restarted every epoch"))
    if settings.on_cuda and not settings.pin_memory:
        advice.append(
            Advice(
                "pin_memory", False, True, "copies to the GPU from pinned memory are asynchronous and faster"
            )
        )
    if settings.on_cuda and settings.device_prefetch is False:
        advice.append(
            Advice(
                "device_prefetch",
                False,
                True,
                "the next batch is copied to the GPU while the current step computes",
            )
        )
    if workers >= limit:
        if settings.prefetch_factor is not None and settings.prefetch_factor < _DEEP_PREFETCH:
            advice.append(
                Advice(
                    "prefetch_factor",
                    settings.prefetch_factor,
                    _DEEP_PREFETCH,
                    "deeper worker queues absorb slow samples",
                )
            )
        advice.append(
            Advice(
                "data pipeline",
                f"{workers} worker(s), the most {cpus} allow",
                "cheaper samples: decoded arrays stored once (`MemmapDataset`), augmentation on the GPU "
                "(`on_after_batch_transfer`), or smaller inputs",
                "loading is CPU-bound",
            )
        )
    return advice


def stall_message(
    measurement: StallMeasurement, threshold: float, advice: Sequence[Advice], where: str = ""
) -> str:
    """The one warning DataStallMonitor gives: the measurement, then the advice, numbered.

    Example:
        >>> m = StallMeasurement(steps=50, wait_s=2.0, compute_s=3.0)
        >>> stall_message(m, 0.1, [Advice("num_workers", 0, 3, "more CPUs")])[:71]
        'DataStallMonitor: the training loop waited for data 40% of the time ove'
    """
    per_step = (
        f"{1e3 * measurement.wait_s / max(1, measurement.steps):.1f} ms waiting vs "
        f"{1e3 * measurement.compute_s / max(1, measurement.steps):.1f} ms computing per step"
    )
    place = f", {where}" if where else ""
    tips = (
        " ".join(f"{i}) {a}." for i, a in enumerate(advice, 1))
        if advice
        else "No loader setting left to change."
    )
    return (
        f"DataStallMonitor: the training loop waited for data {measurement.fraction:.0%} of the time over the last "
        f"{measurement.steps} steps{place} (threshold {threshold:.0%}; {per_step}). Try: {tips}"
    )


@dataclass(frozen=True)
class AutotuneStep:
    """The worker count for the next epoch, whether the search is over, and why (a sentence for the log)."""

    num_workers: int
    converged: bool
    reason: str


def autotune_num_workers(
    trials: Sequence[Sequence[float]], threshold: float, max_workers: int, min_gain: float = 0.05
) -> AutotuneStep:
    """One step of the search for ``num_workers``: double while the loop stalls and each doubling pays.

    Args:
        trials: ``(num_workers, seconds per step, wait fraction)`` per measured epoch, oldest first.
        threshold: the wait fraction that counts as a stall.
        max_workers: the most workers to try.
        min_gain: the step-time improvement a raise must bring to be kept (0.05: 5 % faster).

    Returns:
        The count to use next. Converged when the loop no longer stalls, the limit is reached, or the
        last raise did not make steps ``min_gain`` faster (then it goes back to the previous count:
        as fast, fewer CPUs).

    Raises:
        ValueError: no trials.

    Example:
        >>> autotune_num_workers([(0, 0.070, 0.57)], threshold=0.1, max_workers=7)
        AutotuneStep(num_workers=1, converged=False, reason='waited 57% of the time (threshold 10%) with 0 workers: trying 1')
        >>> autotune_num_workers([(0, 0.070, 0.57), (1, 0.069, 0.5)], threshold=0.1, max_workers=7).num_workers
        0
    """
    if not trials:
        raise ValueError(
            "`trials` must hold at least one (num_workers, step seconds, wait fraction) measurement"
        )
    workers, step_s, fraction = int(trials[-1][0]), float(trials[-1][1]), float(trials[-1][2])
    if len(trials) >= 2:
        before, before_s = int(trials[-2][0]), float(trials[-2][1])
        if workers > before and step_s > before_s * (1 - min_gain):
            return AutotuneStep(
                before,
                True,
                f"{workers} workers were not faster than {before} ({1e3 * step_s:.1f} vs {1e3 * before_s:.1f} ms "
                f"per step): back to {before}",
            )
    if fraction <= threshold:
        return AutotuneStep(
            workers,
            True,
            f"waited {fraction:.0%} of the time (threshold {threshold:.0%}): keeping {workers} workers",
        )
    if workers >= max_workers:
        return AutotuneStep(
            workers,
            True,
            f"still waited {fraction:.0%} of the time with {workers} workers, the most allowed: loading is CPU-bound",
        )
    new = min(max_workers, max(1, 2 * workers))
    return AutotuneStep(
        new,
        False,
        f"waited {fraction:.0%} of the time (threshold {threshold:.0%}) with {workers} workers: trying {new}",
    )
