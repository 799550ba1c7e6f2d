"""The CUDA caching allocator's arithmetic (pure functions: no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.memory import predict_peak
from lightning_gpuopt.memory.allocator import (
    cublas_workspace_bytes,
    cuda_block_bytes,
    cuda_reserved_bytes,
    cuda_segment_bytes,
)
from lightning_gpuopt.memory.workspaces import lt_shares_cublas, workspaces_for

MiB = 1 << 20


@pytest.mark.parametrize(
    ("n", "block"), [(0, 0), (1, 512), (512, 512), (513, 1024), (4 * MiB + 1, 4 * MiB + 512)]
)
def test_blocks_are_rounded_to_512_bytes(n, block):
    assert cuda_block_bytes(n) == block


@pytest.mark.parametrize(
    ("n", "segment"),
    [
        (100, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 1, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (21 * MiB, 22 * MiB),
    ],
)
def test_segments_follow_the_small_large_and_rounded_rules(n, segment):
    assert cuda_segment_bytes(n) == segment


def test_reserved_packs_blocks_into_their_segments():
    assert cuda_reserved_bytes([]) == 0
    assert cuda_reserved_bytes([1 * MiB, 1 * MiB]) == 2 * MiB
    assert cuda_reserved_bytes([1 * MiB, 1 * MiB, 512]) == 4 * MiB
    assert cuda_reserved_bytes([5 * MiB] * 5) == 40 * MiB
    assert cuda_reserved_bytes([30 * MiB + 1]) == 32 * MiB


def test_cublas_workspace_follows_the_config_and_the_architecture():
    assert cublas_workspace_bytes(9) == 32 * MiB
    assert cublas_workspace_bytes(8) == 2 * 4096 * 1024 + 8 * 16 * 1024
    assert cublas_workspace_bytes(8, ":4096:8") == 32 * MiB


def test_a_cuda_prediction_counts_blocks_and_the_workspace(monkeypatch):
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    net = torch.nn.Linear(3, 5)  # 15 + 5 floats: blocks of 512 bytes each
    p = predict_peak(
        net,
        torch.zeros(2, 3),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        step=lambda m, x: m(x).sum(),
        device="cuda",
    )
    assert p.categories["parameters"] == 2 * 512
    # A process that holds no cuBLAS workspace: the forward's thread and autograd's thread each take one.
    lt = 0 if lt_shares_cublas(torch.__version__, None) else MiB
    expected = sum(workspaces_for(torch.device("cuda"))) if torch.cuda.is_available() else 2 * 32 * MiB + lt
    assert p.categories["kernel workspaces"] == expected
    cpu = predict_peak(
        net, torch.zeros(2, 3), lambda ps: torch.optim.SGD(ps, lr=0.1), step=lambda m, x: m(x).sum()
    )
    assert cpu.categories["parameters"] == 4 * 20 and cpu.categories["kernel workspaces"] == 0
