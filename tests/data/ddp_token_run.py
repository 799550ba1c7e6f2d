"""Batches by tokens under DDP, 2 CPU processes (gloo), for test_token_datamodule.py.

    PYTHONPATH=. python tests/data/ddp_token_run.py OUT_DIR

Two epochs of ``GPUOptDataModule(max_tokens=96)`` over 60 samples of 3 to 31 tokens; each rank writes the ids and
shapes of its batches, per epoch, to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from tests.data.test_token_datamodule import Embeds, Text
from tests.helpers import TRAINER_QUIET, run_script


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = Embeds()
    trainer = pl.Trainer(strategy="ddp", max_epochs=2, **{**TRAINER_QUIET, "devices": 2})
    trainer.fit(model, Text(max_tokens=96))
    torch.save(
        {"seen": dict(model.seen), "shapes": model.shapes, "batches": trainer.num_training_batches},
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    run_script(lambda: main(Path(sys.argv[1])))
