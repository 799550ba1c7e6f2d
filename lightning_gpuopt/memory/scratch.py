"""Kernel scratch on the CPU: what an operator allocates inside itself, measured once per operator call shape.

Fake tensors give every operator's outputs, never what its kernel allocates while it runs: oneDNN's
convolutions reorder weights and activations into blocked layouts (a weight-sized buffer for the
duration of the call), softmax and reduced-precision matmuls keep intermediates, mixed-dtype additions
convert an operand. Which kernel runs, and so what it allocates, depends on the processor (its
instruction set), the thread count and the shapes (oneDNN picks another algorithm at another batch
size), so no table can say it; it is measured instead.

When a step is predicted for the CPU, :class:`KernelScratch` runs each distinct operator call of the
trace (operator, shapes, strides, dtypes and the other arguments) once for real, on zero-filled tensors
of those shapes, under the counting CPU allocator that :class:`~lightning_gpuopt.testing.SimulatedMemory`
also uses (a c10 allocator hook, built on first use with the system C++ compiler). The bytes it
allocated above its inputs and outputs are its scratch, which the trace counts for that moment of the
step (category "kernel scratch"). Each result is kept for the process. Calls whose real tensors
would take more than ``max_bytes`` are not run (the prediction says how many).

Inside an entered SimulatedMemory the measurement is invisible to it: no limit applies while a kernel is
measured, and the simulated peak is put back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["DEFAULT_MAX_BYTES", "KernelScratch", "kernel_scratch_unavailable"]

#: The largest call measured: its real inputs and outputs together.
DEFAULT_MAX_BYTES = 256 << 20

_CACHE: dict[tuple, int] = {}


def _lib() -> Any:
    from lightning_gpuopt.memory._native import load_native

    return load_native()


def kernel_scratch_unavailable() -> str | None:
    """Why kernel scratch cannot be measured in this process (no C++ compiler, no torch headers), or None."""
    from lightning_gpuopt.memory._native import native_status

    return native_status()


@contextlib.contextmanager
def _counting(lib: Any) -> Iterator[None]:
    if lib.simmem_active():  # a SimulatedMemory is entered: measure in its session, leave no trace
        limit, peak = lib.simmem_limit(), lib.simmem_peak()
        lib.simmem_set_limit(-1)
        try:
            yield
        finally:
            lib.simmem_set_limit(limit)
            lib.simmem_set_peak(peak)
        return
    rc = lib.simmem_begin(-1)
    if rc != 0:
        if rc == 2:
            lib.simmem_end()
        raise RuntimeError("the counting CPU allocator could not be installed")
    try:
        yield
    finally:
        lib.simmem_end()


def _key(func: Any, flat: list[Any]) -> tuple:
    parts: list[Any] = [func, torch.get_num_threads()]
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append(("T", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype))
        else:
            try:
                hash(x)
                parts.append(x)
            except TypeError:
                parts.append(repr(x))
    return tuple(parts)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A zero-filled CPU tensor with ``t``'s shape, strides, offset and dtype (zeros: valid indices, no NaN)."""
    if t.numel() == 0:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype)
    extent = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return torch.zeros(extent, dtype=t.dtype).as_strided(
        tuple(t.shape), tuple(t.stride()), t.storage_offset()
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class KernelScratch:
    """Measures the scratch bytes of CPU operator calls (see the module docstring); one per prediction.

    Args:
        max_bytes: calls whose inputs and outputs take more are not run, and count as no scratch.

    Example:
        >>> scratch = KernelScratch()
        >>> x, w = torch.zeros(8, 64, 8, 8), torch.zeros(64, 64, 3, 3)
        >>> args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        >>> scratch(torch.ops.aten.convolution.default, args, {}, torch.zeros(8, 64, 8, 8)) >= 0
        True
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.measured = 0  # distinct calls measured in this prediction (cached ones included)
        self.skipped: set[str] = set()  # operators not measured: too large, or they failed on zeros
        self._lib = _lib()

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        if getattr(func, "namespace", None) != "aten":
            return 0
        flat, spec = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if not tensors or any(t.device.type != "cpu" or t.layout is not torch.strided for t in tensors):
            return 0
        key = _key(func, flat)
        cached = _CACHE.get(key)
        if cached is not None:
            self.measured += 1
            return cached
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if sum(_nbytes(t) for t in tensors + outputs) > self.max_bytes:
            self.skipped.add(str(func.overloadpacket.__name__))
            return 0
        try:
            nbytes = self._measure(func, flat, spec)
        except Exception:  # an operator that refuses zeros (or this allocator): no scratch known
            self.skipped.add(str(func.overloadpacket.__name__))
            return 0
        _CACHE[key] = nbytes
        self.measured += 1
        return nbytes

    def _measure(self, func: Any, flat: list[Any], spec: Any) -> int:
        from torch.utils._python_dispatch import _disable_current_modes

        lib = self._lib
        with _disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            with _counting(lib):
                real = [_real(x) if isinstance(x, torch.Tensor) else x for x in flat]
                args, kwargs = tree_unflatten(real, spec)
                before = lib.simmem_allocated()
                lib.simmem_reset_peak()
                result = func(*args, **kwargs)
                peak, after = lib.simmem_peak(), lib.simmem_allocated()
                del result, args, kwargs, real
        return max(0, peak - max(before, after))
