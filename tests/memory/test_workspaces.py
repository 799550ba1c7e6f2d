"""cuBLAS's workspaces in a CUDA prediction: one per thread that runs matmuls, counted until this process holds it.

On an H200 (torch 2.11) a first MLP step in a process peaked 33 MiB above a prediction that counted one
workspace, taken before: autograd's thread took its own 32 MiB cuBLAS workspace at the first backward, and
cuBLASLt its 1 MiB. The device is faked here (capability, stream, allocator snapshot): the rule runs on CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_gpuopt.memory import predict_peak
from lightning_gpuopt.memory.workspaces import lt_shares_cublas, step_workspaces, workspaces_for

MiB = 1 << 20
WORKSPACE = 32 * MiB


class FakeCuda:
    """torch.cuda as predict_peak reads it for a GPU of compute capability ``major``.0 holding ``blocks``."""

    def __init__(self, monkeypatch, major: int, blocks: list[tuple[int, int]], stream: int = 7) -> None:
        for name in (
            "CUBLAS_WORKSPACE_CONFIG",
            "CUBLASLT_WORKSPACE_SIZE",
            "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
        ):
            monkeypatch.delenv(name, raising=False)
        segment = {
            "device": 0,
            "stream": stream,
            "blocks": [
                {"address": address, "requested_size": size, "state": "active_allocated"}
                for address, size in blocks
            ],
        }
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 7})()
        )
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: [segment])
        monkeypatch.setattr(torch.backends.cuda, "cublas_workspace_size", None, raising=False)


def lt_bytes() -> int:
    return 0 if lt_shares_cublas(torch.__version__, None) else MiB


@pytest.mark.parametrize(
    ("held", "forward", "backward"),
    [(0, WORKSPACE + MiB, WORKSPACE), (1, 0, WORKSPACE), (2, 0, 0)],
    ids=["fresh-process", "after-an-evaluation", "after-a-step"],
)
def test_each_thread_takes_one_workspace_until_the_process_holds_it(held, forward, backward):
    assert step_workspaces(WORKSPACE, MiB, held) == (forward, backward)


def test_cublaslt_shares_the_cublas_workspace_from_its_release_or_by_the_environment():
    assert not lt_shares_cublas("2.11.0+cu130", None)
    assert lt_shares_cublas("2.12.0", None) and lt_shares_cublas("2.11.0", "1")
    assert not lt_shares_cublas("2.14.1", "0")
    assert lt_shares_cublas("2.14.1", "yes")  # c10 ignores values other than 0 and 1


@pytest.mark.parametrize(
    ("major", "held", "cublas"),
    [(9, 0, WORKSPACE), (8, 0, 8 * MiB + 128 * 1024), (9, 1, WORKSPACE), (9, 2, WORKSPACE)],
    ids=["hopper-fresh", "ampere-fresh", "hopper-one-held", "hopper-both-held"],
)
def test_the_workspaces_a_step_takes_on_a_faked_device(monkeypatch, major, held, cublas):
    """Ampere's default is torch's :4096:2:16:8; each workspace held on the stream is one a thread does not take."""
    FakeCuda(monkeypatch, major, [(0x1000 * (i + 1), cublas) for i in range(held)])
    forward, backward = workspaces_for(torch.device("cuda", 0))
    assert forward == (0 if held else cublas + lt_bytes())
    assert backward == (0 if held == 2 else cublas)


def test_a_model_tensor_of_the_workspaces_size_is_not_taken_for_a_workspace(monkeypatch):
    """A 4096 x 2048 float32 weight is 32 MiB: the block holding it is the model's, not a workspace."""
    weight = SimpleNamespace(
        device=torch.device("cuda", 0), untyped_storage=lambda: SimpleNamespace(data_ptr=lambda: 0x5000)
    )
    FakeCuda(monkeypatch, 9, [(0x5000, WORKSPACE)])
    assert workspaces_for(torch.device("cuda", 0), [weight]).forward == WORKSPACE + lt_bytes()
    assert workspaces_for(torch.device("cuda", 0), []).forward == 0  # unknown to it: taken for a workspace


def test_a_prediction_for_a_fresh_process_counts_the_backward_workspace_from_the_first_backward(monkeypatch):
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    if torch.cuda.is_available():
        pytest.skip("this process may hold workspaces already; the faked-device tests cover the rule")
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    p = predict_peak(
        net, torch.zeros(8, 64), lambda ps: torch.optim.AdamW(ps), step=lambda m, x: m(x).sum(), device="cuda"
    )
    by_phase = {(ph.phase, ph.step): ph.categories["kernel workspaces"] for ph in p.phases}
    assert by_phase[("forward", 1)] == WORKSPACE + lt_bytes()  # the calling thread's, at the first matmul
    assert by_phase[("backward", 1)] == by_phase[("forward", 2)] == 2 * WORKSPACE + lt_bytes()
