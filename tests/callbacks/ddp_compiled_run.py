"""A compiled LightningModule under DDP on 2 CPU processes (gloo), for test_oom_recovery_ddp.py.

    PYTHONPATH=. python tests/callbacks/ddp_compiled_run.py OUT_DIR

``trainer.fit(torch.compile(model))`` with ``strategy="ddp"``, as a script runs it: Lightning starts rank 1
by running this script again (a compiled LightningModule cannot be pickled for spawned ranks, and forked
ones cannot run autograd once the parent has). Rank 1 runs out of memory in its forward after two steps
(``RankMemory``); each rank writes OUT_DIR/rank{r}.pt and OUT_DIR/rank{r}_compile.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.decisions import decisions
from tests.callbacks.oom_models import Waves, WideRegressor
from tests.callbacks.test_oom_recovery_ddp import RankMemory


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = torch.compile(WideRegressor("adam"), backend="aot_eager")
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=8,
        precision="64-true",
        callbacks=[RankMemory(str(out), "forward"), OOMRecovery()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(Waves(length=128 * 2 * 8), batch_size=128, shuffle=False))
    compiled = {  # that compile ran, and what the split made it do
        "frames": int(counters["frames"]["ok"]),
        "recompilations": [d.message for d in decisions(trainer) if d.kind == "recompilation"],
    }
    (out / f"rank{trainer.global_rank}_compile.json").write_text(json.dumps(compiled))
    # Leave gloo cleanly: its threads can abort the interpreter's exit when the process group is still alive.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
