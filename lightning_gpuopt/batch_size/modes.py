"""``MemoryAwareBatchSize(mode="max")``: choose ``batch_size`` itself, on samples drawn from the training dataset.

At fit start, before the loaders exist, whole batches of samples from the training dataset are
collated, moved to the device and measured by the same search as ``mode="micro"``; the budget also
holds the batches the data pipeline keeps ahead at the new size. The answer is set as ``batch_size``
of the DataModule (or LightningModule): this changes the optimizer batch, and it says so;
``lr_scaling`` scales the learning rate (and schedulers' base rates) with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpuopt.data.prefetch import batch_nbytes
from lightning_gpuopt.memory import MemoryProbe, get_probe

__all__ = ["MaxBatchSizeMode"]


class MaxBatchSizeMode:
    """The ``mode="max"`` part of :class:`~lightning_gpuopt.MemoryAwareBatchSize` (a mixin: it uses the
    callback's search, agreement, record and announcement)."""

    def _search_batch_size(self, trainer: pl.Trainer, module: pl.LightningModule, probe: MemoryProbe) -> None:
        loader = _train_loader(trainer, module)
        dataset, collate = loader.dataset, loader.collate_fn
        sized = not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__")
        if self.max_batch_size is None and not sized:
            raise RuntimeError(
                "MemoryAwareBatchSize(mode='max') needs `max_batch_size` for an IterableDataset (its length is unknown)."
            )
        largest = self.max_batch_size or max(1, len(dataset) // trainer.world_size)
        smallest = min(self.min_batch_size, largest)
        old = int(lightning_getattr(module, "batch_size"))
        ahead = (1 if trainer.strategy.root_device.type == "cpu" else 0) + _device_prefetch_depth(trainer)

        def whole_batch(size: int) -> tuple[Any, int, int, bool]:
            if sized:
                samples = [dataset[i % len(dataset)] for i in range(size)]
            else:
                samples = [sample for _, sample in zip(range(size), iter(dataset))]
            host = collate(samples) if collate is not None else samples
            batch = trainer.precision_plugin.convert_input(module.on_before_batch_transfer(host, 0))
            before = get_probe(trainer.strategy.root_device).allocated
            batch = trainer.strategy.batch_to_device(batch)
            nbytes = max(batch_nbytes(batch), get_probe(trainer.strategy.root_device).allocated - before)
            return batch, size, nbytes, True

        per_sample = self._batch_bytes_per_sample(whole_batch, smallest)
        held = (1 + ahead) * per_sample
        size = self._agree(
            trainer,
            probe,
            smallest,
            lambda: self._search(trainer, module, probe, whole_batch, smallest, largest, held, 0, False),
        )
        self._record(trainer, size, size)
        lightning_setattr(module, "batch_size", size)
        self._engine.max_micro_batch_size = size
        factor = self._scale_lr(trainer, size / old)
        world, accumulate = trainer.world_size, trainer.accumulate_grad_batches
        lr = f"; learning rate x{factor:.4g} ({self.lr_scaling})" if self.lr_scaling else ""
        self._announce(
            trainer,
            f"batch_size {old} -> {size}: the optimizer batch changes {old * accumulate * world} -> "
            f"{size * accumulate * world} (mode='max'){lr}",
            "fit start",
        )

    @staticmethod
    def _batch_bytes_per_sample(make_batch: Callable[[int], tuple[Any, int, int, bool]], size: int) -> float:
        batch, n, nbytes, _ = make_batch(size)
        del batch
        return nbytes / n

    def _scale_lr(self, trainer: pl.Trainer, ratio: float) -> float:
        if self.lr_scaling is None or ratio == 1.0:
            return 1.0
        factor = ratio if self.lr_scaling == "linear" else math.sqrt(ratio)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for key in ("lr", "initial_lr"):
                    if key in group:
                        group[key] = group[key] * factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        self._lr_factor *= factor
        return factor


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


def _device_prefetch_depth(trainer: pl.Trainer) -> int:
    """Training batches a GPUOptDataModule keeps copied ahead on the device (0 when it does not)."""
    datamodule = trainer.datamodule
    resolve = getattr(datamodule, "resolved_device_prefetch", None)
    return 1 if callable(resolve) and resolve() else 0
