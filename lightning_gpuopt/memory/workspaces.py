"""cuBLAS's workspaces on CUDA: how large they are, which a training step takes, which this process holds already.

torch gives each thread its own cuBLAS handle and each (handle, stream) pair its own workspace, taken
through the caching allocator on the first matmul and kept for the life of the process
(``aten/src/ATen/cuda/CublasHandlePool.cpp``; ``memory_allocated`` counts it). A training step runs its
matmuls on two threads: the calling thread (the forward, the optimizer step) and autograd's worker
thread of the device (the backward), so a first step in a process takes two workspaces, the second
at its first backward. cuBLASLt (``addmm`` with a bias: ``nn.Linear``) uses the cuBLAS workspace where
torch unifies the two (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, the default in newer releases), else a
workspace of its own (``CUBLASLT_WORKSPACE_SIZE`` KiB, 1 MiB by default).

torch does not say which workspaces exist: the held ones are read from the allocator's snapshot
(``torch.cuda.memory_snapshot``): live blocks on the current stream of exactly the workspace's size
that hold none of the model's tensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

import torch

from lightning_gpuopt.memory.allocator import cublas_workspace_bytes, cublaslt_workspace_bytes

__all__ = ["StepWorkspaces", "held_workspaces", "lt_shares_cublas", "step_workspaces", "workspaces_for"]

#: The first torch release whose cuBLASLt shares the cuBLAS workspace unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0.
UNIFIED_BY_DEFAULT_SINCE = (2, 12)
#: Threads that run a training step's matmuls: the calling thread and autograd's worker thread of the device.
STEP_THREADS = 2


class StepWorkspaces(NamedTuple):
    """The workspace bytes a training step takes: ``forward`` from its first forward on (the calling
    thread's), ``backward`` from its first backward on (autograd's thread's)."""

    forward: int
    backward: int


def lt_shares_cublas(torch_version: str, unified_env: str | None) -> bool:
    """Whether cuBLASLt uses the cuBLAS workspace: ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (``"1"``/``"0"``;
    c10 ignores other values), else the release's default.

    Example:
        >>> lt_shares_cublas("2.11.0+cu130", None), lt_shares_cublas("2.14.1", None), lt_shares_cublas("2.14.1", "0")
        (False, True, False)
    """
    if unified_env in ("0", "1"):
        return unified_env == "1"
    parts = [int(p) for p in torch_version.split("+")[0].split(".")[:2] if p.isdigit()]
    return tuple(parts) >= UNIFIED_BY_DEFAULT_SINCE


def step_workspaces(cublas_bytes: int, lt_bytes: int = 0, held: int = 0) -> StepWorkspaces:
    """The workspaces a training step takes when ``held`` of its threads' cuBLAS workspaces exist already.

    One cuBLAS workspace per thread (the calling thread's first: a forward or an evaluation ran before),
    and cuBLASLt's own (``lt_bytes``; 0 where it shares cuBLAS's) with the calling thread's.

    Example:
        >>> MiB = 2**20
        >>> [tuple(b // MiB for b in step_workspaces(32 * MiB, 1 * MiB, held)) for held in (0, 1, 2)]
        [(33, 32), (0, 32), (0, 0)]
    """
    forward = 0 if held >= 1 else cublas_bytes + lt_bytes
    backward = 0 if held >= STEP_THREADS else cublas_bytes
    return StepWorkspaces(forward, backward)


def held_workspaces(device: torch.device, nbytes: int, tensors: Iterable[torch.Tensor] = ()) -> int:
    """Live allocator blocks on ``device``'s current stream of exactly ``nbytes`` requested, not holding any of
    ``tensors`` (the model's own): the cuBLAS workspaces this process holds there (CUDA only)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    owned = {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cuda"}
    found = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != index or segment.get("stream") != stream:
            continue
        for block in segment.get("blocks", ()):
            if (
                block.get("state") == "active_allocated"
                and block.get("requested_size") == nbytes
                and block.get("address") not in owned
            ):
                found += 1
    return found


def workspaces_for(device: torch.device, tensors: Iterable[torch.Tensor] = ()) -> StepWorkspaces:
    """The cuBLAS and cuBLASLt workspaces a training step on ``device`` takes in this process.

    Sizes: torch's own (``torch.backends.cuda.cublas_workspace_size``, newer releases), else its rule over
    the device's compute capability and ``CUBLAS_WORKSPACE_CONFIG``. Held: read on ``device`` when this
    process has it (:func:`held_workspaces`); else none (a device seen from elsewhere, or none here).
    """
    visible = torch.cuda.is_available()
    major = torch.cuda.get_device_capability(device)[0] if visible else 9
    cublas = cublas_workspace_bytes(major, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    shared = lt_shares_cublas(torch.__version__, os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"))
    lt = 0 if shared else cublaslt_workspace_bytes(os.environ.get("CUBLASLT_WORKSPACE_SIZE"))
    sizes = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    if visible and callable(sizes):  # torch's own figures, overrides included
        cublas = int(sizes())
        lt_size = getattr(torch.backends.cuda, "cublaslt_workspace_size", None)
        lt = 0 if shared or not callable(lt_size) else int(lt_size())
    held = held_workspaces(device, cublas, tensors) if visible else 0
    return step_workspaces(cublas, lt, held)
