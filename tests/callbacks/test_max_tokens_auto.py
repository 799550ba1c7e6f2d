"""GPUOptDataModule(max_tokens="auto") with MemoryAwareBatchSize (issue 36): the budget is chosen from a few
measured shapes at fit start, every step of an epoch fits without a split, the costliest ones fill the budget,
and a resumed run keeps the budget (the same batches)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import Dataset

from lightning_gpuopt import GPUOptDataModule, MemoryAwareBatchSize, MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.batch_size.peak_model import memory_budget
from lightning_gpuopt.testing import SimulatedMemory
from tests.batch_size.test_token_peaks import HandWrittenLM
from tests.helpers import TRAINER_QUIET

LIMIT = 48 * 2**20


class Sequences(Dataset):
    """300 token sequences, lengths log-normal around 40, clipped to 8..160."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.lengths = (
            (torch.randn(300, generator=generator) * 0.6 + 3.7).exp().round().clamp(8, 160).long().tolist()
        )

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.randint(1, 256, (self.lengths[i],), generator=torch.Generator().manual_seed(i))


def pad(samples):
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = s
        labels[row, : len(s) - 1] = s[1:]
    return {"input_ids": ids, "labels": labels}


class Text(GPUOptDataModule):
    def __init__(self, **kwargs):
        super().__init__(num_workers=0, max_tokens="auto", **kwargs)

    def train_dataset(self):
        return Sequences()

    def collate_fn(self):
        return pad


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = HandWrittenLM()

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepPeaks(pl.Callback):
    def __init__(self, memory: SimulatedMemory) -> None:
        self.memory, self.peaks, self.shapes = memory, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.memory.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peaks.append(self.memory.peak_bytes)
        self.shapes.append(tuple(batch["input_ids"].shape))


def _fit(tmp_path, callbacks, ckpt_path=None, epochs=1, **kwargs):
    torch.manual_seed(0)
    data = Text()
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        **{**TRAINER_QUIET, "enable_checkpointing": True, **kwargs},
    )
    trainer.fit(LM(), data, ckpt_path=ckpt_path)
    return trainer, data


def test_auto_chooses_a_budget_whose_epoch_fits_and_whose_costliest_steps_fill_it(tmp_path, caplog):
    search, oom = MemoryAwareBatchSize(), OOMRecovery()
    with SimulatedMemory(LIMIT) as memory:
        peaks = StepPeaks(memory)
        _, data = _fit(tmp_path, [search, oom, peaks])
        assert memory.num_ooms == 0
    budget = memory_budget(LIMIT, search.target_fraction)
    assert isinstance(data.max_tokens, int) and data.max_tokens == search.max_tokens
    assert all(rows * longest <= data.max_tokens for rows, longest in peaks.shapes)
    assert oom.k == 1 and not oom.failures  # no step needed a split
    assert max(peaks.peaks) <= budget
    assert max(peaks.peaks) >= 0.85 * budget, (max(peaks.peaks) / budget, search.token_search)
    (line,) = [r.getMessage() for r in caplog.records if "max_tokens='auto' ->" in r.getMessage()]
    assert f"max_tokens='auto' -> {data.max_tokens} (measured 2x" in line and "\n" not in line


def _saves(tmp_path):
    return ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0, save_last=True)


def test_a_resumed_run_keeps_the_budget_and_searches_no_more(tmp_path):
    with SimulatedMemory(LIMIT):
        first = MemoryAwareBatchSize()
        _fit(tmp_path, [first, _saves(tmp_path)], limit_train_batches=3)
        again = MemoryAwareBatchSize()
        last = str(tmp_path / "ckpt" / "last.ckpt")
        _, data = _fit(tmp_path, [again, _saves(tmp_path)], ckpt_path=last, epochs=2, limit_train_batches=3)
    assert data.max_tokens == first.max_tokens and again.token_search is None


def test_auto_on_cpu_without_simulated_memory_is_refused_in_one_line(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"max_tokens='auto' is chosen from device memory.*give max_tokens an int"
    ):
        _fit(tmp_path, [MemoryAwareBatchSize()])


def test_auto_without_memory_aware_batch_size_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"add MemoryAwareBatchSize\(\) to the Trainer's callbacks"):
        _fit(tmp_path, [])


def test_mode_max_with_token_batches_is_refused(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"\(mode='max'\) sets batch_size, which a GPUOptDataModule batching by tokens"
    ):
        _fit(tmp_path, [MemoryAwareBatchSize(mode="max")])


def test_a_budget_that_no_single_long_sample_fits_stops_the_fit_in_one_line(tmp_path):
    with SimulatedMemory(5 * 2**20), pytest.raises(MicroBatchOOMError) as err:
        _fit(tmp_path, [MemoryAwareBatchSize()])
    message = str(err.value)
    assert "even one sample of the longest length does not fit" in message and "\n" not in message


class IssueSequences(Dataset):
    """Issue 36's data: 2,000 sequences, lengths log-normal around 80 tokens, clipped to 16..512, vocabulary 256."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(36)
        self.lengths = (
            (torch.randn(2000, generator=generator) * 0.6 + math.log(80))
            .exp()
            .round()
            .clamp(16, 512)
            .long()
            .tolist()
        )

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.randint(1, 256, (self.lengths[i],), generator=torch.Generator().manual_seed(i))


def pad_tuple(samples):
    """``(ids, labels)`` padded to the batch's longest sample, labels -100 on the padding (no setting tells the
    pack where the tokens are)."""
    batch = pad(samples)
    return batch["input_ids"], batch["labels"]


class IssueText(GPUOptDataModule):
    def __init__(self, **kwargs):
        super().__init__(num_workers=0, max_tokens="auto", **kwargs)

    def train_dataset(self):
        return IssueSequences()

    def collate_fn(self):
        return pad_tuple


class TupleLM(LM):
    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return super().training_step({"input_ids": ids, "labels": labels}, batch_idx)


class Tokens(pl.Callback):
    """Each step's peak, its padded and real tokens."""

    def __init__(self, memory: SimulatedMemory) -> None:
        self.memory, self.peaks, self.padded, self.real = memory, [], 0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.memory.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peaks.append(self.memory.peak_bytes)
        self.padded += batch[1].numel()
        self.real += int((batch[1] != -100).sum())


def _peak_of_one_step(rows: int, length: int) -> int:
    """One training step's peak (AdamW's state created) at ``rows`` x ``length``, as SimulatedMemory counts it."""
    torch.manual_seed(0)
    module = TupleLM()
    ids = torch.randint(1, 256, (rows, length), generator=torch.Generator().manual_seed(1))
    with SimulatedMemory() as memory:
        memory.track(module)
        optimizer = module.configure_optimizers()
        module.training_step((ids, ids), 0).backward()
        optimizer.step()
        return memory.peak_bytes


@pytest.mark.slow
def test_issue_setup_trains_200_steps_by_tokens_with_defaults(tmp_path):
    """Issue 36's acceptance: its data and model, a limit of one step's peak at 16 x 512, ``max_tokens="auto"``,
    ``MemoryAwareBatchSize()`` and the default ``OOMRecovery()`` (no weighting given): 200 steps without an error,
    at most 1 split per 100 steps, padding at most 10 % of the computed tokens, the costliest steps at 85-100 % of
    the budget."""
    limit = _peak_of_one_step(16, 512)
    search, oom = MemoryAwareBatchSize(), OOMRecovery()
    torch.manual_seed(0)
    with SimulatedMemory(limit) as memory:
        tokens = Tokens(memory)
        trainer = pl.Trainer(
            max_steps=200, callbacks=[search, oom, tokens], default_root_dir=tmp_path, **TRAINER_QUIET
        )
        trainer.fit(TupleLM(), IssueText())
    assert trainer.global_step == 200
    assert len(oom.failures) <= 2, oom.failures
    padding = 1 - tokens.real / tokens.padded
    assert padding <= 0.10, padding
    budget = memory_budget(limit, search.target_fraction)
    assert 0.85 * budget <= max(tokens.peaks) <= budget, (max(tokens.peaks) / budget, search.token_search)
