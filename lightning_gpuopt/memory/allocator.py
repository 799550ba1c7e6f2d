"""PyTorch's CUDA caching allocator, as arithmetic: what a request of ``n`` bytes costs on the device.

Pure functions over sizes (no CUDA needed), for :func:`~lightning_gpuopt.memory.predict_peak` with
``device="cuda"``. The rules are those of ``c10/cuda/CUDACachingAllocator.cpp``:

- every block is rounded up to 512 bytes (``kMinBlockSize``): ``torch.cuda.memory_allocated`` counts
  the rounded sizes;
- a request of at most 1 MiB (``kSmallSize``) is served from 2 MiB segments (``kSmallBuffer``); a
  larger one from a 20 MiB segment (``kLargeBuffer``) when under 10 MiB (``kMinLargeAlloc``), else from
  a segment of its own size rounded up to 2 MiB (``kRoundLarge``): ``memory_reserved`` counts segments;
- cuBLAS takes a workspace through the allocator on the first matmul of each thread and stream
  (torch's default ``CUBLAS_WORKSPACE_CONFIG``: ``:4096:8``, 32 MiB, on compute capability 9 to 12;
  ``:4096:2:16:8``, 8 MiB + 128 KiB, on others), counted in ``memory_allocated`` for the rest of the
  process; cuBLASLt shares it, or takes its own (``CUBLASLT_WORKSPACE_SIZE`` KiB, 1 MiB by default).
  Which a step takes: :mod:`lightning_gpuopt.memory.workspaces`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "MIN_BLOCK",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "cuda_block_bytes",
    "cuda_reserved_bytes",
    "cuda_segment_bytes",
]

MIN_BLOCK = 512
_SMALL_SIZE = 1 << 20
_SMALL_BUFFER = 2 << 20
_LARGE_BUFFER = 20 << 20
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes ``memory_allocated`` counts for a tensor of ``nbytes`` (0 stays 0).

    Example:
        >>> cuda_block_bytes(1), cuda_block_bytes(512), cuda_block_bytes(513)
        (512, 512, 1024)
    """
    return 0 if nbytes <= 0 else _round_up(nbytes, MIN_BLOCK)


def cuda_segment_bytes(nbytes: int) -> int:
    """Bytes the allocator reserves from CUDA for a request of ``nbytes`` that no cached segment serves.

    Example:
        >>> [cuda_segment_bytes(n) >> 20 for n in (4096, 1 << 20, 3 << 20, 11 << 20)]
        [2, 2, 20, 12]
    """
    block = cuda_block_bytes(nbytes)
    if block <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if block < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return _round_up(block, _ROUND_LARGE)


def cuda_reserved_bytes(live_blocks: Iterable[int]) -> int:
    """A lower bound of ``memory_reserved`` for blocks alive at once: small blocks packed into 2 MiB
    segments, blocks under 10 MiB into 20 MiB segments, larger ones in their own rounded segments.

    The real figure is higher when frees and reuses fragment the segments (the history matters, not
    only the live set): compare with ``max_memory_reserved`` allowing for that.

    Example:
        >>> cuda_reserved_bytes([4096] * 600) >> 20    # 600 small blocks: 2.34 MiB -> two 2 MiB segments
        4
        >>> cuda_reserved_bytes([3 << 20, 3 << 20, 64 << 20]) >> 20
        84
    """
    small = large = 0
    huge = 0
    for n in live_blocks:
        block = cuda_block_bytes(n)
        if block <= _SMALL_SIZE:
            small += block
        elif block < _MIN_LARGE_ALLOC:
            large += block
        else:
            huge += _round_up(block, _ROUND_LARGE)
    return _round_up(small, _SMALL_BUFFER) + _round_up(large, _LARGE_BUFFER) + huge


def cublas_workspace_bytes(major: int = 9, config: str | None = None) -> int:
    """The cuBLAS workspace of one stream: from ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT...``), else torch's default.

    Example:
        >>> cublas_workspace_bytes(9) >> 20, cublas_workspace_bytes(8), cublas_workspace_bytes(config=":16:8")
        (32, 8519680, 131072)
    """
    if not config:
        config = ":4096:8" if 9 <= major <= 12 else ":4096:2:16:8"  # Hopper and Blackwell: 32 MiB
    parts = [p for p in config.split(":") if p]
    total = 0
    for size, count in zip(parts[::2], parts[1::2]):
        total += int(size) * 1024 * int(count)
    return total


def cublaslt_workspace_bytes(size_kib: str | None = None) -> int:
    """cuBLASLt's own workspace of one stream, where it does not share cuBLAS's: ``CUBLASLT_WORKSPACE_SIZE``
    KiB, else 1 MiB (torch ignores a value that is not a number).

    Example:
        >>> cublaslt_workspace_bytes(), cublaslt_workspace_bytes("4096") >> 20
        (1048576, 4)
    """
    kib = int(size_kib) if size_kib is not None and size_kib.strip().isdigit() else 1024
    return kib * 1024
