"""MemoryAwareBatchSize on 2 FSDP2 ranks on CPU (gloo), run as a script: Lightning's launcher starts rank 1 by re-running it.

    PYTHONPATH=. python tests/callbacks/fsdp2_batch_size_run.py OUT_DIR

An unchanged transformer LightningModule (no ``configure_model``): FSDP2Strategy shards its three encoder
layers as units by itself (and the embedding and the head, each a unit of its own). Batches of 64
sequences per rank. Three fits in one launch, every rank under its own SimulatedMemory:

1. ``truth`` (no limit): real training steps whose micro-batches hold exactly ``size`` samples; each
   step's peak is measured on every rank and gathered, so that both ranks choose the same next size.
   Steps at 8 and 56 samples place the limits: rank 0 at 80 % of the way between their peaks, rank 1 at
   35 % (the smaller one). Then, for each rank's limit, bisection over [1, 64] by real steps: the true
   maximum is the largest micro-batch whose real step peaks within that rank's limit.
2. ``search``: each rank under its limit, MemoryAwareBatchSize(target_fraction=1.0) searches at the
   first batch, then training goes on for the remaining steps (no OOMRecovery: an OOM would end the fit).
3. ``twin``: the same fit with a MemoryAwareBatchSize restored from the search's state (it applies the
   answer without searching): its parameters show whether the trial steps left a trace.
4. ``max``: ``mode="max"`` under the same limits, from a GPUOptDataModule at batch_size 8: the batch size
   both ranks then train at.

Every rank writes ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import FSDP2Strategy, GPUOptDataModule, MemoryAwareBatchSize
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.batch_models import ChunkProbe, Tensors
from tests.helpers import run_script

BATCH, STEPS = 64, 4
#: The two sizes that place the limits, and where between their peaks each rank's limit lies.
LOW, HIGH, FRACTIONS = 8, 56, (0.8, 0.35)


class Embed(nn.Module):
    def __init__(self, vocab: int, d_model: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)

    def forward(self, tokens):
        return self.tokens(tokens) + self.pos


class TinyLM(pl.LightningModule):
    """Token prediction over 16 tokens: embedding, 3 encoder layers (d_model 32, dropout 0.1), a head; Adam."""

    def __init__(self, vocab: int = 128, d_model: int = 32, seq: int = 16) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = Embed(vocab, d_model, seq)
            layer = nn.TransformerEncoderLayer(
                d_model, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)
        self.chunk: int | None = None  # ChunkProbe's micro-batch size

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.head(self.encoder(self.embed(tokens))).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def dataset(n: int = 2 * BATCH * 40, seq: int = 16, vocab: int = 128) -> Tensors:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    return Tensors(tokens, torch.roll(tokens, 1, dims=1))


def data() -> DataLoader:
    return DataLoader(dataset(), batch_size=BATCH, shuffle=False)


class Data(GPUOptDataModule):
    """The same data through the pack's DataModule, whose ``batch_size`` mode='max' sets."""

    def __init__(self) -> None:
        super().__init__(batch_size=8, num_workers=0, drop_last=True)

    def train_dataset(self) -> Tensors:
        return dataset()


class RankPeaks(ChunkProbe):
    """ChunkProbe on every rank: each step's peak is gathered from every rank (``peaks[size][rank]``)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > 1:  # the first step creates the optimizer state
            gathered = trainer.strategy.all_gather(torch.tensor(get_probe().peak)).tolist()
            old = self.peaks.get(self.size, [0] * len(gathered))
            self.peaks[self.size] = [max(a, b) for a, b in zip(old, gathered)]


class Truth:
    """Chooses the sizes of the ``truth`` fit: LOW and HIGH, then each rank's bisection under its limit."""

    def __init__(self) -> None:
        self.limits: list[int] | None = None
        self.bounds = [
            [0, BATCH + 1],
            [0, BATCH + 1],
        ]  # per rank: [largest that fits, smallest that does not]

    def __call__(self, peaks: dict[int, list[int]]) -> int | None:
        for size in (LOW, HIGH):
            if size not in peaks:
                return size
        self.limits = [
            int(peaks[LOW][r] + f * (peaks[HIGH][r] - peaks[LOW][r])) for r, f in enumerate(FRACTIONS)
        ]
        for size, by_rank in peaks.items():
            for rank, bound in enumerate(self.bounds):
                if by_rank[rank] <= self.limits[rank]:
                    bound[0] = max(bound[0], size)
                else:
                    bound[1] = min(bound[1], size)
        gaps = [(hi - lo, (lo + hi) // 2) for lo, hi in self.bounds if hi - lo > 1]
        return max(gaps)[1] if gaps else None


class RankLimit(pl.Callback):
    """Rank r trains under SimulatedMemory(limits[r]) (``None``: no limit); counts the OOMs after the search."""

    def __init__(self, limits: list[int | None]) -> None:
        self.limits = limits
        self.memory: SimulatedMemory | None = None
        self.ooms_in_search = self.ooms = -1

    def setup(self, trainer, pl_module, stage):
        self.memory = SimulatedMemory(limit_bytes=self.limits[trainer.global_rank])
        self.memory.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:  # after MemoryAwareBatchSize's search (it comes first in the callbacks)
            self.ooms_in_search = self.memory.num_ooms

    def teardown(self, trainer, pl_module, stage):
        self.ooms = self.memory.num_ooms
        self.memory.__exit__(None, None, None)


def trainer_for(callbacks: list, max_steps: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=FSDP2Strategy(),
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        precision="32-true",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


class KeepHistory(pl.Callback):
    """The engine's k history, kept at the end of training (the engine goes when its last user releases it)."""

    def __init__(self) -> None:
        self.history: list[tuple[int, int, int, str]] = []

    def on_train_end(self, trainer, pl_module):
        engine = MicroBatchEngine.get(trainer)
        self.history = [(c.step, c.k_before, c.k_after, str(c.source.value)) for c in engine.history]


def search_fit(finder: MemoryAwareBatchSize, limits: list[int]) -> dict:
    pl.seed_everything(0, verbose=False)
    limit, history = RankLimit(limits), KeepHistory()
    trainer = trainer_for([finder, limit, history], STEPS)
    module = TinyLM()
    trainer.fit(module, data())
    result = finder.result
    return {
        "micro_batch_size": finder.micro_batch_size,
        "local": result.size if result is not None else None,
        "measured": [(m.size, m.out_of_memory) for m in result.measurements] if result is not None else [],
        "k": finder.k,
        "trials": finder.trials,
        "ooms_in_search": limit.ooms_in_search,
        "ooms": limit.ooms,
        "steps": trainer.global_step,
        "history": history.history,
        "units": sum(isinstance(m, FSDPModule) for m in module.modules()),
        "params": {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()},
    }


def main() -> None:
    out_dir = sys.argv[1]
    # 1. truth: the limits and each rank's true maximum, by real steps without a limit.
    pl.seed_everything(0, verbose=False)
    truth = Truth()
    probe = RankPeaks(truth)
    trainer_for([RankLimit([None, None]), probe], max_steps=40).fit(TinyLM(), data())
    assert truth(probe.peaks) is None, "the truth fit ended before every bisection did"
    # 2. search under the limits; 3. the twin that applies the answer without searching.
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    searched = search_fit(finder, truth.limits)
    twin = MemoryAwareBatchSize(target_fraction=1.0)
    twin.load_state_dict(finder.state_dict())
    restored = search_fit(twin, truth.limits)
    # 4. mode="max": the batch size itself.
    pl.seed_everything(0, verbose=False)
    largest, limit = (
        MemoryAwareBatchSize(mode="max", target_fraction=1.0, max_batch_size=256),
        RankLimit(truth.limits),
    )
    trainer = trainer_for([largest, limit], 2)
    trainer.fit(TinyLM(), datamodule=Data())
    chosen = {
        "batch_size": trainer.datamodule.batch_size,
        "trials": largest.trials,
        "ooms_in_search": limit.ooms_in_search,
        "ooms": limit.ooms,
        "steps": trainer.global_step,
    }
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.save(
        {
            "limits": truth.limits,
            "truth": [lo for lo, _ in truth.bounds],
            "peaks": probe.peaks,
            "search": searched,
            "twin": {**restored, "searched": twin.result is not None},
            "max": chosen,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    run_script(main)
