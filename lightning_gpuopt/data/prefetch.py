"""Device prefetch: copy the next batch to the GPU on a side CUDA stream while the current step computes.

The pieces, from the bottom up:

- :class:`BatchTransfer` says how a batch reaches the device ahead of use: :meth:`~BatchTransfer.start`
  begins the copy and returns an :class:`InFlight`; :meth:`~BatchTransfer.ready` makes the consumer's
  stream wait for that copy and returns the batch to use. :class:`CudaStreamTransfer` is the real one.
  Tests inject their own, so the iterator logic runs on CPU.
- :class:`DevicePrefetcher` wraps any iterator of host batches and keeps ``depth`` batches copying
  ahead: when batch *i* is handed out, the copy of batch *i + 1* is already queued on the side stream,
  so it overlaps with step *i*'s compute. Batches come out whole, in the order they went in.
- :class:`DevicePrefetchLoader` is a ``DataLoader`` whose iterator is a :class:`DevicePrefetcher`.
  It stays a ``DataLoader`` so that Lightning can re-instantiate it (distributed sampler under DDP,
  the index sampler of ``predict``) with the same transfer.

Correctness on CUDA: the copy runs on a side stream; :meth:`CudaStreamTransfer.ready` makes the
current stream wait on an event recorded after the copy (a stream-ordered wait: the host never
blocks) and calls ``record_stream`` on every tensor of the batch, so the caching allocator does not
hand its memory out again while the compute stream may still read it. The wait happens when the
batch is handed out, whatever consumes it next.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_gpuopt._validate import positive_int
from lightning_gpuopt._warnings import warn
from lightning_gpuopt.memory import format_bytes, free_memory, is_oom_error
from lightning_gpuopt.memory.walk import batch_nbytes, leaves

__all__ = [
    "BatchTransfer",
    "CudaStreamTransfer",
    "DevicePrefetchLoader",
    "DevicePrefetcher",
    "InFlight",
    "PrefetchStats",
    "batch_nbytes",
]


@dataclass
class InFlight:
    """One batch on its way to the device.

    Attributes:
        batch: the batch as it will be handed out (on the device, possibly still being copied).
        nbytes: device bytes the batch holds (0 when it stays on the host).
        token: what the transfer needs to make the batch ready (a CUDA event for
            :class:`CudaStreamTransfer`).
        on_device: ``False`` when the batch was passed through on the host (Lightning moves it when used).
    """

    batch: Any
    nbytes: int = 0
    token: Any = None
    on_device: bool = True


class BatchTransfer(abc.ABC):
    """How batches reach the device ahead of use. Subclass it to prefetch to another device, or in tests."""

    @abc.abstractmethod
    def start(self, batch: Any) -> InFlight:
        """Begin copying ``batch`` to the device without waiting for the copy; return it in flight."""

    @abc.abstractmethod
    def ready(self, item: InFlight) -> Any:
        """Make the consumer wait (stream-ordered) for ``item``'s copy; return the batch to use."""


@dataclass
class PrefetchStats:
    """What a prefetching loader has copied, shared by the loader and its datamodule.

    Attributes:
        batches: batches copied to the device ahead of use.
        max_batch_bytes: device bytes of the largest batch copied.
        batches_ahead: batches the pipeline holds on the device beyond the one being used.
        disabled: set after an out-of-memory error in a copy; later batches stay on the host.
    """

    batches: int = 0
    max_batch_bytes: int = 0
    batches_ahead: int = 0
    disabled: bool = False

    @property
    def reserved_bytes(self) -> int:
        """Device memory held ahead of the batch in use: ``batches_ahead × max_batch_bytes``."""
        return 0 if self.disabled else self.batches_ahead * self.max_batch_bytes


def _leaves(obj: Any) -> Iterator[Any]:
    """The leaves of a batch: what is not a mapping, list, tuple or dataclass instance."""
    return (leaf for _, leaf in leaves(obj))


def _only_tensors_move(batch: Any) -> bool:
    # Objects with their own `.to` hide their tensors from `record_stream`; their device memory could be
    # reused while the compute stream still reads it. Such batches are left for Lightning to move.
    return not any(
        not isinstance(leaf, Tensor) and callable(getattr(leaf, "to", None)) for leaf in _leaves(batch)
    )


_copy_streams: dict[int, torch.cuda.Stream] = {}


class CudaStreamTransfer(BatchTransfer):
    """Copies batches to a CUDA device on a side stream, one per device and process.

    The copy is ``non_blocking`` (asynchronous from pinned host memory; turn on ``pin_memory``), made
    with Lightning's ``move_data_to_device``, so any structure Lightning moves is moved alike. A
    batch holding objects with their own ``.to`` method (not plain tensors) is passed through on the
    host: their tensors could not be protected with ``record_stream``.

    Args:
        device: the CUDA device to copy to.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    def __init__(self, device: torch.device | str | int) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"`device` must be a CUDA device, got {str(device)!r}")
        self.device = device

    def _index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream copies run on (created on first use; reused so its cached blocks are reused)."""
        index = self._index()
        if index not in _copy_streams:
            _copy_streams[index] = torch.cuda.Stream(device=index)
        return _copy_streams[index]

    def start(self, batch: Any) -> InFlight:
        if not _only_tensors_move(batch):
            return InFlight(batch, on_device=False)
        stream = self.stream
        device = torch.device("cuda", self._index())
        with torch.cuda.stream(stream):
            moved = move_data_to_device(batch, device)
            event = torch.cuda.Event()
            event.record(stream)
        return InFlight(moved, nbytes=batch_nbytes(moved, "cuda"), token=event)

    def ready(self, item: InFlight) -> Any:
        current = torch.cuda.current_stream(self._index())
        current.wait_event(item.token)
        for leaf in _leaves(item.batch):
            if isinstance(leaf, Tensor) and leaf.is_cuda:
                leaf.record_stream(current)
        return item.batch

    def __repr__(self) -> str:
        return f"CudaStreamTransfer(device={str(self.device)!r})"


class DevicePrefetcher(Iterator[Any]):
    """Iterates host batches and hands them out on the device, ``depth`` copies ahead of use.

    The first batch is copied when it is first asked for; from then on, each call hands out the
    oldest batch in flight (made ready for the consumer) after queueing the copy of the next one, so
    ``depth`` batches are always copying or copied while the consumer computes on the current one.
    Every batch comes out exactly once, whole and in order; at most ``depth`` batches are read from
    the source beyond the one handed out.

    An out-of-memory error while copying a batch is not fatal: that batch and all later ones of the
    loader are handed out on the host (Lightning copies them when used), memory is freed, and a
    :class:`~lightning_gpuopt.GPUOptWarning` says so.

    Args:
        batches: an iterable of host batches (a DataLoader's iterator).
        transfer: how batches reach the device.
        depth: batches kept in flight ahead of the one in use (at least 1).
        stats: counters shared with the loader that built this iterator.

    Raises:
        ValueError: ``depth`` is not a positive int.

    Example:
        >>> class Clone(BatchTransfer):  # a stand-in for the device copy
        ...     def start(self, batch):
        ...         return InFlight(batch.clone(), nbytes=batch.nbytes)
        ...     def ready(self, item):
        ...         return item.batch
        >>> [int(b.sum()) for b in DevicePrefetcher([torch.ones(2), torch.ones(3)], Clone())]
        [2, 3]
    """

    def __init__(
        self,
        batches: Iterable[Any],
        transfer: BatchTransfer,
        depth: int = 1,
        stats: PrefetchStats | None = None,
    ) -> None:
        positive_int("depth", depth)
        self._source = iter(batches)
        self._transfer = transfer
        self.depth = depth
        self.stats = stats if stats is not None else PrefetchStats()
        self._queue: deque[InFlight] = deque()
        self._exhausted = False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if not self._queue:
            self._fill(1)
        if not self._queue:
            raise StopIteration
        item = self._queue.popleft()
        batch = self._transfer.ready(item) if item.on_device else item.batch
        self._fill(self.depth)  # queue the next copy before this batch's compute is launched
        return batch

    def _fill(self, size: int) -> None:
        while not self._exhausted and len(self._queue) < size:
            try:
                host = next(self._source)
            except StopIteration:
                self._exhausted = True
                return
            self._queue.append(self._start(host))

    def _start(self, host: Any) -> InFlight:
        if self.stats.disabled:
            return InFlight(host, on_device=False)
        failed = False
        try:
            item = self._transfer.start(host)
        except Exception as err:
            if not is_oom_error(err):
                raise
            failed = True
        if failed:
            # Outside the except block, so the traceback no longer pins what the copy allocated.
            self.stats.disabled = True
            free_memory()
            warn(
                f"Device prefetch ran out of memory copying a batch of {format_bytes(batch_nbytes(host))} to the "
                "device; it is off for this loader from now on and batches are copied when used. Nothing is lost. "
                "Reserve `device_prefetch_bytes` in the memory budget, lower `batch_size`, or set "
                "`device_prefetch=False`."
            )
            return InFlight(host, on_device=False)
        if item.on_device:
            self.stats.batches += 1
            self.stats.max_batch_bytes = max(self.stats.max_batch_bytes, item.nbytes)
        return item


class DevicePrefetchLoader(DataLoader):
    """A ``DataLoader`` whose iterator copies batches to the device ahead of use (a :class:`DevicePrefetcher`).

    Takes every ``DataLoader`` argument, plus the three below, which Lightning keeps when it
    re-instantiates the loader (distributed sampler, predict's index sampler). With ``transfer=None``
    it is a plain ``DataLoader``.

    Args:
        *args: ``DataLoader`` arguments.
        transfer: how batches reach the device; ``None``: no device prefetch.
        prefetch_depth: batches kept in flight ahead of the one in use.
        prefetch_stats: counters shared with the owner (the datamodule reads device bytes from them).
        **kwargs: ``DataLoader`` arguments.
    """

    def __init__(
        self,
        *args: Any,
        transfer: BatchTransfer | None = None,
        prefetch_depth: int = 1,
        prefetch_stats: PrefetchStats | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        positive_int("prefetch_depth", prefetch_depth)
        self.transfer = transfer
        self.prefetch_depth = prefetch_depth
        self.prefetch_stats = prefetch_stats if prefetch_stats is not None else PrefetchStats()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        stats = self.prefetch_stats
        if self.transfer is None or stats.disabled:
            return batches
        # Lightning's fetcher reads one batch ahead of the step when the loader has no length.
        try:
            len(self)
            lightning_ahead = 0
        except TypeError:
            lightning_ahead = 1
        stats.batches_ahead = self.prefetch_depth + lightning_ahead
        return DevicePrefetcher(batches, self.transfer, depth=self.prefetch_depth, stats=stats)
