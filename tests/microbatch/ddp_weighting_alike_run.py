"""Rank 0's batches start with equal lengths, rank 1's are padded, under DDP on 2 CPU processes (gloo), for
test_loss_weighting_alike.py.

    PYTHONPATH=. python tests/microbatch/ddp_weighting_alike_run.py OUT_DIR

Each rank trains a token-mean HandWrittenLM at k = 2 on its own data and writes its weighting decisions and
parameters to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.decisions import decisions
from tests.helpers import TRAINER_QUIET, RankRecorder, run_script
from tests.microbatch.test_loss_weighting_alike import BATCH, STEPS, FullThenPadded
from tests.microbatch.test_loss_weighting_memory import HandWrittenLM


class OwnData(pl.LightningDataModule):
    """Each rank its own data: rank 0 full-length sequences first, rank 1 padded ones from the start."""

    def train_dataloader(self):
        rank = self.trainer.global_rank
        return DataLoader(FullThenPadded(full=1 - rank, offset=rank), batch_size=BATCH, shuffle=False)


class WeightingRecorder(RankRecorder):
    lingering_ranks = (0, 1)

    def result(self, trainer, pl_module, error):
        weighting = [{"step": d.step, **d.data} for d in decisions(trainer) if d.kind == "loss weighting"]
        return {
            "weighting": weighting,
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "steps": trainer.global_step,
        }


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    oom = OOMRecovery(verbose=False)
    oom.load_state_dict({"k": 2})
    trainer = pl.Trainer(
        strategy="ddp",
        max_steps=STEPS,
        precision="64-true",
        use_distributed_sampler=False,
        callbacks=[oom, WeightingRecorder(str(out), simulate_memory=False)],
        **{**TRAINER_QUIET, "devices": 2},
    )
    trainer.fit(HandWrittenLM("token-mean"), OwnData())


if __name__ == "__main__":
    run_script(lambda: main(Path(sys.argv[1])))
