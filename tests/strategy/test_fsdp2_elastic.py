"""FSDP2 resumed on another number of ranks (issue 37): the sharded checkpoint Lightning's ModelParallelStrategy
writes through torch.distributed.checkpoint is resharded over the new ranks, the datamodule keeps the optimizer
batch, and the run trains like the uninterrupted one (tests/strategy/fsdp2_elastic_run.py: float64, AdamW and a
OneCycle schedule, 240 samples, optimizer batch 24)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same_training, run_ranks

SCRIPT = Path(__file__).with_name("fsdp2_elastic_run.py")


def _run(out: Path, devices: int, steps: int, batch_size: int, checkpoint: Path | None = None) -> dict:
    args = [devices, steps, batch_size] + ([checkpoint] if checkpoint is not None else [])
    return run_ranks(SCRIPT, out, *args, ranks=1, result="params.pt")[0]


@pytest.mark.slow
def test_a_sharded_checkpoint_resumed_on_1_rank_then_on_2_trains_like_the_uninterrupted_run(tmp_path):
    """The uninterrupted run: 2 ranks x 12 for 25 steps. The other: 2 ranks to step 5, resumed on 1 rank (batch 24)
    for 10 more steps, resumed on 2 ranks (batch 12) for 10 more; both reshardings through DCP."""
    reference = _run(tmp_path / "straight", 2, 25, 12)
    theta0 = torch.load(tmp_path / "straight" / "params0.pt")
    _run(tmp_path / "first", 2, 5, 12)
    _run(tmp_path / "second", 1, 15, 12, tmp_path / "first" / "ckpt" / "last.ckpt")
    resumed = _run(tmp_path / "third", 2, 25, 12, tmp_path / "second" / "ckpt" / "last.ckpt")
    assert_same_training(theta0, resumed, reference, floor=1e-9, elementwise=True)
