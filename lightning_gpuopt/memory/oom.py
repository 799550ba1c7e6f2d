"""The one OOM check of the pack (:func:`is_oom_error`, :func:`is_maybe_size_error`) and the one cleanup (:func:`free_memory`).

Use them in this order, the cleanup *outside* the ``except`` block::

    try:
        loss = step(batch)
        oom = False
    except Exception as err:
        if not is_oom_error(err):
            raise
        oom = True
    if oom:                 # the traceback, and the activations its frames hold, are gone now
        free_memory()
        ...                 # shrink and retry

While an ``except`` block runs, the exception's traceback keeps every frame of the failed step alive,
and with them their locals: the activations, the partial graph, the batch on the device. Memory
freed there comes back only when the block is left.
"""

from __future__ import annotations

import gc

import torch

from lightning_gpuopt._compat import clear_cublas_workspaces

__all__ = ["MAYBE_SIZE_MESSAGES", "OOM_MESSAGES", "free_memory", "is_maybe_size_error", "is_oom_error"]

#: Substrings that mark an out-of-memory error raised as a plain ``RuntimeError`` (or another type).
OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",  # caching allocator, all CUDA versions (also SimulatedMemory's message)
    "CUDA error: out of memory",  # cudaErrorMemoryAllocation from a kernel launch / cudaMalloc
    "CUDA driver error: out of memory",  # driver API, e.g. expandable segments (cuMemCreate)
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its workspace
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN could not allocate its workspace
    "DefaultCPUAllocator: can't allocate memory",  # host allocator (pinned buffers, CPU tensors)
    "HIP out of memory",  # ROCm caching allocator
    "HIP error: out of memory",  # ROCm runtime
)

#: Substrings of errors that are often a size limit in disguise: shrink once, then re-raise the original.
MAYBE_SIZE_MESSAGES: tuple[str, ...] = ("CUDNN_STATUS_NOT_SUPPORTED",)

# torch.OutOfMemoryError appeared in torch 2.5 (torch.cuda.OutOfMemoryError is the older spelling).
_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    {
        t
        for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
        if t
    }
)


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not hide the original error
        return ""


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: its type first, then its message.

    True for ``torch.OutOfMemoryError`` (raised by the CUDA caching allocator and by
    :class:`~lightning_gpuopt.testing.SimulatedMemory`) and for any exception whose message contains
    one of :data:`OOM_MESSAGES` (older torch, cuBLAS/cuDNN workspaces, the CPU allocator, ROCm).
    ``CUDNN_STATUS_NOT_SUPPORTED`` is *not* an OOM here: see :func:`is_maybe_size_error`. Chained
    exceptions (``__cause__``/``__context__``) are not followed: an error raised while handling an OOM
    is a different error.

    Args:
        exc: the caught exception.

    Example:
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
        True
        >>> is_oom_error(ValueError("shapes do not match"))
        False
    """
    if isinstance(exc, _OOM_TYPES):
        return True
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: never an OOM
        return False
    message = _message(exc)
    return any(text in message for text in OOM_MESSAGES)


def is_maybe_size_error(exc: BaseException) -> bool:
    """Whether ``exc`` may be caused by an input too large for a kernel, without being an OOM.

    cuDNN answers ``CUDNN_STATUS_NOT_SUPPORTED`` for some shapes it cannot handle, often only above a
    size. The advice: retry once with a smaller micro-batch; if that fails too, re-raise the original
    error. Disjoint from :func:`is_oom_error`.

    Args:
        exc: the caught exception.

    Example:
        >>> is_maybe_size_error(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."))
        True
        >>> is_maybe_size_error(torch.OutOfMemoryError("CUDA out of memory"))
        False
    """
    if not isinstance(exc, Exception) or is_oom_error(exc):
        return False
    message = _message(exc)
    return any(text in message for text in MAYBE_SIZE_MESSAGES)


def free_memory(generation: int = 2) -> None:
    """Give memory back after an OOM: collect garbage, empty the CUDA cache, drop cuBLAS workspaces.

    Call it after leaving the ``except`` block (see the module docstring): inside it the traceback
    still pins the failed step's tensors. It does not initialise CUDA when it is not in use, so it
    costs only a ``gc.collect(generation)`` on CPU. It frees nothing that is still referenced: drop your own
    references (outputs, loss, partial gradients) first. ``generation``: 2 collects every object; 1
    only the young ones (cycles made lately), a small part of the cost in a process with a large heap.

    Example:
        >>> free_memory()
    """
    gc.collect(generation)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # cuBLAS keeps a workspace per (handle, stream) as a live allocation of the caching allocator,
        # so empty_cache alone cannot return it: release it first, then empty the cache.
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
