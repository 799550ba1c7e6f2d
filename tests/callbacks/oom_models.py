"""Models, data and runners for the OOM-recovery tests: small, activation-heavy, deterministic."""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import TRAINER_QUIET


class Waves(Dataset):
    """Sample i is (i, x_i, y_i) with y a smooth function of x: learnable, so parameters move."""

    def __init__(self, length: int = 128 * 64, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(length, dim, generator=g)
        self.y = torch.sin(self.x.sum(1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class WideRegressor(pl.LightningModule):
    """One wide hidden layer: activations dominate memory, as in the models OOM recovery is for.

    Records per training_step call: the samples it got, memory allocated at its start, what its
    forward left allocated, and the forward's peak. The sample ids it trained on go into a
    torchmetrics ``CatMetric``, whose state a failed attempt must not change.
    """

    def __init__(
        self, optimizer: str = "adam", hidden: int = 2048, clip: bool = False, scheduler: bool = False
    ) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the same initial weights however many models were built before
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.marks: list[tuple[int, int, int, int]] = []
        self.seen = torchmetrics.CatMetric()

    def training_step(self, batch, batch_idx):
        probe = get_probe()
        start = probe.allocated
        probe.reset_peak()
        ids, x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.marks.append((len(ids), start, probe.allocated - start, probe.peak))
        self.seen.update(ids.double())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if not self.scheduler:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5),
        }


class PlainWide(WideRegressor):
    """WideRegressor without its memory marks, so that the callback's own per-step peak is what counts."""

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.seen.update(ids.double())
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss


class StepLog(pl.Callback):
    """What the loop and the logger see once per batch: (batch_idx, global_step) and the logged train_loss."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((batch_idx, trainer.global_step))
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class StepPeaks(pl.Callback):
    """The peak of every training step."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        get_probe().reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peaks.append(get_probe().peak)


@dataclass
class Run:
    model: pl.LightningModule
    trainer: pl.Trainer
    memory: SimulatedMemory
    callbacks: list = field(default_factory=list)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def fit(
    model: pl.LightningModule,
    callbacks: list | None = None,
    limit: int | None = None,
    steps: int = 20,
    batch_size: int = 128,
    accumulate: int = 1,
    precision: str | None = "64-true",
    dataset: Dataset | None = None,
    **trainer_kwargs,
) -> Run:
    pl.seed_everything(0, verbose=False)
    callbacks = list(callbacks or [])
    trainer = pl.Trainer(
        max_steps=steps,
        precision=precision,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        gradient_clip_val=trainer_kwargs.pop("gradient_clip_val", None),
        **{**TRAINER_QUIET, **trainer_kwargs},
    )
    loader = DataLoader(dataset if dataset is not None else Waves(), batch_size=batch_size, shuffle=False)
    with SimulatedMemory(limit) as memory:
        trainer.fit(model, loader)
    return Run(model, trainer, memory, callbacks)


def step_marks(model: WideRegressor) -> tuple[int, int, int]:
    """(allocated at step start, allocated after forward, forward peak) of the last full-batch step."""
    _, start, kept, peak = model.marks[-1]
    return start, start + kept, peak


def optimizer_step_ids(model: WideRegressor, accumulate: int, batch_size: int = 128) -> list[list[int]]:
    """Sample ids trained on per optimizer step, in the order they were trained."""
    ids = [int(i) for i in torch.atleast_1d(model.seen.compute()).tolist()]
    per_step = batch_size * accumulate
    return [ids[s : s + per_step] for s in range(0, len(ids), per_step)]
