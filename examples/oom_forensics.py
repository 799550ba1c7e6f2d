"""Why did it run out of memory? A small causal transformer hits a memory limit, and the OOM record says why.

Runs on a CPU in seconds: SimulatedMemory stands in for a GPU's memory, and its limit drops after three steps,
so the fourth step runs out of memory in its forward. OOMRecovery splits the batch; GPUOptReport keeps the OOM's
record (what the memory held by category, the modules owning the activations, what the pack did) and draws
``oom_3_rank0.png`` beside ``gpuopt_report.png``::

    python examples/oom_forensics.py OUT_DIR
    gpuopt report OUT_DIR --oom 0        # the record again, from the JSON
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import GPUOptReport, OOMRecovery
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.report import format_oom
from lightning_gpuopt.testing import SimulatedMemory

VOCAB, SEQ, WIDTH = 512, 64, 128


class TinyLM(pl.LightningModule):
    """Two pre-norm transformer layers with a causal mask and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def training_step(self, batch, batch_idx):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        mask = nn.Transformer.generate_square_subsequent_mask(inputs.shape[1])
        logits = self.head(self.blocks(self.embed(inputs), mask=mask, is_causal=True))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class Tokens(Dataset):
    def __len__(self) -> int:
        return 32 * 5

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))


class LimitFrom(pl.Callback):
    """From step ``step`` on, the device's memory is 80 % of the largest step peak seen before."""

    def __init__(self, step: int = 3) -> None:
        self.step, self.peak = step, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        probe = get_probe()
        if trainer.global_step == self.step:
            probe.limit_bytes = int(0.8 * self.peak)
        probe.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peak = max(self.peak, get_probe().peak)


def main(out: str) -> dict:
    report = GPUOptReport(dirpath=out)
    trainer = pl.Trainer(
        max_steps=5,
        callbacks=[LimitFrom(), OOMRecovery(), report],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    with SimulatedMemory():
        trainer.fit(TinyLM(), DataLoader(Tokens(), batch_size=32))
    for i, record in enumerate(report.report["ooms"]):
        print(format_oom(record, i))
    return report.report


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "oom_forensics")
