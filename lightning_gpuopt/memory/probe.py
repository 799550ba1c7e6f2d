"""One way to read device memory: :class:`MemoryProbe`, its CUDA and CPU implementations, and :func:`get_probe`.

Every figure is in bytes and is a read-only property that asks the device when it is read (nothing is
cached), so ``probe.allocated`` before and after a step tells what the step left behind. The one
action is the method :meth:`MemoryProbe.reset_peak`.

Which probe :func:`get_probe` returns:

1. the active :class:`~lightning_gpuopt.testing.SimulatedMemory` while one is entered in this
   process, whatever device is asked for, so that code written against a GPU runs unchanged on CPU;
2. else a :class:`CudaMemoryProbe` for a CUDA device (the given one, or the current one when CUDA is
   available);
3. else a :class:`CpuMemoryProbe`, which reports the host: system RAM and this process's resident set.

This module imports torch only (no Lightning), so every layer above can use it.
"""

from __future__ import annotations

import abc
import os
import sys
import threading
from typing import Any

import torch

__all__ = ["CpuMemoryProbe", "CudaMemoryProbe", "MemoryProbe", "get_probe"]


class MemoryProbe(abc.ABC):
    """What the pack knows about one device's memory, in bytes.

    Subclasses answer each figure from the device when it is read. ``kind`` says how to read them:
    ``"cuda"`` (the caching allocator's own figures), ``"simulated"``
    (:class:`~lightning_gpuopt.testing.SimulatedMemory`: live tensor bytes), or ``"cpu"`` (process
    resident set; no per-tensor figures exist).

    Example:
        >>> class Fixed(MemoryProbe):
        ...     kind = "fixed"
        ...     device = torch.device("cpu")
        ...     total, free, allocated, reserved, peak, alloc_retries = 100, 40, 50, 60, 70, 0
        ...     def reset_peak(self):
        ...         pass
        >>> Fixed().snapshot()["reserved"]
        60
    """

    #: How the figures are obtained: ``"cuda"``, ``"simulated"`` or ``"cpu"``.
    kind: str = "abstract"
    #: The device the figures describe.
    device: torch.device

    @property
    @abc.abstractmethod
    def total(self) -> int:
        """Bytes this process may use on the device (its budget), not the device's raw capacity."""

    @property
    @abc.abstractmethod
    def free(self) -> int:
        """Bytes that can still be reserved before the budget (or the device) runs out."""

    @property
    @abc.abstractmethod
    def allocated(self) -> int:
        """Bytes held by live tensors."""

    @property
    @abc.abstractmethod
    def reserved(self) -> int:
        """Bytes held by the allocator (live tensors plus its cache); ``>= allocated``."""

    @property
    @abc.abstractmethod
    def peak(self) -> int:
        """Highest :attr:`allocated` since the last :meth:`reset_peak` (or since start)."""

    @abc.abstractmethod
    def reset_peak(self) -> None:
        """Start a new peak window: :attr:`peak` becomes the current :attr:`allocated`."""

    @property
    @abc.abstractmethod
    def alloc_retries(self) -> int:
        """How often the allocator had to free its cache and retry (a sign of memory pressure)."""

    @property
    def peak_reserved(self) -> int:
        """Highest :attr:`reserved` since the last :meth:`reset_peak`; :attr:`peak` where there is no cache."""
        return self.peak

    def snapshot(self) -> dict[str, Any]:
        """All figures at once, as plain values (for logs, reports and ``state_dict``)."""
        return {
            "kind": self.kind,
            "device": str(self.device),
            "total": self.total,
            "free": self.free,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak": self.peak,
            "peak_reserved": self.peak_reserved,
            "alloc_retries": self.alloc_retries,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"


class CudaMemoryProbe(MemoryProbe):
    """Memory of one CUDA device as this process's caching allocator sees it.

    ``total`` honours :func:`torch.cuda.set_per_process_memory_fraction` (device memory × fraction),
    which :func:`torch.cuda.mem_get_info` ignores; ``free`` is what can still be *reserved*:
    ``min(driver free, total − reserved)``. Blocks cached by the allocator (``reserved − allocated``)
    are not counted as free: they are reusable by this process, but only for requests that fit them.

    Args:
        device: a CUDA device (``"cuda:1"``, ``torch.device("cuda", 1)`` or an index); ``None`` means
            the current CUDA device at construction time.

    Raises:
        ValueError: ``device`` is not a CUDA device.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():
        ...     probe = CudaMemoryProbe(0)
        ...     assert 0 <= probe.allocated <= probe.reserved <= probe.total
    """

    kind = "cuda"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int) and not isinstance(device, bool):
            device = torch.device("cuda", device)
        elif isinstance(device, (str, torch.device)):
            device = torch.device(device)
        else:
            raise ValueError(f"`device` must be a CUDA device (str, int or torch.device), got {device!r}")
        if device.type != "cuda":
            raise ValueError(
                f"`device` must be a CUDA device, got {str(device)!r}; use `get_probe({str(device)!r})` "
                "for other devices"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    @property
    def fraction(self) -> float:
        """The per-process memory fraction (1.0 where this torch cannot report it)."""
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        # torch < 2.9 has no getter; its fraction can only be set, so the budget is the device.
        return 1.0 if getter is None else float(getter(self.device))

    @property
    def device_total(self) -> int:
        """The device's whole memory, as the driver reports it (ignores the fraction)."""
        return int(torch.cuda.mem_get_info(self.device)[1])

    @property
    def total(self) -> int:
        # The caching allocator caps reservations at int(fraction * driver total): same figure.
        return int(self.fraction * self.device_total)

    @property
    def free(self) -> int:
        driver_free, device_total = torch.cuda.mem_get_info(self.device)
        budget_left = int(self.fraction * device_total) - self.reserved
        return max(0, min(int(driver_free), budget_left))

    @property
    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    @property
    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    @property
    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    @property
    def peak_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))


class CpuMemoryProbe(MemoryProbe):
    """The host's memory, for training on CPU without :class:`~lightning_gpuopt.testing.SimulatedMemory`.

    There is no per-tensor count on CPU, so the figures describe the process: ``total`` is the
    physical RAM, ``free`` the RAM the kernel reports available, ``allocated`` and ``reserved`` this
    process's resident set size, ``peak`` its high-water mark (``VmHWM``). :meth:`reset_peak` resets
    the high-water mark where Linux allows it (``/proc/self/clear_refs``); elsewhere ``peak`` stays
    the process-lifetime maximum. Figures a platform does not expose read 0. Decide nothing from
    these figures that needs tensor-level accuracy: use ``SimulatedMemory`` for that.

    Example:
        >>> probe = CpuMemoryProbe()
        >>> probe.kind, probe.alloc_retries
        ('cpu', 0)
        >>> probe.total >= probe.free >= 0
        True
    """

    kind = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    @property
    def total(self) -> int:
        try:
            return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            return 0

    @property
    def free(self) -> int:
        available = _read_kib("/proc/meminfo", "MemAvailable:")
        if available is not None:
            return available
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            return 0

    @property
    def allocated(self) -> int:
        return self.reserved

    @property
    def reserved(self) -> int:
        rss = _read_kib("/proc/self/status", "VmRSS:")
        if rss is not None:
            return rss
        return self._max_rss()

    @property
    def peak(self) -> int:
        hwm = _read_kib("/proc/self/status", "VmHWM:")
        return hwm if hwm is not None else self._max_rss()

    def reset_peak(self) -> None:
        # Writing "5" resets VmHWM to the current RSS (Linux >= 4.0); elsewhere peak cannot be reset.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    @property
    def alloc_retries(self) -> int:
        return 0

    @staticmethod
    def _max_rss() -> int:
        try:
            import resource
        except ImportError:  # Windows
            return 0
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, KiB on Linux


def _read_kib(path: str, key: str) -> int | None:
    """The ``key`` line of a /proc file, in bytes (the file says kB); None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# The active simulated probe(s). Process-wide, not thread-local: SimulatedMemory counts the whole
# process (its allocator is process-global), so every thread must see the same probe.
_active: list[MemoryProbe] = []
_active_lock = threading.Lock()


def push_active_probe(probe: MemoryProbe) -> None:
    """Make ``probe`` what :func:`get_probe` returns until :func:`pop_active_probe` (for SimulatedMemory)."""
    with _active_lock:
        _active.append(probe)


def pop_active_probe(probe: MemoryProbe) -> None:
    """Undo :func:`push_active_probe`; ``probe`` must be the most recent one."""
    with _active_lock:
        if not _active or _active[-1] is not probe:
            raise RuntimeError(
                f"{probe!r} is not the active memory probe; probes must be removed in reverse order"
            )
        _active.pop()


def _active_probe() -> MemoryProbe | None:
    with _active_lock:
        return _active[-1] if _active else None


def _clear_active_probes_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) is not the simulated device; it reports its own host.
    global _active_lock
    _active.clear()
    _active_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_clear_active_probes_in_child)


def get_probe(device: torch.device | str | int | None = None) -> MemoryProbe:
    """The probe to read memory from: the active simulated one, else CUDA, else the CPU host.

    Args:
        device: the device to describe (``"cuda:0"``, ``torch.device("cpu")``, a CUDA index).
            ``None``: the current CUDA device when CUDA is available, else the CPU. Ignored while a
            :class:`~lightning_gpuopt.testing.SimulatedMemory` is entered: it stands in for every device.

    Returns:
        A :class:`MemoryProbe`; a new CUDA/CPU probe object per call (they hold no state).

    Raises:
        ValueError: ``device`` is neither CUDA nor CPU (no probe exists for it).

    Example:
        >>> get_probe("cpu").kind
        'cpu'
    """
    active = _active_probe()
    if active is not None:
        return active
    if device is None:
        return CudaMemoryProbe() if torch.cuda.is_available() else CpuMemoryProbe()
    if isinstance(device, int) and not isinstance(device, bool):
        return CudaMemoryProbe(device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"`device` must be a torch device, a device string or a CUDA index, got {device!r}"
        ) from err
    if dev.type == "cuda":
        return CudaMemoryProbe(dev)
    if dev.type == "cpu":
        return CpuMemoryProbe()
    raise ValueError(
        f"`device` must be a CUDA or CPU device, got {str(dev)!r}: no memory probe exists for "
        f"{dev.type!r}; test memory logic on CPU under `lightning_gpuopt.testing.SimulatedMemory`"
    )
