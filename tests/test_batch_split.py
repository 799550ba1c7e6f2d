from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_gpuopt.batch_split import (
    BatchSplit,
    UnsplittableBatchError,
    batch_size_of,
    first_samples,
    split_batch,
    split_sizes,
)

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    names: list
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    x: torch.Tensor
    y: torch.Tensor


def _ids(n: int) -> torch.Tensor:
    return torch.arange(n)


def _recover_ids(chunks, get) -> list[int]:
    return [int(i) for chunk in chunks for i in get(chunk)]


@pytest.mark.parametrize(
    ("n", "k", "expected"), [(10, 3, [4, 3, 3]), (8, 4, [2, 2, 2, 2]), (5, 5, [1] * 5), (7, 1, [7])]
)
def test_split_sizes_differ_by_at_most_one(n, k, expected):
    sizes = split_sizes(n, k)
    assert sizes == expected
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("make", "get"),
    [
        (lambda n: _ids(n), lambda b: b),
        (lambda n: (_ids(n), torch.zeros(n, 3)), lambda b: b[0]),
        (lambda n: [_ids(n), torch.zeros(n, 2, 2)], lambda b: b[0]),
        (lambda n: {"ids": _ids(n), "x": torch.zeros(n, 4)}, lambda b: b["ids"]),
        (lambda n: OrderedDict(ids=_ids(n), x=torch.zeros(n)), lambda b: b["ids"]),
        (lambda n: Pair(_ids(n), torch.zeros(n)), lambda b: b.x),
        (lambda n: Sample(_ids(n), [f"s{i}" for i in range(n)]), lambda b: b.x),
        (lambda n: FrozenSample(_ids(n), torch.zeros(n)), lambda b: b.x),
        (lambda n: {"nested": (_ids(n), {"deep": torch.zeros(n, 1)})}, lambda b: b["nested"][0]),
    ],
    ids=[
        "tensor",
        "tuple",
        "list",
        "dict",
        "ordereddict",
        "namedtuple",
        "dataclass",
        "frozen-dataclass",
        "nested",
    ],
)
@pytest.mark.parametrize(
    ("n", "k"), [(10, 3), (9, 3), (7, 7), (5, 1)], ids=["uneven", "even", "singletons", "whole"]
)
def test_split_keeps_structure_and_every_sample_once(make, get, n, k):
    batch = make(n)
    split = split_batch(batch, k)
    assert isinstance(split, BatchSplit)
    assert len(split.chunks) == k
    assert split.sizes == split_sizes(n, k) and split.total == n
    for chunk, size in zip(split.chunks, split.sizes):
        assert type(chunk) is type(batch)
        assert batch_size_of(chunk) == size
    # Every sample lands in exactly one micro-batch, in order.
    assert _recover_ids(split.chunks, get) == list(range(n))


def test_tensor_chunks_are_views_not_copies():
    x = torch.zeros(6, 3)
    chunks, _ = split_batch(x, 3)
    chunks[1].fill_(1.0)
    assert x[2:4].eq(1).all() and x[:2].eq(0).all()


def test_per_sample_lists_are_split_alongside_tensors():
    batch = {"x": torch.arange(5), "paths": [f"img{i}.png" for i in range(5)], "labels": (0, 1, 0, 1, 1)}
    chunks, sizes = split_batch(batch, 2)
    assert sizes == [3, 2]
    assert chunks[0]["paths"] == ["img0.png", "img1.png", "img2.png"]
    assert chunks[1]["labels"] == (1, 1)
    assert isinstance(chunks[1]["labels"], tuple)


def test_constants_are_copied_into_every_micro_batch():
    batch = {"x": torch.arange(4), "temperature": torch.tensor(0.5), "mode": "train", "extra": None, "w": 2.0}
    chunks, _ = split_batch(batch, 2)
    for chunk in chunks:
        assert chunk["temperature"].item() == 0.5
        assert chunk["mode"] == "train" and chunk["extra"] is None and chunk["w"] == 2.0


def test_dataclass_scalar_field_is_kept():
    chunks, _ = split_batch(Sample(_ids(4), list("abcd"), scale=3.0), 2)
    assert [c.scale for c in chunks] == [3.0, 3.0]
    assert chunks[1].names == ["c", "d"]


def test_batch_of_only_per_sample_lists():
    chunks, sizes = split_batch({"text": ["a", "b", "c"]}, 3)
    assert sizes == [1, 1, 1]
    assert [c["text"] for c in chunks] == [["a"], ["b"], ["c"]]


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            (torch.zeros(4, 2), torch.zeros(3)),
            r"tensors disagree on the number of samples \(batch\[1\] has 3, batch\[0\] has 4\)",
        ),
        (
            {"x": torch.zeros(4), "names": ["a", "b"]},
            r"tensors have 4 samples but batch\['names'\] has 2 items",
        ),
        (torch.tensor(3.0), r"found no tensor with a sample dimension in a batch of type Tensor"),
        ({"a": "text"}, "found no tensor with a sample dimension in a batch of type dict"),
        ({"a": ["x", "y"], "b": ["z"]}, "per-sample lists disagree"),
    ],
    ids=["tensors-disagree", "list-disagrees", "scalar-tensor", "no-tensor", "lists-disagree"],
)
def test_unsplittable_batch_error_names_the_hook(batch, message):
    with pytest.raises(UnsplittableBatchError, match=message) as info:
        split_batch(batch, 2)
    assert "split_batch(self, batch, k)" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("k", "message"),
    [
        (0, r"must be in \[1, 4\]"),
        (5, r"must be in \[1, 4\]"),
        (2.0, "must be an int"),
        (True, "must be an int"),
    ],
)
def test_invalid_k_is_a_clear_error(k, message):
    with pytest.raises(ValueError, match=message):
        split_batch(torch.zeros(4), k)


# ---------------------------------------------------------------------------- putting outputs back together


def test_merge_outputs_is_the_inverse_of_the_split_for_what_steps_return():
    from lightning_gpuopt.batch_split import merge_outputs

    batch = {"ids": torch.arange(10), "names": [f"s{i}" for i in range(10)], "scale": torch.tensor(2.0)}
    chunks = split_batch(batch, 3)
    weights = [size / 10 for size in chunks.sizes]
    outputs = [
        {
            "ids": c["ids"],
            "names": c["names"],
            "loss": c["ids"].double().mean(),
            "count": len(c["ids"]),
            "tag": "x",
        }
        for c in chunks.chunks
    ]
    merged = merge_outputs(outputs, weights)
    assert torch.equal(merged["ids"], batch["ids"]) and merged["names"] == batch["names"]
    assert merged["loss"].item() == pytest.approx(4.5)  # a sample-weighted mean is the whole batch's mean
    assert merged["count"] == 3 and merged["tag"] == "x"  # other values: the last micro-batch's


def test_merge_outputs_keeps_tuples_namedtuples_and_dataclasses():
    import dataclasses
    from typing import NamedTuple

    from lightning_gpuopt.batch_split import merge_outputs

    class Pair(NamedTuple):
        pred: torch.Tensor
        target: torch.Tensor

    @dataclasses.dataclass
    class Out:
        pred: torch.Tensor
        score: float

    pairs = merge_outputs([Pair(torch.ones(2), torch.zeros(2)), Pair(torch.ones(1), torch.zeros(1))])
    assert type(pairs) is Pair and pairs.pred.shape == (3,)
    plain = merge_outputs([(torch.ones(2), 1.0), (torch.ones(1), 3.0)], [0.5, 0.5])
    assert isinstance(plain, tuple) and plain[1] == 2.0
    out = merge_outputs([Out(torch.ones(2), 1.0), Out(torch.ones(2), 2.0)], [0.25, 0.75])
    assert type(out) is Out and out.pred.shape == (4,) and out.score == 1.75
    assert merge_outputs([None, None]) is None


def test_merge_outputs_bad_input():
    from lightning_gpuopt.batch_split import merge_outputs

    with pytest.raises(ValueError, match="at least one micro-batch output"):
        merge_outputs([])
    with pytest.raises(ValueError, match=r"one share per output \(2\), got 1"):
        merge_outputs([1, 2], [1.0])


def test_first_samples_keeps_structure_and_views():
    x = torch.arange(12).reshape(6, 2)
    head = first_samples({"x": x, "names": list("abcdef"), "scale": 2.0}, 4)
    assert head["x"].data_ptr() == x.data_ptr() and head["x"].shape == (4, 2)
    assert head["names"] == list("abcd") and head["scale"] == 2.0
    with pytest.raises(
        ValueError, match=r"`n` \(samples\) must be an int in \[1, 6\] for a batch of 6 samples, got 7"
    ):
        first_samples(x, 7)


def test_the_old_module_path_still_imports_with_a_warning():
    import importlib
    import sys

    import lightning_gpuopt.batch_split as batch_split

    sys.modules.pop("lightning_gpuopt.batching", None)
    with pytest.warns(
        DeprecationWarning, match="lightning_gpuopt.batching is lightning_gpuopt.batch_split now"
    ):
        old = importlib.import_module("lightning_gpuopt.batching")
    assert old.split_batch is batch_split.split_batch and old.__all__ == batch_split.__all__
