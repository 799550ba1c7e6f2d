"""loss_reduction="auto" under DDP: two CPU processes over gloo hold rank 0's decision.

Rank 0's samples have random lengths (only token shares reproduce the token-mean loss); rank 1's are all
full length, so on its own data sample shares would do as well. Both ranks must use rank 0's decision.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from tests.microbatch.loss_weighting_models import TokenMeanLM, TokenText


class SaveDecision(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        oom = next(c for c in trainer.callbacks if isinstance(c, OOMRecovery))
        decided = oom.loss_weighting.decided
        result = {
            "kind": decided.kind.value,
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
        }
        torch.save(result, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_ranks_hold_rank_zeros_decision(tmp_path):
    oom = OOMRecovery()
    oom.load_state_dict({"k": 2})
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=DDPStrategy(start_method="spawn"),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        callbacks=[oom, SaveDecision(str(tmp_path))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # The DistributedSampler gives rank 0 the even samples and rank 1 the odd ones (all full length).
    trainer.fit(TokenMeanLM(), DataLoader(TokenText(n=32, equal_odd=True), batch_size=8, shuffle=False))
    zero, one = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert zero["kind"] == one["kind"] == "tokens"
    for name in zero["params"]:
        assert torch.equal(zero["params"][name], one["params"][name]), name
