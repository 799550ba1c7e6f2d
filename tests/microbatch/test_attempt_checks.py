"""The micro-batch engine's attempt checks (``MicroBatchUser.check_attempt``): a kept attempt can be sent back, and
leaves no trace."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.microbatch import MicroBatchEngine, MicroBatchUser
from tests.helpers import TRAINER_QUIET


class Samples(Dataset):
    def __init__(self, length: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(length, 8, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Switchable(pl.LightningModule):
    """``mode`` stands for what a check may change between attempts (the precision, in PrecisionSwitch)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.mode = 1.0
        self.seen = torchmetrics.CatMetric()
        self.calls: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.calls.append((batch_idx, self.mode))
        loss = F.mse_loss(self.net(x * self.mode), y)
        self.seen.update(ids.double())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Engine(MicroBatchUser, pl.Callback):
    """Attaches the engine with one attempt check; ``flip_at``: the batch whose first attempt is sent back."""

    def __init__(self, flip_at: int | None = None, always: bool = False) -> None:
        self.flip_at, self.always = flip_at, always
        self.losses: list[float] = []
        self.asked: list[int] = []

    def on_fit_start(self, trainer, pl_module):
        self.engine = MicroBatchEngine.attach(trainer, self)

    def check_attempt(self, batch_idx: int, loss: torch.Tensor) -> bool:
        self.asked.append(batch_idx)
        module = self.engine.trainer.lightning_module
        if self.always or (batch_idx == self.flip_at and module.mode == 1.0):
            module.mode = 2.0
            return True
        return False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def teardown(self, trainer, pl_module, stage):
        self.engine.release(self)


class FlipBefore(pl.Callback):
    """The reference: ``mode`` changes before the batch runs at all."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            pl_module.mode = 2.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _fit(callback: pl.Callback, steps: int = 5) -> Switchable:
    pl.seed_everything(0, verbose=False)
    model = Switchable()
    trainer = pl.Trainer(max_steps=steps, precision="64-true", callbacks=[callback], **TRAINER_QUIET)
    trainer.fit(model, DataLoader(Samples(), batch_size=32))
    return model


def test_a_batch_sent_back_by_a_check_leaves_no_trace_of_its_first_attempt():
    checked, reference = Engine(flip_at=2), FlipBefore(at=2)
    model, ref = _fit(checked), _fit(reference)
    assert model.calls == [(0, 1.0), (1, 1.0), (2, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)]
    assert checked.asked == [0, 1, 2, 2, 3, 4]  # the re-run is checked too
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(model.net[1].running_mean, ref.net[1].running_mean, rtol=0, atol=0)
    assert model.seen.compute().tolist() == ref.seen.compute().tolist()  # batch 2's ids once
    assert checked.losses == reference.losses  # one logged value per batch: the kept attempt's


def test_a_check_that_never_settles_is_stopped():
    with pytest.raises(RuntimeError, match=r"attempt checks sent batch 0 back 8 times"):
        _fit(Engine(always=True), steps=1)
