"""A small batch to plan with: :func:`sample_batch_of` picks the longest samples of a GPUOptDataModule's training data."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch

from lightning_gpuopt.memory.walk import leaves

__all__ = [
    "sample_batch_of",
]


def sample_batch_of(datamodule: Any, samples: int = 2, scan: int = 256) -> Any:
    """A small batch from a GPUOptDataModule's training data, as long as its longest samples; else ``None``.

    The ``samples`` largest samples (by tensor and array elements, string lengths and list items: the
    longest sequences) among up to ``scan`` spread evenly over the dataset (first and last included),
    collated as the loaders do, so that variable-length data padded per batch is planned at the longest
    of those. Samples of one size give the first ones. The random streams are left as they were, and a
    sample that fails to load is passed over. Only the pack's datamodule is read: it gives its dataset
    without building loaders (no worker processes): any object with its ``stage_dataset`` and ``collate_fn``.
    """
    if not (
        callable(getattr(datamodule, "stage_dataset", None))
        and callable(getattr(datamodule, "collate_fn", None))
    ):
        return None
    try:
        dataset = datamodule.stage_dataset("train")
        collate = datamodule.collate_fn() or torch.utils.data.default_collate
        n = len(dataset)
        if n == 0:
            return None
        indices = range(n) if n <= scan else sorted({i * (n - 1) // (scan - 1) for i in range(scan)})
        items = []
        state = random.getstate()
        with torch.random.fork_rng(devices=[]):  # augmentations draw: the training's stream stays as it was
            for i in indices:
                with contextlib.suppress(Exception):  # one bad sample does not lose the plan
                    items.append(dataset[i])
        random.setstate(state)
        if not items:
            return None
        longest = sorted(range(len(items)), key=lambda k: -_elements(items[k]))[:samples]
        return collate([items[k] for k in sorted(longest)])
    except Exception:  # an iterable dataset, or one that cannot be indexed: plan without activations
        return None


def _elements(sample: Any) -> int:
    """A sample's size: tensor and array elements, string lengths, one per other leaf."""
    total = 0
    for _, x in leaves(sample):
        if isinstance(x, torch.Tensor):
            total += x.numel()
        elif isinstance(x, (str, bytes)):
            total += len(x)
        else:
            size = getattr(x, "size", None)  # a numpy array
            total += size if isinstance(size, int) else 1
    return total
