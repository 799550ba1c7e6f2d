"""Split one batch into k micro-batches along dim 0, and put per-micro-batch results back together.

Pure functions over any batch structure a DataLoader yields: tensors, tuples, lists, dicts (any
mapping), namedtuples, dataclasses, and per-sample lists of non-tensor values (file names, strings,
ids). Leaves without a batch dimension (0-d tensors, numbers, strings, ``None``) are copied into
every micro-batch unchanged.

Micro-batch sizes follow ``torch.tensor_split``: they differ by at most one, larger ones first
(10 samples into 3 → 4, 3, 3). Tensor chunks are views, so splitting costs no memory.

A batch whose parts disagree on the number of samples cannot be split; :class:`UnsplittableBatchError`
says so and names the hook to override: a ``split_batch(self, batch, k)`` method on the
LightningModule or on the :class:`~lightning_gpuopt.GPUOptDataModule` that returns ``k`` micro-batches.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from lightning_gpuopt._validate import positive_int
from lightning_gpuopt.memory.walk import (
    BatchSizeError,
    is_dataclass_instance,
    is_namedtuple,
    is_per_sample_list,
    rebuild,
    sample_count,
)

__all__ = [
    "SPLIT_HOOK",
    "BatchSplit",
    "UnsplittableBatchError",
    "batch_size_of",
    "first_samples",
    "merge_outputs",
    "slice_samples",
    "split_batch",
    "split_sizes",
    "take_samples",
]

#: Name of the method a LightningModule or GPUOptDataModule defines to split its own batches.
SPLIT_HOOK = "split_batch"


class UnsplittableBatchError(ValueError):
    """Raised when a batch has no common leading dimension to split along."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"Cannot split the batch into micro-batches: {reason}. Expected every tensor in the batch to "
            "share its first (sample) dimension. Define `split_batch(self, batch, k)` on your "
            "LightningModule or GPUOptDataModule returning a list of k micro-batches, or declare the batch "
            "unsplittable."
        )


class BatchSplit(NamedTuple):
    """The micro-batches of one batch and the number of samples in each.

    Example:
        >>> split = split_batch(torch.arange(5), 2)
        >>> split.sizes
        [3, 2]
        >>> split.total
        5
    """

    chunks: list[Any]
    sizes: list[int]

    @property
    def total(self) -> int:
        """Samples in the whole batch."""
        return sum(self.sizes)


def split_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``k`` near-equal parts of ``n`` samples, larger parts first.

    Example:
        >>> split_sizes(10, 3)
        [4, 3, 3]
    """
    positive_int("n", n, unit="samples in the batch")
    _check_k(k, n)
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def batch_size_of(batch: Any) -> int:
    """Number of samples in ``batch`` (:func:`lightning_gpuopt.memory.walk.sample_count`: its tensors' common
    leading dimension, else its per-sample lists'), or the split's own error.

    Raises:
        UnsplittableBatchError: the parts disagree, or nothing in the batch has a sample dimension.

    Example:
        >>> batch_size_of((torch.zeros(8, 3), ["a"] * 8))
        8
    """
    try:
        return sample_count(batch)
    except BatchSizeError as err:
        raise UnsplittableBatchError(err.reason) from None


def split_batch(batch: Any, k: int) -> BatchSplit:
    """Split ``batch`` along dim 0 into ``k`` micro-batches of near-equal size.

    Args:
        batch: what the DataLoader yielded for one step.
        k: number of micro-batches, from 1 to the number of samples.

    Returns:
        The micro-batches (same structure and types as ``batch``; tensors are views) and their sizes.

    Raises:
        UnsplittableBatchError: the batch has no common sample dimension.
        ValueError: ``k`` is not an int in [1, samples].

    Example:
        >>> x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
        >>> chunks, sizes = split_batch((x, y), 2)
        >>> sizes
        [3, 2]
        >>> chunks[1][1]
        tensor([3, 4])
    """
    n = batch_size_of(batch)
    sizes = split_sizes(n, k)
    bounds = []
    start = 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return BatchSplit([slice_samples(batch, n, lo, hi) for lo, hi in bounds], sizes)


def first_samples(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch``, same structure and types (tensors are views).

    Raises:
        UnsplittableBatchError: the batch has no common sample dimension.
        ValueError: ``n`` is not an int in [1, samples].

    Example:
        >>> first_samples({"x": torch.arange(6).reshape(3, 2), "name": ["a", "b", "c"]}, 2)
        {'x': tensor([[0, 1],
                [2, 3]]), 'name': ['a', 'b']}
    """
    total = batch_size_of(batch)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= total:
        raise ValueError(
            f"`n` (samples) must be an int in [1, {total}] for a batch of {total} samples, got {n!r}"
        )
    return slice_samples(batch, total, 0, n)


def _check_k(k: int, n: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"`k` (micro-batches) must be an int, got {k!r}")
    if not 1 <= k <= n:
        raise ValueError(f"`k` (micro-batches) must be in [1, {n}] for a batch of {n} samples, got {k}")


def slice_samples(batch: Any, n: int, lo: int, hi: int) -> Any:
    """Samples ``lo:hi`` of every tensor with a sample dimension and of every per-sample list of ``n`` items."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf[lo:hi] if leaf.dim() > 0 else leaf
        if is_per_sample_list(leaf):
            return leaf[lo:hi] if len(leaf) == n else leaf
        return leaf

    return rebuild(batch, cut, stop=is_per_sample_list)


def take_samples(batch: Any, n: int, indices: Sequence[int]) -> Any:
    """Samples ``indices`` of every tensor with a sample dimension and of every per-sample list of ``n`` items, in
    that order (tensors are copies: a few samples of a large batch).

    Example:
        >>> take_samples([torch.arange(4) * 10, torch.arange(4)], 4, [3, 0])
        [tensor([30,  0]), tensor([3, 0])]
    """
    rows = torch.tensor(list(indices), dtype=torch.long)

    def pick(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf[rows.to(leaf.device)] if leaf.dim() > 0 else leaf
        if is_per_sample_list(leaf):
            return [leaf[i] for i in indices] if len(leaf) == n else leaf
        return leaf

    return rebuild(batch, pick, stop=is_per_sample_list)


def merge_outputs(outputs: Sequence[Any], weights: Sequence[float] | None = None) -> Any:
    """Put the outputs of k micro-batches back together as the output of the whole batch.

    The inverse of :func:`split_batch` for what a step returns: tensors with a sample dimension and
    per-sample lists are concatenated in order; 0-d floating tensors and floats are combined as a
    weighted mean with ``weights`` (the micro-batches' shares of the batch, summing to one: a mean
    over samples stays a mean over samples); mappings, namedtuples, tuples and dataclasses are merged
    field by field; anything else (``None``, ints, strings, other objects) is the last micro-batch's.

    Args:
        outputs: one output per micro-batch, of the same structure.
        weights: the micro-batches' shares; ``None``: equal shares.

    Raises:
        ValueError: no outputs, or a different number of weights.

    Example:
        >>> merge_outputs([torch.tensor([1, 2]), torch.tensor([3])])
        tensor([1, 2, 3])
        >>> merge_outputs([{"loss": torch.tensor(2.0), "ids": [0, 1]}, {"loss": torch.tensor(5.0), "ids": [2]}],
        ...               weights=[2 / 3, 1 / 3])
        {'loss': tensor(3.), 'ids': [0, 1, 2]}
    """
    if not outputs:
        raise ValueError("`outputs` must hold at least one micro-batch output, got none")
    if weights is None:
        weights = [1.0 / len(outputs)] * len(outputs)
    if len(weights) != len(outputs):
        raise ValueError(f"`weights` must have one share per output ({len(outputs)}), got {len(weights)}")
    if len(outputs) == 1:
        return outputs[0]
    return _merge(list(outputs), list(weights))


def _merge(values: list[Any], weights: list[float]) -> Any:
    first, last = values[0], values[-1]
    if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in values):
        if first.dim() > 0:
            return torch.cat([v.detach() if v.requires_grad else v for v in values])
        if first.is_floating_point():
            total = sum(v.detach().double() * w for v, w in zip(values, weights))
            return total.to(first.dtype)
        return last
    if isinstance(first, float) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        return float(sum(v * w for v, w in zip(values, weights)))
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) for v in values):
        merged = {
            key: _merge([v[key] for v in values], weights) if all(key in v for v in values) else last[key]
            for key in last
        }
        try:
            return type(last)(merged)
        except TypeError:
            return merged
    if is_namedtuple(first) and all(type(v) is type(first) for v in values):
        return type(first)(*(_merge(list(parts), weights) for parts in zip(*values)))
    if is_dataclass_instance(first) and all(type(v) is type(first) for v in values):
        new = copy.copy(last)
        for field in dataclasses.fields(first):
            object.__setattr__(new, field.name, _merge([getattr(v, field.name) for v in values], weights))
        return new
    if isinstance(first, list) and all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    if isinstance(first, tuple) and all(isinstance(v, tuple) and len(v) == len(first) for v in values):
        return tuple(_merge(list(parts), weights) for parts in zip(*values))
    return last
