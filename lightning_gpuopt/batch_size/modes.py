"""What each mode of MemoryAwareBatchSize searches over: micro-batches of a fetched batch, or whole batches.

- ``mode="micro"`` (:func:`micro_mode_space`): the first samples of the batch the loop fetched (or the
  first micro-batch of the user's ``split_batch`` hook), already on the device; the batch whole at its
  own size.
- ``mode="max"`` (:func:`max_mode_space`): at fit start, before the loaders exist, whole batches of
  samples from the training dataset, collated, moved to the device and measured by the same search; the
  budget also holds the batches the data pipeline keeps ahead at the new size. The answer becomes
  ``batch_size``: this changes the optimizer batch, and :func:`scale_learning_rate` can follow it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpuopt.batch_size.search import TrialBatch
from lightning_gpuopt.batch_split import SPLIT_HOOK, first_samples
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.memory.walk import batch_nbytes

__all__ = [
    "SearchSpace",
    "batches_ahead",
    "first_items",
    "host_batch",
    "max_mode_space",
    "micro_mode_space",
    "scale_learning_rate",
]


@dataclass(frozen=True)
class SearchSpace:
    """The trial batches and the sizes one search may try.

    Attributes:
        make_batch: ``make_batch(n)``: the batch a trial step at ``n`` samples runs.
        smallest: the smallest size allowed.
        largest: the largest size worth trying.
        held_bytes_per_sample: device bytes per sample of batches held through a step besides the trial's
            own (the batches the data pipeline holds ahead, when ``batch_size`` itself is chosen).
        batch_idx: passed to ``training_step``.
        whole_largest: a step at ``largest`` runs the batch whole (see
            :class:`~lightning_gpuopt.batch_size.search.SizeSearch`).
    """

    make_batch: Callable[[int], TrialBatch]
    smallest: int
    largest: int
    held_bytes_per_sample: float = 0.0
    batch_idx: int = 0
    whole_largest: bool = False


def micro_mode_space(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batch: Any,
    samples: int,
    batch_idx: int,
    splittable: bool,
    min_batch_size: int,
    max_batch_size: int | None,
) -> SearchSpace:
    """Micro-batches of ``batch`` (``samples`` samples), the batch the loop fetched.

    ``splittable``: ``False`` for a batch declared unsplittable (OOMRecovery's ``unsplittable``): only the
    whole batch can run.
    """
    n = samples
    if splittable:
        largest = min(n, max_batch_size or n)
        smallest = min(min_batch_size, largest)
    else:
        largest = smallest = n
    splitter = _splitter(trainer, module)

    def micro_batch(size: int) -> TrialBatch:
        if size >= n:  # k = 1: the engine runs the batch whole, after zeroing the gradients
            return TrialBatch(batch, n, 0, True)
        if splitter is None:
            return TrialBatch(first_samples(batch, size), size, 0, False)
        k = math.ceil(n / size)
        return TrialBatch(splitter(batch, k)[0], math.ceil(n / k), 0, False)  # the split hook decides

    return SearchSpace(micro_batch, smallest, largest, batch_idx=batch_idx, whole_largest=largest == n)


def max_mode_space(
    trainer: pl.Trainer, module: pl.LightningModule, min_batch_size: int, max_batch_size: int | None
) -> SearchSpace:
    """Whole batches of samples drawn from the training DataLoader's dataset (indices 0, 1, ...)."""
    loader = _train_loader(trainer, module)
    dataset, collate = loader.dataset, loader.collate_fn
    sized = not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__")
    if max_batch_size is None and not sized:
        raise RuntimeError(
            "MemoryAwareBatchSize(mode='max') needs `max_batch_size` for an IterableDataset (its length is unknown)."
        )
    largest = max_batch_size or max(1, len(dataset) // trainer.world_size)
    smallest = min(min_batch_size, largest)
    ahead = batches_ahead(trainer)

    def whole_batch(size: int) -> TrialBatch:
        if sized:
            samples = first_items(dataset, size)
        else:
            samples = [sample for _, sample in zip(range(size), iter(dataset))]
        batch = host_batch(trainer, module, samples, collate)
        before = get_probe(trainer.strategy.root_device).allocated
        batch = trainer.strategy.batch_to_device(batch)
        nbytes = max(batch_nbytes(batch), get_probe(trainer.strategy.root_device).allocated - before)
        return TrialBatch(batch, size, nbytes, True)

    batch, n, nbytes, _ = whole_batch(smallest)
    del batch
    return SearchSpace(whole_batch, smallest, largest, held_bytes_per_sample=(1 + ahead) * (nbytes / n))


def first_items(dataset: Any, size: int) -> list[Any]:
    """The dataset's first ``size`` samples (cycling), read as the DataLoader's fetcher reads a batch: one
    ``__getitems__`` call where the dataset has it (a wrapper that keeps the random streams around each read then
    does so once per batch, not once per sample)."""
    indices = [i % len(dataset) for i in range(size)]
    fetch_many = getattr(dataset, "__getitems__", None)
    return fetch_many(indices) if fetch_many else [dataset[i] for i in indices]


def host_batch(
    trainer: pl.Trainer, module: pl.LightningModule, samples: list[Any], collate: Callable[[list], Any] | None
) -> Any:
    """``samples`` collated as the loader does and put through the module's pre-transfer hook and the precision's
    input conversion: what the strategy then moves to the device."""
    host = collate(samples) if collate is not None else samples
    return trainer.precision_plugin.convert_input(module.on_before_batch_transfer(host, 0))


def scale_learning_rate(trainer: pl.Trainer, rule: str | None, ratio: float) -> float:
    """Scale the optimizers' learning rates (and the schedulers' base rates) by ``ratio`` (``"linear"``) or its
    square root (``"sqrt"``); returns the factor applied (1 for ``rule=None``)."""
    if rule is None or ratio == 1.0:
        return 1.0
    factor = ratio if rule == "linear" else math.sqrt(ratio)
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * factor
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    return factor


def _splitter(trainer: pl.Trainer, module: pl.LightningModule) -> Callable[[Any, int], list] | None:
    for owner in (module, trainer.datamodule):
        hook = getattr(owner, SPLIT_HOOK, None) if owner is not None else None
        if callable(hook):
            return lambda batch, k: list(hook(batch, k))
    return None


def _train_loader(trainer: pl.Trainer, module: pl.LightningModule) -> DataLoader:
    datamodule = trainer.datamodule
    source = (
        datamodule if datamodule is not None and is_overridden("train_dataloader", datamodule) else module
    )
    loader = source.train_dataloader()
    if not isinstance(loader, DataLoader):
        raise RuntimeError(
            f"MemoryAwareBatchSize(mode='max') draws trial samples from the training DataLoader's dataset, but "
            f"`{type(source).__name__}.train_dataloader()` returned a {type(loader).__name__}. Return one DataLoader, "
            "or use mode='micro'."
        )
    return loader


def batches_ahead(trainer: pl.Trainer) -> int:
    """Training batches held on the device beside the one a step runs: the one Lightning fetched next on CPU
    (a CPU batch is the device batch), the one a GPUOptDataModule copies ahead on CUDA."""
    datamodule = trainer.datamodule
    resolve = getattr(datamodule, "resolved_device_prefetch", None)
    prefetch = 1 if callable(resolve) and resolve() else 0
    return (1 if trainer.strategy.root_device.type == "cpu" else 0) + prefetch
