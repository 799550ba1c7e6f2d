"""The device a GPU check section runs on, and its time slice.

Every memory call of the sections (limit, allocated, peak, reset, synchronise) goes through the current
:class:`Device`: a real CUDA device under a memory cap, or SimulatedMemory on the CPU (``--dry-run``), so
the same section code runs on an H200 and, with tiny sizes, on a CPU.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

import common
import lightning.pytorch as pl
import torch

from lightning_gpuopt.memory import get_probe

#: The most memory one section may use on a real device (``set_per_process_memory_fraction``).
SECTION_CAP_BYTES = 16 * 2**30


class Device:
    """One section's device. ``set_limit(None)`` returns to the section's cap, never above it."""

    kind = "?"
    accelerator = "cpu"
    name = "?"

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes

    def total(self) -> int:
        """The memory the section may use (its cap)."""
        return self.cap_bytes

    def _limit(self, limit_bytes: int | None) -> int:
        return self.cap_bytes if limit_bytes is None else min(limit_bytes, self.cap_bytes)

    # The pack's memory probe reads the device: SimulatedMemory's while the dry run's is entered, else CUDA's.
    def allocated(self) -> int:
        return get_probe().allocated

    def peak(self) -> int:
        return get_probe().peak

    def reset_peak(self) -> None:
        get_probe().reset_peak()

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def session(self) -> Iterator[Device]:
        """Enter the device for one section (the cap applies inside)."""
        yield self


class CudaDevice(Device):
    kind = accelerator = "cuda"

    def __init__(self, cap_bytes: int = SECTION_CAP_BYTES) -> None:
        self.device_bytes = torch.cuda.get_device_properties(0).total_memory
        super().__init__(min(cap_bytes, self.device_bytes))
        self.name = torch.cuda.get_device_name(0)

    def set_limit(self, limit_bytes: int | None) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(self._limit(limit_bytes) / self.device_bytes, 0)

    def synchronize(self) -> None:
        torch.cuda.synchronize(0)

    def is_its_oom(self, message: str) -> bool:
        """Whether an OOM message is a real CUDA one."""
        from lightning_gpuopt.memory import OOM_MESSAGES

        cuda = tuple(m for m in OOM_MESSAGES if m.startswith(("CUDA", "CUBLAS", "CUDNN")))
        return "(simulated)" not in message and any(text in message for text in cuda)

    @contextlib.contextmanager
    def session(self) -> Iterator[Device]:
        self.set_limit(None)
        try:
            yield self
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, 0)


class SimulatedDevice(Device):
    """The CPU with :class:`~lightning_gpuopt.testing.SimulatedMemory` standing in for the device's memory."""

    kind, name = "simulated", "cpu (SimulatedMemory)"

    def __init__(self, cap_bytes: int = SECTION_CAP_BYTES) -> None:
        super().__init__(cap_bytes)
        self.memory = None

    def set_limit(self, limit_bytes: int | None) -> None:
        gc.collect()
        self.memory.limit_bytes = self._limit(limit_bytes)

    def is_its_oom(self, message: str) -> bool:
        return "out of memory (simulated)" in message

    @contextlib.contextmanager
    def session(self) -> Iterator[Device]:
        from lightning_gpuopt.testing import SimulatedMemory

        with SimulatedMemory(limit_bytes=self.cap_bytes) as memory:
            self.memory = memory
            try:
                yield self
            finally:
                self.memory = None


_current: list[Device] = []


def current() -> Device:
    """The device of the section running now (a plain CUDA device under the cap when none was entered)."""
    if not _current:
        _current.append(CudaDevice())
    return _current[-1]


@contextlib.contextmanager
def use(device: Device) -> Iterator[Device]:
    """Run a section on ``device``: entered, capped, and what :func:`current` returns."""
    with device.session():
        _current.append(device)
        try:
            yield device
        finally:
            _current.remove(device)


class SliceOver(BaseException):
    """The running section is past its time slice (a BaseException, so ``except Exception`` lets it through)."""


_deadline: list[float] = []


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Sections running inside stop at the next :func:`check` once ``seconds`` have passed."""
    _deadline.append(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.pop()


def remaining() -> float | None:
    """Seconds left in the running section's slice (``None`` outside a section)."""
    return _deadline[-1] - time.monotonic() if _deadline else None


def check() -> None:
    """Raise :class:`SliceOver` when the running section is past its slice (call it in every loop)."""
    if _deadline and time.monotonic() > _deadline[-1]:
        raise SliceOver("past the section's time slice")


class Deadline(pl.Callback):
    """Stops a fit at a batch boundary once its section is past its slice (add it to every Trainer)."""

    def on_train_batch_start(self, *args: object) -> None:
        check()

    def on_train_batch_end(self, *args: object) -> None:
        check()


def trainer(steps: int, callbacks: list, **kwargs: Any) -> pl.Trainer:
    """A quiet Trainer of ``steps`` steps on the current device, with :class:`Deadline` first among its callbacks."""
    return common.trainer(steps, [Deadline(), *callbacks], current().accelerator, **kwargs)
