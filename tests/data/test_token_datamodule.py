"""GPUOptDataModule(max_tokens=...): a fit on variable-length samples gets batches within the budget, every sample
once per epoch, the same count each epoch; lengths read from the samples; bad input in one line (issue 36)."""

from __future__ import annotations

import collections
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from lightning_gpuopt import GPUOptDataModule
from tests.helpers import TRAINER_QUIET, run_ranks

LENGTHS = [3 + (i * 11) % 29 for i in range(60)]


class Sentences(Dataset):
    """Dict samples of different lengths, no `lengths` attribute: the datamodule reads them."""

    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        return {"id": i, "input_ids": torch.full((LENGTHS[i],), i + 1)}


def pad(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
    return {"id": torch.tensor([s["id"] for s in samples]), "input_ids": ids}


class Text(GPUOptDataModule):
    def __init__(self, dataset=None, **kwargs):
        super().__init__(num_workers=0, **kwargs)
        self.dataset = dataset or Sentences()

    def train_dataset(self):
        return self.dataset

    def collate_fn(self):
        return pad


class Embeds(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 4)
        self.seen = collections.defaultdict(list)
        self.shapes = []

    def training_step(self, batch, batch_idx):
        self.seen[self.current_epoch] += batch["id"].tolist()
        self.shapes.append(tuple(batch["input_ids"].shape))
        return self.embed(batch["input_ids"]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_fit_batches_by_tokens_within_the_budget_every_sample_once_the_same_count_each_epoch():
    model, data = Embeds(), Text(max_tokens=96)
    trainer = pl.Trainer(max_epochs=3, **TRAINER_QUIET)
    trainer.fit(model, data)
    assert all(rows * longest <= 96 for rows, longest in model.shapes)
    assert {epoch: sorted(ids) for epoch, ids in model.seen.items()} == {e: list(range(60)) for e in range(3)}
    per_epoch = len(model.shapes) // 3
    assert per_epoch == trainer.num_training_batches and len(model.shapes) == 3 * per_epoch
    padded = sum(rows * longest for rows, longest in model.shapes)
    assert 1 - 3 * sum(LENGTHS) / padded < 0.25  # fixed batches of 4 pad 45 % here


def test_the_datasets_lengths_attribute_is_used_as_given():
    dataset = Sentences()
    dataset.lengths = [5] * 60  # what the user says, not what the samples hold
    data = Text(dataset, max_tokens=20)
    data.trainer = pl.Trainer(**TRAINER_QUIET)
    assert [len(batch["id"]) for batch in data.train_dataloader()] == [4] * 15


class Floats(Dataset):
    def __len__(self):
        return 3

    def __getitem__(self, i):
        return float(i)


class Stream(IterableDataset):
    def __iter__(self):
        return iter([])


class Short(Sentences):
    lengths = [4, 5]


@pytest.mark.parametrize(
    ("dataset", "kwargs", "message"),
    [
        (Floats(), {}, "the length of training sample 0 cannot be read from a float"),
        (Stream(), {}, "max_tokens needs a map-style training dataset"),
        (Short(), {}, "sample_lengths gave 2 lengths for 60 training samples"),
        (
            Sentences(),
            {"max_tokens": 20},
            r"sample 21 has 31 tokens, more than max_tokens=20 \(22 sample\(s\) do\)",
        ),
    ],
)
def test_bad_input_is_said_in_one_line_when_the_loader_is_built(dataset, kwargs, message):
    data = Text(dataset, **{"max_tokens": 96, **kwargs})
    data.trainer = pl.Trainer(**TRAINER_QUIET)
    with pytest.raises(ValueError, match=message) as err:
        data.train_dataloader()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 8, "long_samples": "cut"}, "`long_samples` must be")],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Text(**kwargs)


@pytest.mark.slow
def test_under_ddp_every_rank_runs_as_many_batches_and_together_they_see_every_sample_once(tmp_path):
    ranks = run_ranks(Path(__file__).with_name("ddp_token_run.py"), tmp_path)
    counts = {len(rank["shapes"]) for rank in ranks}
    assert counts == {2 * ranks[0]["batches"]}  # the same count on both ranks, both epochs
    for epoch in (0, 1):
        together = sorted(i for rank in ranks for i in rank["seen"][epoch])
        assert together == list(range(len(LENGTHS)))
    assert all(rows * longest <= 96 for rank in ranks for rows, longest in rank["shapes"])


class Counted(Sentences):
    reads = 0

    def __getitem__(self, i):
        Counted.reads += 1
        return super().__getitem__(i)


def test_lengths_read_from_the_samples_are_read_once():
    """max_tokens="auto" asks for the lengths at fit start and the loader asks again: each sample is loaded once."""
    data, dataset = Text(max_tokens=96), Counted()
    assert data.sample_lengths(dataset) == LENGTHS and data.sample_lengths(dataset) == LENGTHS
    assert Counted.reads == len(LENGTHS)


@pytest.mark.parametrize("workers", [0, 2])
def test_long_samples_truncate_cuts_them_to_the_budget_and_keeps_every_sample(workers):
    """``long_samples="truncate"``: samples longer than ``max_tokens`` (LENGTHS reach 31) train as their first
    ``max_tokens`` tokens; every batch stays within the budget and every sample is seen once per epoch."""
    model, data = Embeds(), Text(max_tokens=20, long_samples="truncate")
    data.num_workers = workers
    trainer = pl.Trainer(max_epochs=2, **TRAINER_QUIET)
    trainer.fit(model, data)
    assert all(rows * longest <= 20 for rows, longest in model.shapes)
    assert max(longest for _, longest in model.shapes) == 20  # the long ones, cut
    assert {epoch: sorted(ids) for epoch, ids in model.seen.items()} == {e: list(range(60)) for e in range(2)}


def test_truncate_cuts_every_token_sequence_of_a_sample_and_leaves_the_rest():
    from lightning_gpuopt.data.token_batches import truncate

    sample = ({"input_ids": torch.arange(9), "mask": [1] * 9, "label": 3}, torch.zeros(2))
    cut = truncate(sample, 4)
    assert torch.equal(cut[0]["input_ids"], torch.arange(4)) and cut[0]["mask"] == [1] * 4
    assert cut[0]["label"] == 3 and torch.equal(cut[1], torch.zeros(2))
