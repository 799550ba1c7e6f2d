"""Evaluation batches sized on their own (issue 36): an evaluation step keeps no gradients, activations for a
backward or optimizer state of its own, so MemoryAwareBatchSize measures validation steps and sets a
GPUOptDataModule's ``eval_batch_size`` when it is not given. Under a limit at which the training micro-batch is 8,
the evaluation batch is at least 12 (21 here), every validation batch runs at it, and nothing runs out of memory;
an explicit ``eval_batch_size`` is kept (the way to choose it yourself)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import Dataset

from lightning_gpuopt import GPUOptDataModule, MemoryAwareBatchSize, OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import TRAINER_QUIET

#: The limit at which this model's training micro-batch is 8 (measured: 7 at 55 MiB, 8 at 56 and 57).
LIMIT = 56 * 2**20


class Sequences(Dataset):
    """Samples of 64 x 256 floats, made when read (a dataset built under SimulatedMemory would count as held)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(i)
        return torch.randn(64, 256, generator=generator), torch.randint(0, 10, (), generator=generator)


class Data(GPUOptDataModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(batch_size=32, num_workers=0, **kwargs)

    def train_dataset(self):
        return Sequences(256)

    def val_dataset(self):
        return Sequences(96)


class Net(pl.LightningModule):
    """Three hidden layers over each of 64 positions: training keeps every layer's activations for its backward,
    evaluation about two layers' at a time."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)]
        self.net = nn.Sequential(*layers, nn.ReLU(), nn.Linear(1024, 10))
        self.val_sizes: list[int] = []
        self.samples = (
            torchmetrics.SumMetric()
        )  # what a validation epoch counted (the measurements leave none)
        self.counted: list[int] = []

    def loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).mean(1), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        if self.trainer.validating and not self.trainer.sanity_checking:  # not the measurements
            self.val_sizes.append(len(batch[0]))
        self.samples.update(len(batch[0]))
        self.log("val_loss", self.loss(batch))

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.counted.append(int(self.samples.compute()))
        self.samples.reset()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(search: MemoryAwareBatchSize, data: Data) -> tuple[Net, OOMRecovery, pl.Trainer]:
    model, oom = Net(), OOMRecovery(verbose=False)
    with SimulatedMemory(LIMIT):
        trainer = pl.Trainer(max_steps=3, val_check_interval=2, callbacks=[search, oom], **TRAINER_QUIET)
        trainer.fit(model, data)
    return model, oom, trainer


def test_the_evaluation_batch_is_measured_and_larger_than_the_training_micro_batch():
    search, data = MemoryAwareBatchSize(verbose=False), Data()
    model, oom, trainer = _fit(search, data)
    assert search.micro_batch_size == 8
    assert data.eval_batch_size == search.eval_batch_size >= 12
    size = data.eval_batch_size
    # Every validation batch ran at it (the last one holds the rest), whole: no OOM, no split.
    assert model.val_sizes and set(model.val_sizes[:-1]) == {size} and model.val_sizes[-1] <= size
    assert not oom.failures and oom.eval_k.get("validation", 1) == 1
    assert model.counted == [96]  # the measured validation steps left nothing in the module's metrics
    assert "val_loss" in trainer.callback_metrics
    (line,) = [d.message for d in decisions(trainer) if d.kind == "eval batch size"]
    assert line.startswith(
        f"MemoryAwareBatchSize: eval_batch_size None -> {size} (measured validation steps at 8,"
    )
    assert "\n" not in line


@pytest.mark.parametrize("eval_batch_size", [4, 32])
def test_an_explicit_eval_batch_size_is_kept(eval_batch_size):
    search, data = MemoryAwareBatchSize(verbose=False), Data(eval_batch_size=eval_batch_size)
    model, _, trainer = _fit(search, data)
    assert data.eval_batch_size == eval_batch_size and search.eval_batch_size is None
    assert set(model.val_sizes) == {eval_batch_size}
    assert not [d for d in decisions(trainer) if d.kind == "eval batch size"]


class StreamedValidation(Data):
    def val_dataset(self):
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return (Sequences(96)[i] for i in range(96))

        return Stream()


def test_a_streamed_validation_set_is_not_sized_and_runs_at_the_loaders_batch_size():
    search, data = MemoryAwareBatchSize(verbose=False), StreamedValidation()
    model, _, trainer = _fit(search, data)
    assert data.eval_batch_size is None and search.eval_batch_size is None
    assert set(model.val_sizes) == {32}
    assert not [d for d in decisions(trainer) if d.kind == "eval batch size"]
