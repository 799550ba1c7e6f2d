"""``training_step`` returning ``None`` on one rank under DDP, 2 CPU processes (gloo), for test_skipped_batches_ddp.py.

    PYTHONPATH=. python tests/microbatch/ddp_skip_run.py OUT_DIR

Split in two micro-batches; only rank 1's step returns ``None``, at its second batch. Each rank writes what it
raised to OUT_DIR/rank{r}.pt (``SkipRecorder``); the script exits with a failure, as the fit raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from tests.helpers import TRAINER_QUIET, RankRecorder, run_script
from tests.microbatch.stochastic_models import Points, SkipsEveryThird


class RankOneSkips(SkipsEveryThird):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, 0)
        return None if self.global_rank == 1 and batch_idx == 1 else loss


class SkipRecorder(RankRecorder):
    lingering_ranks = (0, 1)

    def result(self, trainer, pl_module, error):
        return {"step": trainer.global_step, "type": type(error).__module__ if error is not None else None}


def main(out: Path) -> None:
    oom = OOMRecovery(verbose=False)
    oom.load_state_dict({"k": 2})
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy="ddp",
        max_steps=4,
        callbacks=[oom, SkipRecorder(str(out), simulate_memory=False)],
        **{**TRAINER_QUIET, "devices": 2},
    )
    trainer.fit(RankOneSkips(), DataLoader(Points(), batch_size=8, shuffle=False))


if __name__ == "__main__":
    run_script(lambda: main(Path(sys.argv[1])))
