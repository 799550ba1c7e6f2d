"""One 2-process FSDP2 fit with CPU offload on CPU (gloo), run as a script: Lightning's launcher re-runs it for rank 1.

    PYTHONPATH=. python tests/strategy/fsdp2_offload_run.py OUT_DIR

Two AdamW steps of :func:`offload_model` under ``FSDP2Strategy(cpu_offload=True)``. Every rank writes
``OUT_DIR/rank{r}.pt``: the bytes it holds offloaded (its shards of the parameters, their gradients and
the optimizer state, each storage once) and the device of every sharded parameter.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import FSDP2Strategy
from tests.helpers import run_script
from tests.strategy.strategy_models import Block

WIDTH, DEPTH, BATCH = 48, 3, 16


class OffloadModel(pl.LightningModule):
    """Three residual blocks (the units) and a head; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(DEPTH)))
        self.head = nn.Linear(WIDTH, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def sample_batch(n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 1, generator=g)


class HostBytes(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        seen: set[int] = set()

        def once(t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()

        local = [p.to_local() for p in pl_module.parameters()]
        params = sum(once(t) for t in local)
        grads = sum(once(p.grad.to_local()) for p in pl_module.parameters() if p.grad is not None)
        optimizer = trainer.optimizers[0]
        state = sum(
            once(v.to_local() if hasattr(v, "to_local") else v)
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        torch.save(
            {
                "parameters": params,
                "gradients": grads,
                "optimizer": state,
                "devices": sorted({str(t.device) for t in local}),
                "steps": trainer.global_step,
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def main() -> None:
    out_dir = sys.argv[1]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(shard_modules=[Block], cpu_offload=True),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        callbacks=[HostBytes(out_dir)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    x, y = sample_batch(4 * BATCH)
    trainer.fit(OffloadModel(), DataLoader(TensorDataset(x, y), batch_size=BATCH))


if __name__ == "__main__":
    run_script(main)
