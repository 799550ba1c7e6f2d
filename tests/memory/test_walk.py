"""The one batch walker: every layer that reads a batch sees the same parts, tensors and samples."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_gpuopt._compiled import mark_batch_dynamic
from lightning_gpuopt.batch_split import batch_size_of
from lightning_gpuopt.data.prefetch import batch_nbytes
from lightning_gpuopt.memory.estimate import activation_bytes_per_sample
from lightning_gpuopt.memory.walk import BatchSizeError, leaves, rebuild, sample_count, samples_in, tensors

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    names: list[str]


def nested() -> dict:
    return {
        "batch": Batch(torch.zeros(6, 3), torch.zeros(6), ["a"] * 6),
        "pairs": [Pair(torch.zeros(6, 2), "id")],
        "deep": OrderedDict(a=[[[[{"t": torch.zeros(6, 1)}]]]]),
    }


def test_every_tensor_is_found_through_dataclasses_namedtuples_and_deep_nesting():
    assert [tuple(t.shape) for t in tensors(nested())] == [(6, 3), (6,), (6, 2), (6, 1)]
    paths = [path for path, _ in leaves(nested())]
    assert "batch['batch'].x" in paths and "batch['pairs'][0].y" in paths


def test_rebuild_keeps_every_container_type_and_replaces_the_leaves():
    doubled = rebuild(nested(), lambda v: v + 1 if isinstance(v, torch.Tensor) else v)
    assert type(doubled["batch"]) is Batch and type(doubled["pairs"][0]) is Pair
    assert type(doubled["deep"]) is OrderedDict
    assert all(bool((t == 1).all()) for t in tensors(doubled))
    assert doubled["batch"].names == ["a"] * 6 and doubled["pairs"][0].y == "id"


def test_samples_of_a_dataclass_batch_are_its_tensors_leading_dimension():
    batch = Batch(torch.zeros(16, 3), torch.zeros(16), ["n"] * 16)
    assert sample_count(batch) == samples_in(batch) == batch_size_of(batch) == 16


def test_parts_that_disagree_raise_for_the_strict_count_and_give_the_first_tensor_for_the_tolerant_one():
    batch = ("a string first", torch.zeros(4, 2), torch.zeros(5))
    with pytest.raises(BatchSizeError, match=r"batch\[1\] has 4, batch\[2\] has 5"):
        sample_count(batch)
    assert samples_in(batch) == 4
    assert samples_in("no tensors") == 1


def test_the_layers_agree_on_a_dataclass_batch():
    """Prefetch's byte count, compile's dynamic batch dimension and the activation estimate read the same batch."""
    batch = Batch(torch.zeros(8, 4), torch.zeros(8), ["n"] * 8)
    assert batch_nbytes(batch) == 8 * 4 * 4 + 8 * 4
    assert mark_batch_dynamic(batch, 8) == 2
    net = torch.nn.Linear(4, 1)
    per_sample = activation_bytes_per_sample(net, batch, forward=lambda m, b: m(b.x))
    assert per_sample == 4 * 4  # the input, saved for the weight's gradient, per sample of 8
