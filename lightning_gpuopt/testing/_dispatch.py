"""The pure-Python fallback counter of SimulatedMemory: a TorchDispatchMode that counts op outputs.

Used where the counting allocator cannot be built (no C++ compiler). It sees every ATen op run on
the thread that entered it -- forward, autograd backward (on CPU the engine runs on the calling
thread), optimizer steps -- and counts each new output storage until it dies. What it cannot see:
buffers that kernels allocate internally (below the dispatcher), so peaks read low where kernels use
scratch memory -- a ResNet-18 forward peak reads 40 % low (oneDNN's convolution buffers), its
forward+backward peak 1.2 % low, its whole Adam step exact; an MLP is exact -- and ops on other
threads. It also costs more time than the allocator (about 1.1-1.2x on a ResNet-18 step).
Over the limit it raises ``torch.OutOfMemoryError`` after the op, dropping the op's output.

Under ``torch.compile`` dynamo compiles the same graphs as without the mode (it ignores the mode while
compiling), and the mode sees the operators compiled graphs run: a graph compiled with
``backend="aot_eager"`` is counted as in eager. Code that inductor generates allocates its buffers
below the dispatcher, so most of it is not seen.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpuopt.memory.op_outputs import alias_mask

__all__ = ["DispatchCounter", "format_bytes", "format_oom_message"]

_sessions = itertools.count(1)


def format_bytes(n: int) -> str:
    """``n`` bytes for a message: ``"512 bytes"``, ``"1.50 MiB (1572864 bytes)"`` (same as the allocator's)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    value, unit = float(n), 0
    while value >= 1024.0 and unit < len(units) - 1:
        value /= 1024.0
        unit += 1
    return f"{n} bytes" if unit == 0 else f"{value:.2f} {units[unit]} ({n} bytes)"


def format_oom_message(request: int, in_use: int, limit: int) -> str:
    """The simulated OOM message; "CUDA out of memory" in it makes Lightning's own check recognise it."""
    return (
        f"CUDA out of memory (simulated). Tried to allocate {format_bytes(request)}; {format_bytes(in_use)} "
        f"in use; limit {format_bytes(limit)}. Raised by lightning_gpuopt.testing.SimulatedMemory: raise its "
        "`limit_bytes` or use smaller batches."
    )


class _CountingMode(TorchDispatchMode):
    def __init__(self, counter: DispatchCounter) -> None:
        super().__init__()
        self.counter = counter
        self.disabled = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile compiles under this mode as it would without it (dynamo otherwise runs every
        # frame eagerly under a dispatch mode), and the mode sees the operators compiled code runs.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.disabled:
            self.counter._record(func, out)
        return out


class DispatchCounter:
    """Counts live bytes of op-output storages on the entering thread (one session per instance)."""

    name = "dispatch"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        self._mode: _CountingMode | None = None
        self.session = 0
        self._active = False
        self._cur = self._peak = self._num_ooms = 0
        self._limit: int | None = None
        self.oom_callback: Callable[[int, int, int], None] | None = None
        self._in_callback = False

    def on_oom(self, callback: Callable[[int, int, int], None] | None) -> None:
        """Call ``callback(requested, in_use, limit)`` before each over-limit allocation raises (``None``: stop);
        what it allocates itself is never refused."""
        self.oom_callback = callback

    def begin(self, limit: int | None) -> None:
        self.session = next(_sessions)
        self._cur = self._peak = self._num_ooms = 0
        self._limit = limit
        self._live = {}
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        self._active = True
        _active_counters.add(self)

    def end(self) -> None:
        _active_counters.discard(self)
        self._active = False
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._live = {}  # drops the weakrefs, so no callback fires for this session any more

    def set_limit(self, limit: int | None) -> None:
        self._limit = limit

    @property
    def allocated(self) -> int:
        return self._cur

    @property
    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._cur

    @property
    def num_ooms(self) -> int:
        return self._num_ooms

    def owns(self, ptr: int) -> bool:
        return ptr in self._live

    def charge(self, nbytes: int) -> None:
        with self._lock:
            if self._active:
                self._cur += nbytes
                self._peak = max(self._peak, self._cur)

    def release(self, nbytes: int, session: int) -> None:
        with self._lock:
            if self._active and session == self.session:
                self._cur -= nbytes

    def _after_fork_in_child(self) -> None:
        # The child (a DataLoader worker) is not the simulated device: stop counting there.
        self._active = False
        if self._mode is not None:
            self._mode.disabled = True

    # --- counting op outputs -------------------------------------------------------------------
    def _record(self, func, out) -> None:
        mask = alias_mask(func)
        if isinstance(out, torch.Tensor):
            self._track(out, mask[0] if mask else False)
            return
        if not isinstance(out, (tuple, list)):
            return
        if len(mask) == 1:  # one Tensor[] return (split, foreach ops, unbind)
            mask = mask * len(out)
        for item, is_alias in zip(out, mask):
            if isinstance(item, torch.Tensor):
                self._track(item, is_alias)
            elif isinstance(item, (tuple, list)):
                for sub in item:
                    if isinstance(sub, torch.Tensor):
                        self._track(sub, is_alias)

    def _track(self, t: torch.Tensor, is_alias: bool) -> None:
        if t.device.type != "cpu" or getattr(t, "fake_mode", None) is not None:
            return  # a fake tensor (predict_peak's trace) has no memory behind it
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested or wrapper tensors: no plain storage
            return
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
        with self._lock:
            known = self._live.get(ptr)
            if known is not None:
                if known[0] != nbytes:  # an in-place op or out= resized a counted storage
                    self._charge_checked(nbytes - known[0])
                    self._live[ptr] = (nbytes, known[1])
                return
            if is_alias or nbytes == 0:
                return
            self._charge_checked(nbytes)
            session = self.session
            self._live[ptr] = (nbytes, weakref.ref(storage, lambda ref: self._on_free(ptr, ref, session)))

    def _charge_checked(self, nbytes: int) -> None:
        if (
            nbytes > 0
            and self._limit is not None
            and self._cur + nbytes > self._limit
            and not self._in_callback
        ):
            self._num_ooms += 1
            if self.oom_callback is not None:
                self._in_callback = True
                try:
                    self.oom_callback(nbytes, self._cur, self._limit)
                finally:
                    self._in_callback = False
            raise torch.OutOfMemoryError(format_oom_message(nbytes, self._cur, self._limit))
        self._cur += nbytes
        self._peak = max(self._peak, self._cur)

    def _on_free(self, ptr: int, ref: weakref.ref, session: int) -> None:
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None or entry[1] is not ref or session != self.session:
                return
            del self._live[ptr]
            self._cur -= entry[0]


_active_counters: weakref.WeakSet[DispatchCounter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for counter in list(_active_counters):
        counter._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
