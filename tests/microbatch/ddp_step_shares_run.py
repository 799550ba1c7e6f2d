"""Two DDP ranks (CPU, gloo) whose batches hold different token counts, for test_step_shares.py.

    PYTHONPATH=. python tests/microbatch/ddp_step_shares_run.py OUT_DIR ACCUMULATE

Each rank trains a token-mean HandWrittenLM in 64-true with ``OOMRecovery()`` (defaults) on its own half of the
data, and writes the weighting it used, the batches it trained on and its parameters to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Subset

from lightning_gpuopt import OOMRecovery
from tests.helpers import TRAINER_QUIET, RankRecorder, run_script
from tests.microbatch.test_loss_weighting_memory import HandWrittenLM, PaddedTokens
from tests.microbatch.test_step_shares import BATCH

STEPS = 3


class OwnHalf(pl.LightningDataModule):
    def __init__(self, accumulate: int) -> None:
        super().__init__()
        self.per_rank = STEPS * accumulate * BATCH

    def train_dataloader(self):
        rank = self.trainer.global_rank
        data = PaddedTokens(n=2 * self.per_rank)
        mine = Subset(data, range(rank * self.per_rank, (rank + 1) * self.per_rank))
        return DataLoader(mine, batch_size=BATCH, shuffle=False)


class SharesRecorder(RankRecorder):
    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, simulate_memory=False)
        self.batches: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append({k: v.clone() for k, v in batch.items()})

    def result(self, trainer, pl_module, error):
        oom = next(c for c in trainer.callbacks if isinstance(c, OOMRecovery))
        decided = oom.loss_weighting.decided
        return {
            "weighting": decided.kind.value if decided is not None else None,
            "batches": self.batches,
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "steps": trainer.global_step,
        }


def main(out: Path, accumulate: int) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy="ddp",
        max_steps=STEPS,
        precision="64-true",
        accumulate_grad_batches=accumulate,
        use_distributed_sampler=False,
        callbacks=[OOMRecovery(verbose=False), SharesRecorder(str(out))],
        **{**TRAINER_QUIET, "devices": 2},
    )
    trainer.fit(HandWrittenLM("token-mean"), OwnHalf(accumulate))


if __name__ == "__main__":
    run_script(lambda: main(Path(sys.argv[1]), int(sys.argv[2])))
