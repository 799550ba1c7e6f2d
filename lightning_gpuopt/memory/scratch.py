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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_gpuopt._compat import disable_current_modes, op_schema

__all__ = ["DEFAULT_MAX_BYTES", "KernelCost", "KernelScratch", "kernel_scratch_unavailable", "runnable"]

#: The largest call measured: the bytes its real inputs and outputs take.
DEFAULT_MAX_BYTES = 256 << 20

#: Arguments that carry a kernel's private state between calls (an RNN's workspace from its forward to its
#: backward): fake tensors give them no size, and a kernel handed an empty one reads past it. Such a call
#: runs only when the real size of each is known (measured where the forward made it).
_OPAQUE_ARGUMENTS = frozenset({"workspace"})
#: Ops not run: in-place metadata changes (measured with their metadata after the call), and the CUDA and
#: ROCm fused RNN kernels (never on the CPU). Random operators run under a forked generator: the user's
#: random stream stays as it was.
_SKIPPED_TAGS = ("inplace_view",)
_SKIPPED_PREFIXES = ("_cudnn_rnn", "miopen_rnn", "_thnn_fused", "lstm", "gru", "rnn_")


@dataclass(frozen=True)
class KernelCost:
    """What running an operator call for real showed that its fake outputs do not.

    Attributes:
        scratch: bytes allocated inside the call above its inputs and outputs.
        outputs: the bytes of each tensor output (flattened), where the real one is larger than the fake
            one (an RNN's workspace: its fake has no size); ``None`` when all agree.
    """

    scratch: int = 0
    outputs: tuple[int, ...] | None = None


NOTHING = KernelCost()
_CACHE: dict[tuple, KernelCost] = {}
_LOCK = threading.Lock()  # one measurement at a time: the counting allocator counts every thread


def _lib() -> Any:
    from lightning_gpuopt.memory.counting_allocator import load_native

    return load_native()


def kernel_scratch_unavailable() -> str | None:
    """Why kernel scratch cannot be measured in this process (no C++ compiler, no torch headers), or None."""
    from lightning_gpuopt.memory.counting_allocator import native_status

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
    from lightning_gpuopt.memory.counting_allocator import NativeCounter

    session = NativeCounter()
    session.begin(None)  # raises, saying why, when the allocator cannot be installed
    try:
        yield
    finally:
        session.end()


def runnable(func: Any) -> bool:
    """Whether :class:`KernelScratch` may run ``func`` on zero-filled tensors (see the skipped kinds above)."""
    if getattr(func, "namespace", None) != "aten":
        return False
    name = func.overloadpacket.__name__
    if name.startswith(_SKIPPED_PREFIXES):
        return False
    tags = {str(t).rsplit(".", 1)[-1] for t in getattr(func, "tags", ())}
    return not tags.intersection(_SKIPPED_TAGS)


def _opaque(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The values of ``func``'s opaque arguments in this call."""
    found = []
    for i, a in enumerate(op_schema(func).arguments):
        if a.name in _OPAQUE_ARGUMENTS:
            found.append(args[i] if i < len(args) else kwargs.get(a.name))
    return found


def _settings() -> tuple:
    """Global switches that change which CPU kernel runs."""
    return (
        torch.get_num_threads(),
        torch.is_grad_enabled(),
        torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
    )


def _key(func: Any, flat: list[Any]) -> tuple:
    parts: list[Any] = [func, _settings()]
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append(
                ("T", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.is_conj(), x.is_neg())
            )
        else:
            try:
                hash(x)
                parts.append((type(x), x))  # 2 and 2.0 pick different kernels
            except TypeError:
                parts.append(repr(x))
    return tuple(parts)


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last one ``t`` addresses (stride 0 addresses one)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)


def _dense(t: torch.Tensor) -> bool:
    """Whether materialising ``t`` with its own strides costs about its own bytes (not a view of a far bigger tensor)."""
    return t.numel() == 0 or _span(t) <= 2 * t.numel()


def _real(t: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
    """A zero-filled CPU tensor with ``t``'s shape, dtype and (where that costs about its own bytes) strides.

    Zeros: valid indices, no NaN. A view that addresses a far bigger span is made contiguous instead.
    ``nbytes``: the real size of an opaque buffer whose fake has none (1-D, that many bytes).
    """
    if nbytes is not None:
        return torch.zeros(nbytes // t.element_size(), dtype=t.dtype, device="cpu")
    if t.numel() == 0:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    if not _dense(t):
        return torch.zeros(tuple(t.shape), dtype=t.dtype, device="cpu")
    return torch.zeros(_span(t), dtype=t.dtype, device="cpu").as_strided(tuple(t.shape), tuple(t.stride()))


def _real_bytes(t: torch.Tensor) -> int:
    return (_span(t) if _dense(t) and t.numel() else t.numel()) * t.element_size()


def _storage_bytes(out: Any) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _run(lib: Any, func: Any, flat: list[Any], spec: Any, fake_out: Any, sizes: dict[int, int]) -> KernelCost:
    """The call's cost; its tensors die when this returns (or with the exception it raises)."""
    real = [_real(x, sizes.get(id(x))) if isinstance(x, torch.Tensor) else x for x in flat]
    args, kwargs = tree_unflatten(real, spec)
    before = lib.simmem_allocated()
    lib.simmem_reset_peak()
    result = func(*args, **kwargs)
    peak, after = lib.simmem_peak(), lib.simmem_allocated()
    outputs = _storage_bytes(result)
    del result
    fake = _storage_bytes(fake_out)
    larger = len(outputs) == len(fake) and any(r > f for r, f in zip(outputs, fake))
    return KernelCost(max(0, peak - max(before, after)), tuple(outputs) if larger else None)


class KernelScratch:
    """Measures the scratch bytes of CPU operator calls (see the module docstring); one per prediction.

    Args:
        max_bytes: calls whose inputs and outputs take more are not run, and count as no scratch.

    Example:
        >>> scratch = KernelScratch()
        >>> x, w = torch.zeros(8, 64, 8, 8), torch.zeros(64, 64, 3, 3)
        >>> args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        >>> scratch(torch.ops.aten.convolution.default, args, {}, torch.zeros(8, 64, 8, 8)).scratch >= 0
        True
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.measured = 0  # distinct calls measured in this prediction (cached ones included)
        self.skipped: dict[str, str] = {}  # operators not measured, and why
        self._lib = _lib()

    def __call__(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        out: Any,
        known: Callable[[torch.Tensor], int | None] | None = None,
    ) -> KernelCost:
        """What ``func(*args, **kwargs)`` (fake tensors, ``out`` its fake result) allocates for real.

        ``known(t)``: the real bytes of a fake tensor whose real one is larger (an earlier call's
        :attr:`KernelCost.outputs`), else None; an opaque argument without it is not run.
        """
        if not runnable(func):
            return NOTHING
        name = str(func.overloadpacket.__name__)
        sizes: dict[int, int] = {}
        for t in _opaque(func, args, kwargs):
            real = known(t) if known is not None and isinstance(t, torch.Tensor) else None
            if real is None:
                self.skipped.setdefault(name, "an opaque workspace of unknown size")
                return NOTHING
            sizes[id(t)] = real
        try:
            flat, spec = tree_flatten((args, kwargs))
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            if not tensors or any(t.device.type != "cpu" or t.layout is not torch.strided for t in tensors):
                return NOTHING
            key = _key(func, flat)
            outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
            size = sum(sizes.get(id(t)) or _real_bytes(t) for t in tensors)
            size += sum(t.numel() * t.element_size() for t in outputs)
        except Exception:  # a tensor without plain strides (a subclass): not measured
            self.skipped.setdefault(name, "a tensor without plain strides")
            return NOTHING
        cached = _CACHE.get(key)
        if cached is not None:
            self.measured += 1
            return cached
        if size > self.max_bytes:
            self.skipped.setdefault(name, "over the size cap")
            return NOTHING
        cost = self._measure(func, flat, spec, out, sizes)
        if cost is None:  # an operator that refuses zeros: no scratch known
            self.skipped.setdefault(name, "it refused zero-filled inputs")
            return NOTHING
        _CACHE[key] = cost
        self.measured += 1
        return cost

    def _measure(
        self, func: Any, flat: list[Any], spec: Any, out: Any, sizes: dict[int, int]
    ) -> KernelCost | None:
        lib = self._lib
        # Grad mode as the trace has it (a kernel may keep a workspace for the backward only then); the
        # zeros require no grad, so no graph is built.
        with _LOCK, disable_current_modes(), torch.autocast("cpu", enabled=False):
            with _counting(lib), torch.random.fork_rng(devices=[]):  # its saved state: inside, uncounted
                try:
                    return _run(lib, func, flat, spec, out, sizes)
                except Exception:
                    # Leaving this block frees the traceback and with it the call's tensors, before
                    # _counting puts the simulated peak back.
                    pass
        return None
