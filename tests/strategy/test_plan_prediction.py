"""select_strategy and gpuopt plan with the predicted peak; device memory sizes with units."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_gpuopt.cli import main
from lightning_gpuopt.memory import scale_to_batch
from lightning_gpuopt.memory.units import ByteSize, parse_bytes
from lightning_gpuopt.strategy import select_strategy


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80e9", 80 * 10**9),
        ("1.5 TB", 15 * 10**11),
        ("512", 512),
    ],
)
def test_memory_sizes_read_with_units(text, expected):
    assert parse_bytes(text) == expected == ByteSize(text)


@pytest.mark.parametrize("text", ["80XB", "GB", "-1GB", "0", ""])
def test_a_bad_memory_size_says_what_is_accepted(text):
    with pytest.raises(ValueError, match="like 80GB, 80GiB or 80e9"):
        parse_bytes(text)


def _tiny_llama():
    pytest.importorskip("transformers", reason="the [test] extra installs transformers")
    from examples.llama_plan import LlamaModule

    return LlamaModule(size="tiny", vocab_size=512, init_on_meta=True)


def test_plan_predicts_each_candidate_and_the_largest_micro_batch_that_fits():
    module = _tiny_llama()
    batch = torch.randint(0, 512, (2, 128))
    budget_memory = 16 * 2**20
    plan = select_strategy(
        module,
        devices=4,
        precision="bf16-mixed",
        optimizer=torch.optim.AdamW(module.parameters()),
        sample_batch=batch,
        micro_batch_size=8,
        device_memory=budget_memory,
    )
    traced = [row for row in plan.rows if not row.estimate.candidate.deepspeed]
    assert traced and all(row.prediction is not None and row.predicted_bytes for row in traced)
    for row in traced:
        largest = row.largest_micro_batch
        assert scale_to_batch(row.prediction, largest) <= plan.budget or largest == 0
        assert scale_to_batch(row.prediction, largest + 1) > plan.budget
        assert row.fits == (row.predicted_bytes <= plan.budget)
    full = next(r for r in traced if r.name == "fsdp: full shard")
    ddp = next(r for r in traced if r.name == "ddp")
    assert full.predicted_bytes < ddp.predicted_bytes and full.largest_micro_batch >= ddp.largest_micro_batch
    assert "predicted peak" in plan.table() and "max micro-batch" in plan.table()


def test_gpuopt_plan_accepts_a_device_memory_with_a_unit(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpuopt"])
    main(
        [
            "plan",
            "--model",
            "lightning.pytorch.demos.boring_classes.BoringModel",
            "--data",
            "lightning.pytorch.demos.boring_classes.BoringDataModule",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--gpuopt.device_memory",
            "80GiB",
        ]
    )
    assert "2 device(s), 80.00 GiB each" in capsys.readouterr().out


class _Sequences(torch.utils.data.Dataset):
    """Token sequences of 8 to 40 tokens; the longest (64) at index 150."""

    def __len__(self):
        return 300

    def __getitem__(self, i):
        return torch.ones(64 if i == 150 else 8 + i % 33, dtype=torch.long)


def test_a_plan_of_variable_length_data_is_made_for_its_longest_samples():
    from lightning_gpuopt import GPUOptDataModule
    from lightning_gpuopt.strategy import sample_batch_of

    class Padded(GPUOptDataModule):
        def train_dataset(self):
            return _Sequences()

        def collate_fn(self):
            return lambda items: torch.nn.utils.rnn.pad_sequence(items, batch_first=True)

    batch = sample_batch_of(Padded(batch_size=8))
    assert batch.shape == (2, 64)  # the longest sample, and the next longest (40 tokens) padded to it
    assert sorted(int(row.count_nonzero()) for row in batch) == [40, 64]


class _SortedByLength(torch.utils.data.Dataset):
    """1000 sequences sorted by length (a bucketed dataset): the longest is the last."""

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return torch.ones(1 + i // 10, dtype=torch.long)


def test_the_plan_scans_the_whole_dataset_for_its_longest_samples():
    from lightning_gpuopt import GPUOptDataModule
    from lightning_gpuopt.strategy import sample_batch_of

    class Sorted(GPUOptDataModule):
        def train_dataset(self):
            return _SortedByLength()

        def collate_fn(self):
            return lambda items: torch.nn.utils.rnn.pad_sequence(items, batch_first=True)

    torch.manual_seed(0)
    state = torch.get_rng_state()
    batch = sample_batch_of(Sorted(batch_size=8))
    assert batch.shape == (2, 100)  # index 999 (100 tokens) is among the samples scanned
    assert torch.equal(torch.get_rng_state(), state)
