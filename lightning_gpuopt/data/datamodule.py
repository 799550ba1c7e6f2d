"""GPUOptDataModule: subclass it, return datasets, and get tuned DataLoaders."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["GPUOptDataModule", "auto_num_workers"]

_STAGES = ("train", "val", "test", "predict")
_MAX_AUTO_WORKERS = 8


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may run on, not the machine's
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_num_workers(cpus: int, local_devices: int, cap: int = _MAX_AUTO_WORKERS) -> int:
    """Loader workers per device: this process's CPUs shared by the local devices, one kept for the main process.

    Example:
        >>> auto_num_workers(cpus=2, local_devices=1)
        1
        >>> auto_num_workers(cpus=64, local_devices=4)
        8
        >>> auto_num_workers(cpus=4, local_devices=8)
        0
    """
    per_device = cpus // max(1, local_devices)
    return max(0, min(cap, per_device - 1))


def _check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be a positive int{extra}, got {value!r}")


class GPUOptDataModule(pl.LightningDataModule):
    """A LightningDataModule base that builds tuned DataLoaders from the datasets a subclass returns.

    Override :meth:`train_dataset` and, as needed, :meth:`val_dataset`, :meth:`test_dataset` and
    :meth:`predict_dataset`. The base builds each loader when Lightning asks for it, reading
    ``batch_size`` at that moment, so a changed ``batch_size`` applies to the next loader built.
    Stages without a dataset are reported to Lightning as absent (no validation loop runs).
    Each dataset method is called once; the dataset is reused for later loaders.

    Every sample of a map-style dataset is delivered exactly once per epoch in a single process
    (``drop_last=False`` by default; shuffled for training). Under DDP, Lightning's distributed
    sampler pads the last round so each rank gets as many samples.

    Args:
        batch_size: samples per device per step (what the DataLoader yields).
        eval_batch_size: batch size of validation/test/predict loaders; defaults to ``batch_size``.
        num_workers: loader worker processes per device, or ``"auto"``: the CPUs this process may use
            divided by the local devices, minus one for the main process, at most 8.
        pin_memory: page-locked host batches for fast copies to the GPU, or ``"auto"``: on when training
            runs on CUDA.
        persistent_workers: keep workers alive between epochs (only with ``num_workers > 0``).
        prefetch_factor: batches each worker loads ahead (only with ``num_workers > 0``).
        shuffle: shuffle the training data each epoch.
        drop_last: drop the last, smaller training batch.

    Raises:
        ValueError: an argument is out of range.
        NotImplementedError: a training loader is asked for but ``train_dataset`` is not overridden.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> class Squares(GPUOptDataModule):
        ...     def train_dataset(self):
        ...         x = torch.arange(10.0).unsqueeze(1)
        ...         return TensorDataset(x, x**2)
        >>> dm = Squares(batch_size=4, num_workers=0)
        >>> [len(x) for x, _ in dm.train_dataloader()]
        [4, 4, 2]
    """

    def __init__(
        self,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int | Literal["auto"] = "auto",
        pin_memory: bool | Literal["auto"] = "auto",
        persistent_workers: bool = True,
        prefetch_factor: int = 2,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("eval_batch_size", eval_batch_size, allow_none=True)
        _check_positive_int("prefetch_factor", prefetch_factor)
        if num_workers != "auto" and (isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0):
            raise ValueError(f"`num_workers` must be 'auto' or an int >= 0, got {num_workers!r}")
        if pin_memory != "auto" and not isinstance(pin_memory, bool):
            raise ValueError(f"`pin_memory` must be 'auto', True or False, got {pin_memory!r}")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._datasets: dict[str, Dataset] = {}
        self._announced: set[str] = set()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Lightning runs a validation/test/predict loop when the *_dataloader hook is overridden. Expose
        # the base's loader only for stages whose dataset the subclass provides, so that a module with
        # no `val_dataset` gets no validation loop instead of an empty one, and keep loaders users wrote.
        for stage in _STAGES[1:]:
            name = f"{stage}_dataloader"
            ours = (getattr(GPUOptDataModule, name), getattr(pl.LightningDataModule, name))
            if any(name in k.__dict__ and k.__dict__[name] not in ours for k in cls.__mro__[: cls.__mro__.index(GPUOptDataModule)]):
                continue
            provided = getattr(cls, f"{stage}_dataset") is not getattr(GPUOptDataModule, f"{stage}_dataset")
            setattr(cls, name, ours[0] if provided else ours[1])

    # Datasets: what subclasses override.

    def train_dataset(self) -> Dataset:
        """The training dataset (required): a torch ``Dataset`` or ``IterableDataset``."""
        raise NotImplementedError(
            f"{type(self).__name__} must override `train_dataset(self)` to return the training Dataset "
            "(a subclass of GPUOptDataModule provides its datasets through `train_dataset`, `val_dataset`, ...)."
        )

    def val_dataset(self) -> Dataset | None:
        """The validation dataset, if any."""
        return None

    def test_dataset(self) -> Dataset | None:
        """The test dataset, if any."""
        return None

    def predict_dataset(self) -> Dataset | None:
        """The prediction dataset, if any."""
        return None

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """The collate function for every loader; ``None`` uses PyTorch's default."""
        return None

    # Loaders: what Lightning calls.

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")

    # Resolved settings.

    def resolved_num_workers(self) -> int:
        """The worker count loaders use now (``num_workers`` with ``"auto"`` resolved)."""
        if self.num_workers != "auto":
            return self.num_workers
        devices = self._local_devices()
        value = auto_num_workers(_available_cpus(), devices)
        self._announce(
            "num_workers",
            f"GPUOptDataModule: num_workers='auto' -> {value} ({_available_cpus()} CPUs for {devices} local "
            f"device(s), one kept for the main process, at most {_MAX_AUTO_WORKERS}); set `num_workers` to override.",
        )
        return value

    def resolved_pin_memory(self) -> bool:
        """Whether loaders pin host memory now (``pin_memory`` with ``"auto"`` resolved)."""
        if self.pin_memory != "auto":
            return self.pin_memory
        value = self._on_cuda()
        self._announce("pin_memory", f"GPUOptDataModule: pin_memory='auto' -> {value} (training on {'CUDA' if value else 'CPU'}).")
        return value

    def _loader(self, stage: str) -> DataLoader:
        dataset = self._dataset(stage)
        train = stage == "train"
        batch_size = self.batch_size if train or self.eval_batch_size is None else self.eval_batch_size
        _check_positive_int("batch_size", batch_size)
        workers = self.resolved_num_workers()
        kwargs: dict[str, Any] = {}
        if workers > 0:
            kwargs.update(persistent_workers=self.persistent_workers, prefetch_factor=self.prefetch_factor)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=train and self.shuffle and not isinstance(dataset, IterableDataset),
            drop_last=train and self.drop_last,
            num_workers=workers,
            pin_memory=self.resolved_pin_memory(),
            collate_fn=self.collate_fn(),
            **kwargs,
        )

    def _dataset(self, stage: str) -> Dataset:
        if stage not in self._datasets:
            dataset = getattr(self, f"{stage}_dataset")()
            if dataset is None:
                raise ValueError(
                    f"{type(self).__name__}.{stage}_dataset() returned None; return a torch Dataset, "
                    f"or do not override `{stage}_dataset` when there is no {stage} data."
                )
            if not isinstance(dataset, (Dataset, IterableDataset)) and not hasattr(dataset, "__getitem__"):
                raise TypeError(
                    f"{type(self).__name__}.{stage}_dataset() must return a torch Dataset, got {type(dataset).__name__}"
                )
            self._datasets[stage] = dataset
        return self._datasets[stage]

    def _local_devices(self) -> int:
        trainer = self.trainer
        if trainer is not None:
            return max(1, trainer.num_devices)
        return max(1, torch.cuda.device_count())

    def _on_cuda(self) -> bool:
        trainer = self.trainer
        if trainer is not None:
            return trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()

    def _announce(self, key: str, message: str) -> None:
        if key not in self._announced:
            self._announced.add(key)
            rank_zero_info(message)
