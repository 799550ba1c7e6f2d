"""One DDP fit on 2 CPU processes (gloo) for test_precision_switch.py: fp16 overflows on rank 1 only.

    PYTHONPATH=. python tests/callbacks/ddp_precision_run.py OUT_DIR ACCUMULATE

Lightning starts rank 1 by running this script again; each rank writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from lightning_gpuopt import PrecisionSwitch
from tests.callbacks.oom_models import Waves
from tests.callbacks.precision_models import AppliedSteps, Troubled, finite
from tests.helpers import TRAINER_QUIET


def main(out: Path, accumulate: int) -> None:
    pl.seed_everything(0, verbose=False)
    model = Troubled(overflow=(5, None) if accumulate == 1 else (3, None), rank=1)
    switch, hook = PrecisionSwitch(initial="keep", verbose=False), AppliedSteps()
    quiet = {k: v for k, v in TRAINER_QUIET.items() if k != "devices"}
    trainer = pl.Trainer(
        max_steps=8,
        devices=2,
        strategy="ddp",
        accumulate_grad_batches=accumulate,
        precision=None,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        callbacks=[switch, hook],
        **quiet,
    )
    trainer.fit(model, DataLoader(Waves(length=1024), batch_size=16))
    result = {
        "state": switch.state_dict(),
        "precision": trainer.precision,
        "applied": hook.steps(),
        "nonfinite_applied": hook.nonfinite_applied,
        "finite": finite(model),
        "params": [p.detach().double().sum().item() for p in model.parameters()],
        "troubled_calls": [
            c[:2] for c in model.calls if model.overflow[0] <= c[0] and model.rank == trainer.global_rank
        ],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    # Leave gloo cleanly: its threads can abort the interpreter's exit ("terminate called without an active
    # exception") when the process group is still alive.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
