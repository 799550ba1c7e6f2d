"""GPUOptDataModule: subclass it, return datasets, and get tuned DataLoaders."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from lightning_gpuopt import _compat
from lightning_gpuopt._validate import choice, positive_int
from lightning_gpuopt.data.cpus import MAX_AUTO_WORKERS, auto_num_workers, available_cpus, cpus_reason
from lightning_gpuopt.data.prefetch import (
    BatchTransfer,
    CudaStreamTransfer,
    DevicePrefetchLoader,
    PrefetchStats,
)
from lightning_gpuopt.data.resume import (
    EVALUATION_EPOCH,
    ResumableSampler,
    SeededSamples,
    declare_resumable,
    elastic_size,
)
from lightning_gpuopt.data.stream import ShardedStream, StreamPositions, restart_line
from lightning_gpuopt.data.token_batches import LongSamples, SeededBatches, TokenBatchSampler, sample_length

__all__ = ["GPUOptDataModule", "auto_num_workers", "available_cpus"]

_STAGES = ("train", "val", "test", "predict")
# Hooks that see a batch before Lightning moves it: with device prefetch they would get it on the device.
_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device")


def _run_seed() -> int:
    """The run's global seed (``seed_everything``'s), 0 without one."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class GPUOptDataModule(pl.LightningDataModule):
    """A LightningDataModule base that builds tuned DataLoaders from the datasets a subclass returns.

    Override :meth:`train_dataset` and, as needed, :meth:`val_dataset`, :meth:`test_dataset` and
    :meth:`predict_dataset`. The base builds each loader when Lightning asks for it, reading
    ``batch_size`` at that moment, so a changed ``batch_size`` applies to the next loader built.
    Stages without a dataset are reported to Lightning as absent (no validation loop runs).
    Each dataset method is called once; the dataset is reused for later loaders.

    On CUDA the loaders also copy the next batch to the device while the current step computes
    (:attr:`device_prefetch_bytes` is the memory this holds). Every ``"auto"`` is logged once with its
    value and reason. docs/data.md has the long form.

    Args:
        batch_size: samples per device per step (what the DataLoader yields).
        eval_batch_size: batch size of validation/test/predict loaders; defaults to ``batch_size``.
        num_workers: loader worker processes per device, or ``"auto"``: from the CPUs this process may use
            and the local devices, at most 8.
        pin_memory: page-locked host batches for fast, asynchronous copies to the GPU, or ``"auto"``: on
            when training runs on CUDA.
        persistent_workers: keep workers alive between epochs (only with ``num_workers > 0``).
        prefetch_factor: batches each worker loads ahead (only with ``num_workers > 0``).
        shuffle: shuffle the training data each epoch.
        drop_last: drop the last, smaller training batch.
        device_prefetch: copy the next batch to the device while the current step computes, or
            ``"auto"``: on when training runs on CUDA, unless a batch-transfer hook is overridden.
        resumable: the training loader of a map-style dataset resumes exactly mid-epoch, in the order the
            uninterrupted run used, random augmentation included (docs/resume.md). ``False``: PyTorch's own
            samplers and worker seeds.
        max_tokens: training batches by tokens instead of samples: each holds at most this many padded tokens
            (its size times its longest sample), samples of similar length together, the same batch count on
            every rank and in every epoch (:class:`~lightning_gpuopt.data.token_batches.TokenBatchSampler`).
            ``batch_size`` then sizes the evaluation loaders only. Lengths come from :meth:`sample_lengths`.
            ``"auto"``: ``MemoryAwareBatchSize`` chooses it from memory at fit start. ``None``: batches of
            ``batch_size`` samples.
        long_samples: with ``max_tokens``, a sample longer than it is refused at setup (``"refuse"``), gets a
            batch of its own (``"alone"``), or is cut to its first ``max_tokens`` tokens (``"truncate"``: every
            tensor's first dimension and list of ints in the sample).

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
        device_prefetch: bool | Literal["auto"] = "auto",
        resumable: bool = True,
        max_tokens: int | Literal["auto"] | None = None,
        long_samples: LongSamples = "refuse",
    ) -> None:
        super().__init__()
        positive_int("batch_size", batch_size)
        positive_int("eval_batch_size", eval_batch_size, allow_none=True)
        positive_int("prefetch_factor", prefetch_factor)
        if num_workers != "auto" and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
        ):
            raise ValueError(f"`num_workers` must be 'auto' or an int >= 0, got {num_workers!r}")
        if pin_memory != "auto" and not isinstance(pin_memory, bool):
            raise ValueError(f"`pin_memory` must be 'auto', True or False, got {pin_memory!r}")
        if device_prefetch != "auto" and not isinstance(device_prefetch, bool):
            raise ValueError(f"`device_prefetch` must be 'auto', True or False, got {device_prefetch!r}")
        if not isinstance(resumable, bool):
            raise ValueError(f"`resumable` must be True or False, got {resumable!r}")
        if max_tokens not in ("auto", None) and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(
                "`max_tokens` must be a positive int (padded tokens a batch), 'auto' (chosen from memory) or None, "
                f"got {max_tokens!r}"
            )
        choice("long_samples", long_samples, LongSamples)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.device_prefetch = device_prefetch
        self.resumable = resumable
        self.max_tokens = max_tokens
        self.long_samples = long_samples
        self._train_sampler: ResumableSampler | None = None
        self._resume_from: dict[str, Any] | None = None
        #: The seed of the checkpoint a resume loaded (the run's global seed otherwise).
        self._resume_seed: int | None = None
        #: The resumed epoch, its samples consumed before this run, and the fit loop's batch count then.
        self._consumed_from = (-1, 0, 0)
        #: The resumed epoch's length is not a whole epoch's: the loader is built again for the next one.
        self._rebuild_after_resume = False
        #: On a resume on another number of ranks: keep the optimizer batch (``"keep_optimizer_batch"``) or the
        #: per-rank batch size (``"keep_per_rank"``). ``ExactResume(elastic=...)`` sets it at setup.
        self.elastic = "keep_optimizer_batch"
        #: What the last resume did with the data's state (``"data"``, ``"batch_size"``): the report lists it.
        self.resume_notes: dict[str, str] = {}
        self._configured_batch_size = batch_size
        self._configured_max_tokens = max_tokens
        #: A training IterableDataset with no state of its own: its batch size and world size (else ``None``).
        self._stream: dict[str, Any] | None = None
        #: Such a stream's place in the checkpoint a resume loaded.
        self._stream_resumed: dict[str, Any] | None = None
        self._loader_batch_size = batch_size
        self._datasets: dict[str, Dataset] = {}
        self._announced: set[str] = set()
        self._read_lengths: dict[int, list[int]] = {}
        self._prefetch_stats: dict[str, PrefetchStats] = {}

    def __getattr__(self, name: str) -> Any:
        # Only reached when the ordinary lookup fails: without `_datasets`, this base's __init__ never ran.
        if not name.startswith("__") and "_datasets" not in vars(self):
            owner = type(self).__name__
            missing = "" if name.startswith("_") else f" (so it has no `{name}`)"
            raise AttributeError(  # obj=None: no "Did you mean" guess after the message
                f"{owner}.__init__ did not call GPUOptDataModule.__init__{missing}: add "
                f"`super().__init__(batch_size=...)`, with the loader options it takes, to {owner}.__init__.",
                name=name,
                obj=None,
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Lightning runs a validation/test/predict loop when the *_dataloader hook is overridden. Expose
        # the base's loader only for stages whose dataset the subclass provides, so that a module with
        # no `val_dataset` gets no validation loop instead of an empty one, and keep loaders users wrote.
        for stage in _STAGES[1:]:
            name = f"{stage}_dataloader"
            ours = (getattr(GPUOptDataModule, name), getattr(pl.LightningDataModule, name))
            if any(
                name in k.__dict__ and k.__dict__[name] not in ours
                for k in cls.__mro__[: cls.__mro__.index(GPUOptDataModule)]
            ):
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

    def sample_lengths(self, dataset: Dataset) -> Sequence[int]:
        """Each training sample's length in tokens, for ``max_tokens``: the dataset's ``lengths`` attribute, else
        read once from every sample (:func:`~lightning_gpuopt.data.token_batches.sample_length`) and kept (the
        ``max_tokens="auto"`` search and the loader both ask). Override it where loading every sample is slow or
        the length is elsewhere."""
        lengths = getattr(dataset, "lengths", None)
        if lengths is not None:
            return lengths
        if id(dataset) not in self._read_lengths:  # the datasets are kept: their ids stay theirs
            self._read_lengths[id(dataset)] = [sample_length(dataset[i], i) for i in range(len(dataset))]  # type: ignore[arg-type]
        return self._read_lengths[id(dataset)]

    def stage_dataset(self, stage: str = "train") -> Dataset:
        """The dataset ``stage``'s loader reads (``"train"``, ``"val"``, ``"test"``, ``"predict"``), built once and kept."""
        return self._dataset(stage)

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
        value = auto_num_workers(available_cpus(), devices)
        self._announce(
            f"num_workers={value}",
            f"GPUOptDataModule: num_workers='auto' -> {value} ({cpus_reason()} for {devices} local "
            f"device(s), one kept for the main process, at most {MAX_AUTO_WORKERS}); set `num_workers` to override.",
        )
        return value

    def resolved_pin_memory(self) -> bool:
        """Whether loaders pin host memory now (``pin_memory`` with ``"auto"`` resolved)."""
        if self.pin_memory != "auto":
            return self.pin_memory
        value = self._on_cuda()
        self._announce(
            f"pin_memory={value}",
            f"GPUOptDataModule: pin_memory='auto' -> {value} (training on {'CUDA' if value else 'CPU'}); "
            "set `pin_memory` to override.",
        )
        return value

    def resolved_device_prefetch(self) -> bool:
        """Whether loaders copy batches to the device ahead of use now (``device_prefetch`` with ``"auto"`` resolved).

        ``True`` only where there is something to do: a Trainer attached that trains on CUDA.
        """
        device = self._root_device()
        on_cuda = device is not None and device.type == "cuda"
        if self.device_prefetch != "auto":
            return self.device_prefetch and on_cuda
        if device is None:
            value, why = False, "no Trainer attached: loaders yield host batches"
        elif not on_cuda:
            value, why = False, f"training on {device.type}"
        elif hook := self._transfer_hook_overridden():
            value, why = (
                False,
                f"`{hook}` is overridden and would see device batches; batches are moved when used",
            )
        else:
            value, why = (
                True,
                (
                    f"training on {device}: the next batch is copied on a side CUDA stream while the current step "
                    "computes; `device_prefetch_bytes` tells the device memory it holds"
                ),
            )
        self._announce(
            f"device_prefetch={value}",
            f"GPUOptDataModule: device_prefetch='auto' -> {value} ({why}); set `device_prefetch` to override.",
        )
        return value

    @property
    def prefetched_batch_bytes(self) -> int:
        """Device bytes of the largest training batch device prefetch has copied (0 before any, or when off)."""
        stats = self._prefetch_stats.get("train")
        return 0 if stats is None or stats.disabled else stats.max_batch_bytes

    @property
    def device_prefetch_bytes(self) -> int:
        """Device memory training-batch prefetch holds beyond the batch in the training step, in bytes.

        ``batches ahead × prefetched_batch_bytes``: one batch in flight (two for a loader without a
        length, which Lightning reads one ahead). It scales with ``batch_size``; a memory budget
        reserves it (bytes per sample: ``device_prefetch_bytes / batch_size``). 0 when device prefetch
        is off, has copied nothing yet, or was turned off by an out-of-memory error.
        """
        stats = self._prefetch_stats.get("train")
        return 0 if stats is None else stats.reserved_bytes

    def _loader(self, stage: str) -> DataLoader:
        dataset = self._dataset(stage)
        train = stage == "train"
        batch_size = self.batch_size if train or self.eval_batch_size is None else self.eval_batch_size
        positive_int("batch_size", batch_size)
        workers = self.resolved_num_workers()
        kwargs: dict[str, Any] = {}
        if workers > 0:
            kwargs.update(persistent_workers=self.persistent_workers, prefetch_factor=self.prefetch_factor)
        kwargs.update(
            batch_size=batch_size,
            shuffle=train and self.shuffle and not isinstance(dataset, IterableDataset),
            drop_last=train and self.drop_last,
            num_workers=workers,
            pin_memory=self.resolved_pin_memory(),
            collate_fn=self.collate_fn(),
        )
        if (
            train and isinstance(dataset, IterableDataset) and not isinstance(dataset, ShardedStream)
        ):  # its own state_dict, if any, is not kept: the loader's workers hold where it is, not this copy
            self._say_stream_restarts(dataset, kwargs["batch_size"])
        if train and isinstance(dataset, ShardedStream) and self.max_tokens is None:
            sizes = (self._resume_from or {}).get(
                "shard_sizes"
            )  # a checkpoint's: the shards are not counted again
            dataset = StreamPositions.of(dataset, self._seed(), shuffle=self.shuffle, sizes=sizes)
        if train and self.max_tokens is not None:
            dataset, kwargs = self._token_train(dataset, kwargs)
        elif (
            train
            and (self.resumable or isinstance(dataset, StreamPositions))
            and not isinstance(dataset, IterableDataset)
        ):
            dataset, kwargs = self._resumable_train(dataset, kwargs)
        elif not train and self.resumable and not isinstance(dataset, IterableDataset):
            dataset, kwargs = self._seeded_evaluation(dataset, kwargs)
        transfer = self._batch_transfer(stage)
        if transfer is None:
            # Lightning moves each batch when it is used, non-blocking on CUDA (its `move_data_to_device`).
            loader = DataLoader(dataset, **kwargs)
        else:
            stats = self._prefetch_stats.setdefault(stage, PrefetchStats())
            stats.disabled = False  # a new loader gets a new chance after an out-of-memory fallback
            loader = DevicePrefetchLoader(dataset, transfer=transfer, prefetch_stats=stats, **kwargs)
        declare_resumable(
            loader
        )  # a ResumableSampler's loader: Lightning need not warn on a mid-epoch resume
        return loader

    # Exact resume: the training loader's place in the epoch.

    def state_dict(self) -> dict[str, Any]:
        """Where the training loader stands: epoch, batches the training loop consumed, batch size and seed.

        Batches consumed are the Trainer's count of batches whose training step ran, not the batches the
        loader has read: workers, Lightning and device prefetch read ahead of the step.
        """
        sampler, trainer = self._train_sampler, self.trainer
        loop = getattr(trainer, "fit_loop", None)
        progress = loop.epoch_loop.batch_progress if loop is not None else None
        consumed = int(progress.current.processed) if progress is not None else 0
        if self._stream is not None:  # a stream with no state: where it was, to say what a resume repeats
            ended = progress is not None and bool(progress.is_last_batch)
            return {"stream": {**self._stream, "batches": 0 if ended else consumed}}
        if sampler is None or not self.resumable:
            return {}
        epoch = int(sampler.epoch)
        if loop is not None and consumed >= trainer.num_training_batches:  # the epoch is over: the next one
            epoch, consumed = epoch + 1, 0
        if isinstance(sampler, TokenBatchSampler):
            size: dict[str, Any] = {
                "max_tokens": sampler.max_tokens,
                "configured_max_tokens": self._configured_max_tokens,
            }
        else:
            # Samples of the epoch's order consumed on all ranks: those before a resume, and this run's batches since.
            resumed_epoch, base, base_batches = self._consumed_from
            if resumed_epoch != epoch:
                base, base_batches = 0, 0
            samples = base + (consumed - base_batches) * int(self._loader_batch_size) * int(
                sampler.num_replicas
            )
            size = {
                "batch_size": int(self._loader_batch_size),
                "samples": samples if consumed else 0,
                "configured_batch_size": int(self._configured_batch_size),
            }
            stream = self._datasets.get("train")
            if isinstance(stream, ShardedStream):
                size["shard_sizes"] = stream.sizes()
        return {
            "train_loader": {
                "epoch": epoch,
                "batches": consumed,
                **size,
                "seed": int(sampler.seed),
                "world_size": int(sampler.num_replicas),
            }
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training loader where :meth:`state_dict` says (applied when the training loader is built)."""
        state = state_dict.get("train_loader")
        self._resume_from = dict(state) if state else None
        self._resume_seed = int(state["seed"]) if state and "seed" in state else None
        self._stream_resumed = dict(state_dict.get("stream") or {}) or None
        if self._resume_from:
            self._keep_optimizer_batch(self._resume_from)
        if self._resume_from and self._train_sampler is not None:
            # The loader was built before the checkpoint was loaded (strategies that restore after setup, with a
            # schedule reading estimated_stepping_batches): the fit loop builds it again, as resumed.
            loop = getattr(self.trainer, "fit_loop", None)
            if loop is not None:
                _compat.drop_train_loader(loop)
            else:
                self._apply_resume(self._train_sampler)

    def _keep_optimizer_batch(self, resume: dict[str, Any]) -> None:
        """On a resume on another number of ranks, the per-rank ``batch_size`` (``max_tokens`` for token batches)
        that :func:`~lightning_gpuopt.data.resume.elastic_size` gives, said in one line."""
        world = int(getattr(self.trainer, "world_size", 1) or 1)
        before_world = int(resume.get("world_size", world))
        name = "max_tokens" if "max_tokens" in resume else "batch_size"
        current = getattr(self, name)
        if before_world == world or resume.get(name) is None or not isinstance(current, int):
            return  # the same ranks; or max_tokens chosen from this run's memory ('auto')
        configured = resume.get(f"configured_{name}")
        mine = self._configured_max_tokens if name == "max_tokens" else self._configured_batch_size
        size, note, line = elastic_size(
            name,
            int(resume[name]),
            before_world,
            world,
            current,
            given=configured is not None and configured != mine,
            keep_per_rank=self.elastic == "keep_per_rank",
        )
        setattr(self, name, size)
        self.resume_notes[name] = note
        rank_zero_info(f"GPUOptDataModule: {line}")

    def _say_stream_restarts(self, dataset: IterableDataset, batch_size: int) -> None:
        """A training stream the pack cannot resume (an IterableDataset other than a ShardedStream): say once what a
        mid-epoch resume does, and on such a resume, how many samples it repeats."""
        world = int(getattr(self.trainer, "world_size", 1) or 1)
        self._stream = {"batch_size": int(batch_size), "world_size": world}
        resumed, self._stream_resumed = self._stream_resumed, None
        line = restart_line(type(dataset).__name__, resumed, int(batch_size), world)
        if resumed and int(resumed.get("batches", 0)) > 0:
            rank_zero_info(line)
        else:
            self._announce("stream", line)

    def _resumable_train(self, dataset: Dataset, kwargs: dict[str, Any]) -> tuple[Dataset, dict[str, Any]]:
        trainer = self.trainer
        world = int(getattr(trainer, "world_size", 1) or 1)
        rank = int(getattr(trainer, "global_rank", 0) or 0)
        seed = self._seed()
        sampler = ResumableSampler(
            dataset, num_replicas=world, rank=rank, shuffle=bool(kwargs.pop("shuffle")), seed=seed
        )
        self._loader_batch_size = kwargs["batch_size"]
        return SeededSamples(dataset, seed=seed), self._placed(sampler, kwargs)

    def _token_train(self, dataset: Dataset, kwargs: dict[str, Any]) -> tuple[Dataset, dict[str, Any]]:
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                f"max_tokens needs a map-style training dataset (lengths known before the epoch); "
                f"{type(self).__name__}.train_dataset() returned an IterableDataset: batch it yourself, or pass "
                "max_tokens=None"
            )
        if self.max_tokens == "auto":
            raise ValueError(
                "max_tokens='auto' is chosen from memory by MemoryAwareBatchSize at fit start: add "
                "MemoryAwareBatchSize() to the Trainer's callbacks, or give max_tokens an int"
            )
        lengths = self.sample_lengths(dataset)
        if len(lengths) != len(dataset):  # type: ignore[arg-type]
            raise ValueError(
                f"sample_lengths gave {len(lengths)} lengths for {len(dataset)} training samples "  # type: ignore[arg-type]
                "(one int per sample expected)"
            )
        trainer = self.trainer
        seed = self._seed()
        sampler = TokenBatchSampler(
            lengths,
            self.max_tokens,  # type: ignore[arg-type]
            num_replicas=int(getattr(trainer, "world_size", 1) or 1),
            rank=int(getattr(trainer, "global_rank", 0) or 0),
            shuffle=bool(kwargs.pop("shuffle")),
            seed=seed,
            long_samples=self.long_samples,
        )
        kwargs.pop("drop_last")
        kwargs.update(batch_size=None, collate_fn=kwargs["collate_fn"] or default_collate)
        cut = self.max_tokens if self.long_samples == "truncate" else None
        return SeededBatches(SeededSamples(dataset, seed=seed), truncate_to=cut), self._placed(
            sampler, kwargs
        )

    def _seed(self) -> int:
        """The training order's seed: the checkpoint's on a resume, the run's global seed otherwise."""
        return self._resume_seed if self._resume_seed is not None else _run_seed()

    def _placed(self, sampler: ResumableSampler, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The training loader's sampler at the epoch (and place) the fit loop runs next, and its generator."""
        self._train_sampler = sampler
        trainer = self.trainer
        # Lightning builds the loader's first iterator before it sets the sampler's epoch, and a loader with
        # workers draws its indices then: the sampler must already be at the epoch the fit loop runs next
        # (on a resume past epoch 0 it would otherwise deal epoch 0's order from the resumed offset). On a
        # resume that epoch is the checkpoint's: a schedule reading `estimated_stepping_batches` builds this
        # loader before Lightning restores its loops' progress.
        loop = getattr(trainer, "fit_loop", None)
        if self._resume_from:
            self._apply_resume(sampler)
        elif loop is not None:
            sampler.set_epoch(int(loop.epoch_progress.current.processed))
        # The loader's own generator draws the workers' base seed, so building an iterator leaves the
        # global RNG (dropout's stream) where it was.
        generator = torch.Generator().manual_seed(sampler.seed)
        return {**kwargs, "sampler": sampler, "generator": generator}

    def _seeded_evaluation(self, dataset: Dataset, kwargs: dict[str, Any]) -> tuple[Dataset, dict[str, Any]]:
        """An evaluation loader that leaves training's random streams alone, whatever its workers.

        Loading in the main process would draw from the streams dropout uses, and each new iterator draws its
        workers' base seed from the global generator unless the loader has one: the training step would then
        draw other numbers with other worker settings (count, persistence) or after a resume. Samples load
        under seeds from (seed, index), so random evaluation transforms also repeat from one validation to the
        next and do not depend on the workers.
        """
        seed = _run_seed()
        generator = torch.Generator().manual_seed(seed)
        return SeededSamples(dataset, seed=seed, epoch=EVALUATION_EPOCH), {**kwargs, "generator": generator}

    def _apply_resume(self, sampler: ResumableSampler) -> None:
        """Start the resumed epoch where the checkpoint stopped: past the samples it consumed, on any number of ranks
        (token batches: past this rank's batches on the same number, from its beginning otherwise). The loader's
        length in that epoch is the fit loop's restored batch count plus the batches left, as Lightning counts."""
        resume = self._resume_from or {}
        world = int(resume.get("world_size", sampler.num_replicas))
        epoch = int(resume.get("epoch", 0))
        batches = int(resume.get("batches", 0))
        tokens = sampler.max_tokens if isinstance(sampler, TokenBatchSampler) else None
        sampler.set_epoch(epoch)
        sampler.skip(epoch, 0)  # a whole epoch (and no skip an earlier call left)
        whole = len(sampler)
        if resume.get("max_tokens") != tokens or (tokens is not None and world != sampler.num_replicas):
            why = (
                f"the checkpoint was written by {world} rank(s), this run has {sampler.num_replicas}"
                if world != sampler.num_replicas
                else f"the checkpoint's batches held max_tokens={resume.get('max_tokens')}, this run's max_tokens={tokens}"
            )
            rank_zero_info(
                f"GPUOptDataModule: {why}; the interrupted epoch restarts from its beginning (the batches differ), and "
                f"the samples of its first {batches} batch(es) are trained on twice."
            )
            sampler.skip(epoch, 0, counted=batches * (1 if tokens else int(self._loader_batch_size)))
            self.resume_notes["data"] = f"epoch {epoch} restarted: {why}"
        elif tokens is not None:  # this rank's batches of a token sampler, on the same number of ranks
            if batches >= whole:  # an epoch-end checkpoint whose state does not say the epoch is over
                epoch, batches = epoch + 1, 0
                sampler.set_epoch(epoch)
            sampler.skip(epoch, batches)
            self.resume_notes["data"] = f"exact: epoch {epoch} past this rank's {batches} batch(es)"
        else:
            # Samples of the epoch's order consumed on all the checkpoint's ranks: one window of it, whatever the ranks.
            consumed = int(
                resume.get("samples", batches * int(resume.get("batch_size", self.batch_size)) * world)
            )
            if consumed >= len(sampler.dataset):  # type: ignore[arg-type]  # an epoch-end checkpoint
                epoch, consumed, batches = epoch + 1, 0, 0
                sampler.set_epoch(epoch)
            self._consumed_from = (epoch, consumed, batches)
            if world != sampler.num_replicas:
                where = f"goes on past the {consumed} sample(s) it consumed" if consumed else "starts"
                rank_zero_info(
                    f"GPUOptDataModule: the checkpoint was written by {world} rank(s), this run has "
                    f"{sampler.num_replicas}; the epoch {where}, dealt over {sampler.num_replicas} rank(s)."
                )
            sampler.skip(epoch, consumed, counted=batches * int(self._loader_batch_size))
            self.resume_notes["data"] = (
                f"exact: epoch {epoch} past the {consumed} sample(s) of its order consumed on {world} rank(s), dealt "
                f"over {sampler.num_replicas}"
            )
        self._rebuild_after_resume = len(sampler) != whole
        callbacks = getattr(self.trainer, "callbacks", None)
        if isinstance(callbacks, list) and not any(
            isinstance(c, _ResumedEpochEnd) and c.datamodule is self for c in callbacks
        ):
            callbacks.append(_ResumedEpochEnd(self))

    def _end_resumed_epoch(self, trainer: pl.Trainer) -> None:
        """The resumed epoch is over: later loaders start epochs whole, and one whose length in that epoch was not
        a whole epoch's is built again for the next (Lightning counts a loader's batches when it builds it)."""
        if self._resume_from is None:
            return
        self._resume_from = None
        if self._rebuild_after_resume:
            self._rebuild_after_resume = False
            _compat.drop_train_loader(trainer.fit_loop)

    def _batch_transfer(self, stage: str) -> BatchTransfer | None:
        """How batches of ``stage`` reach the device ahead of use; ``None``: Lightning moves each when used."""
        if not self.resolved_device_prefetch():
            return None
        return CudaStreamTransfer(self._root_device())

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

    def _root_device(self) -> torch.device | None:
        trainer = self.trainer
        return None if trainer is None else trainer.strategy.root_device

    def _transfer_hook_overridden(self) -> str | None:
        module = getattr(self.trainer, "lightning_module", None)
        for hook in _TRANSFER_HOOKS:
            if module is not None and is_overridden(hook, module, parent=pl.LightningModule):
                return f"{type(module).__name__}.{hook}"
            if is_overridden(hook, self, parent=pl.LightningDataModule):
                return f"{type(self).__name__}.{hook}"
        return None

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


class _ResumedEpochEnd(pl.Callback):
    """Ends a :class:`GPUOptDataModule`'s resumed epoch at its ``on_train_epoch_end`` (added by the datamodule to the
    Trainer's callbacks on a resume)."""

    def __init__(self, datamodule: GPUOptDataModule) -> None:
        self.datamodule = datamodule

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.datamodule._end_resumed_epoch(trainer)
