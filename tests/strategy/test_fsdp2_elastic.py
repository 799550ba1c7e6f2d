"""FSDP2 resumed on another number of ranks (issue 37): the sharded checkpoint Lightning's ModelParallelStrategy
writes through torch.distributed.checkpoint is resharded over the new ranks, the datamodule keeps the optimizer
batch, and the run trains like the uninterrupted one (tests/strategy/fsdp2_elastic_run.py: float64, AdamW, 240
samples, optimizer batch 24, 5 steps then 10 more)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same_training, run_ranks

SCRIPT = Path(__file__).with_name("fsdp2_elastic_run.py")


def _run(out: Path, devices: int, steps: int, batch_size: int, checkpoint: Path | None = None) -> dict:
    args = [devices, steps, batch_size] + ([checkpoint] if checkpoint is not None else [])
    return run_ranks(SCRIPT, out, *args, ranks=1, result="params.pt")[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict, dict]:
    """The uninterrupted run: 2 ranks x 12 for 15 steps; its initial and final parameters."""
    out = tmp_path_factory.mktemp("straight")
    final = _run(out, 2, 15, 12)
    return torch.load(out / "params0.pt"), final


@pytest.mark.parametrize(
    ("before", "after", "batch_size"),
    [(2, 1, 12), pytest.param(1, 2, 24, marks=pytest.mark.slow)],
    ids=["2-ranks-then-1", "1-rank-then-2"],
)
def test_a_sharded_checkpoint_resumed_on_another_number_of_ranks_trains_like_the_uninterrupted_run(
    tmp_path, straight, before, after, batch_size
):
    theta0, reference = straight
    _run(tmp_path / "first", before, 5, batch_size)
    resumed = _run(tmp_path / "second", after, 15, batch_size, tmp_path / "first" / "ckpt" / "last.ckpt")
    assert_same_training(theta0, resumed, reference, floor=1e-9, elementwise=True)
