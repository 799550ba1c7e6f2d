"""Model-state estimates against what SimulatedMemory counts: one process, and FSDP2 over 2 CPU processes (gloo)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_gpuopt.memory.estimate import CANDIDATES, count_parameters, estimate
from lightning_gpuopt.strategy import shard_module, shard_units
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import free_port
from tests.strategy.strategy_models import Block

TOLERANCE = 0.10
WIDTHS = (64, 256, 512)  # 0.13 M, 2.1 M and 8.4 M parameters
OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("32-true", "bf16-true")
CONFIGS = [(w, o, p) for w in WIDTHS for o in OPTIMIZERS for p in PRECISIONS]


def _model(width: int, precision: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(width) for _ in range(4)), nn.Linear(width, 1))
    return model.to(torch.bfloat16) if precision == "bf16-true" else model


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _state_after_a_step(width: int, optimizer: str, precision: str, shard=None) -> int:
    """Bytes allocated after one training step, the batch gone: parameters, gradients, optimizer state."""
    with SimulatedMemory() as mem:
        model = _model(width, precision)
        if shard is not None:
            shard(model)
        opt = _optimizer(optimizer, model)
        x = torch.randn(8, width, dtype=next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        del x
        return mem.allocated_bytes


def _estimated(width: int, optimizer: str, precision: str, candidate: str, world: int) -> int:
    model = _model(width, precision)
    counts = count_parameters(model, shard_units(model))
    chosen = next(c for c in CANDIDATES if c.name == candidate)
    e = estimate(counts, chosen, world, precision, _optimizer(optimizer, model))  # SGD with momentum: 1 state
    return e.model_state - e.gathered  # the gathered unit is freed after its use: not held between steps


@pytest.mark.parametrize(("width", "optimizer", "precision"), CONFIGS)
def test_single_device_estimate_matches_the_measured_state(width, optimizer, precision):
    measured = _state_after_a_step(width, optimizer, precision)
    expected = _estimated(width, optimizer, precision, "single device", 1)
    assert abs(measured - expected) <= TOLERANCE * measured, (measured, expected)


def _fsdp2_rank(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = {
            config: _state_after_a_step(*config, shard=lambda m: shard_module(m, mesh)) for config in CONFIGS
        }
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_per_rank_estimate_matches_the_measured_state(tmp_path):
    mp.start_processes(_fsdp2_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for config in CONFIGS:
        expected = _estimated(*config, "fsdp: full shard", 2)
        single = _estimated(*config, "single device", 1)
        for rank in ranks:
            measured = rank[config]
            assert abs(measured - expected) <= TOLERANCE * measured, (config, measured, expected)
            assert measured < 0.6 * single  # sharding really halved the state
