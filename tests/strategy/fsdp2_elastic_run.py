"""FSDP2 on CPU ranks (gloo) trained for some steps, its sharded checkpoint written, and resumed on another number
of ranks through torch.distributed.checkpoint, run as a script: Lightning's launcher starts the other ranks by
re-running it.

    PYTHONPATH=. python tests/strategy/fsdp2_elastic_run.py OUT_DIR DEVICES STOP BATCH_SIZE [CHECKPOINT]

A float64 MLP (no dropout, a per-sample-mean loss, AdamW, a OneCycle schedule over 25 steps that reads
``estimated_stepping_batches``, so the strategy builds the loader before the checkpoint is loaded) on 240 samples,
``batch_size`` BATCH_SIZE per rank (a resumed leg keeps the checkpoint's optimizer batch), ``FSDP2Strategy``,
``ExactResume``. Trains until optimizer step STOP (of 25), resuming from CHECKPOINT (a folder Lightning's
``ModelParallelStrategy`` wrote) when given, writing ``OUT_DIR/ckpt/last.ckpt`` (a folder) every 5 steps; rank 0
writes the whole parameters to ``OUT_DIR/params.pt`` and the initial ones to ``OUT_DIR/params0.pt``.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_gpuopt import ExactResume, FSDP2Strategy, GPUOptDataModule
from lightning_gpuopt.callbacks.exact_resume import StepBoundaryCheckpoint
from tests.helpers import TRAINER_QUIET, run_script

SAMPLES, DIM, STEPS = 240, 8, 25


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
            )
        self.net.double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.02, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Data(GPUOptDataModule):
    def train_dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, DIM, generator=g, dtype=torch.float64)
        return TensorDataset(x, x.sin().sum(1, keepdim=True))


class Save(pl.Callback):
    def __init__(self, out_dir: str, stop: int) -> None:
        self.out_dir, self.stop = out_dir, stop

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.stop:
            trainer.should_stop = True  # after this step's checkpoint

    def on_train_start(self, trainer, pl_module):
        self._save(trainer, pl_module, "params0.pt")

    def on_train_end(self, trainer, pl_module):
        self._save(trainer, pl_module, "params.pt")

    def _save(self, trainer, pl_module, name: str) -> None:
        full = get_model_state_dict(
            pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in full.items()}, os.path.join(self.out_dir, name))


def main() -> None:
    out_dir, devices, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    batch_size = int(sys.argv[4])
    checkpoint = sys.argv[5] if len(sys.argv) > 5 else None
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(),
        precision="32-true",  # ModelParallelStrategy refuses 64-true; the model and data are float64 anyway
        max_steps=STEPS,
        callbacks=[
            ExactResume(),
            Save(out_dir, stop),
            StepBoundaryCheckpoint(
                dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=5, save_last=True
            ),
        ],
        limit_val_batches=0,
        **{**TRAINER_QUIET, "devices": devices, "enable_checkpointing": True},
    )
    data = Data(batch_size=batch_size, num_workers=0)
    trainer.fit(Regressor(), datamodule=data, ckpt_path=checkpoint)


if __name__ == "__main__":
    run_script(main)
