"""DDP fits on 2 CPU processes (gloo) for the goodput tests.

    PYTHONPATH=. python tests/callbacks/ddp_goodput_run.py OUT_DIR noise

Lightning starts rank 1 by running this script again; each rank writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_gpuopt import GradientNoiseScale
from tests.callbacks.goodput_models import Quadratic, quadratic_loader
from tests.helpers import TRAINER_QUIET


def main(out: Path, what: str) -> None:
    quiet = {k: v for k, v in TRAINER_QUIET.items() if k != "devices"}
    estimates = []
    rank = 0
    for b_simple in (16, 128):
        noise = GradientNoiseScale()
        trainer = pl.Trainer(
            max_steps=300, devices=2, strategy="ddp", precision="64-true", callbacks=[noise], **quiet
        )
        # 32 a rank: 64 a step, as on one device; each rank reads its own half of every batch of 64.
        trainer.fit(Quadratic(), quadratic_loader(b_simple, batch_size=32, steps=600))
        estimates.append([b_simple, noise.estimate])
        rank = trainer.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps({"estimates": estimates}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
