"""MemoryAwareBatchSize: measure what a batch costs, pick the largest micro-batch (or batch) that fits the memory budget.

The callback holds the hooks, the arguments, the state and the agreement across ranks; the search itself
(trial steps, the pure size search) lives in :mod:`lightning_gpuopt.batch_size`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.data import IterableDataset, default_collate

from lightning_gpuopt import _compat
from lightning_gpuopt._metrics import log_metrics
from lightning_gpuopt._warnings import warn
from lightning_gpuopt.batch_size.eval_size import evaluation_runner, find_eval_batch_size
from lightning_gpuopt.batch_size.find import SearchRun, find_largest_size, no_fit_message
from lightning_gpuopt.batch_size.modes import (
    SearchSpace,
    batches_ahead,
    max_mode_space,
    micro_mode_space,
    scale_learning_rate,
)
from lightning_gpuopt.batch_size.search import SearchResult
from lightning_gpuopt.batch_size.token_search import TokenSearchRun, search_max_tokens
from lightning_gpuopt.batch_size.trial import NoLossInTrial, local_bytes
from lightning_gpuopt.batch_split import UnsplittableBatchError, batch_size_of
from lightning_gpuopt.data import TokenBatchSampler
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory import MemoryProbe, format_bytes, get_probe
from lightning_gpuopt.microbatch import EngineState, MicroBatchEngine, MicroBatchOOMError, MicroBatchUser
from lightning_gpuopt.refusals import setup_refusal
from lightning_gpuopt.support import Feature, StrategyKind, strategy_kind, supports
from lightning_gpuopt.votes import Source

__all__ = ["MemoryAwareBatchSize"]

#: How many training batches in a row the step may skip (return ``None``) before the micro-batch search gives up.
MAX_DEFERRED = 16

_MODES = ("micro", "max")
_LR_RULES = (None, "linear", "sqrt")


def _check_size(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int{' or None' if allow_none else ''}, got {value!r}")


class MemoryAwareBatchSize(MicroBatchUser, Callback):
    """Picks the largest micro-batch (``mode="max"``: batch size) whose real training step fits the memory budget.

    At the first training batch a few real training steps (at most four) measure the peak at a few sizes and leave no trace; each batch then runs as k = ceil(batch_size / n)
    micro-batches, the optimizer batch kept. ``mode="max"`` sets ``batch_size`` itself (the optimizer batch
    changes; it says so). Every rank uses the smallest answer; ``state_dict`` keeps it. Long form: docs/batch-size.md.

    With a ``GPUOptDataModule`` that batches by tokens, the batches differ in shape and no micro-batch size in
    samples fits them all: there is no micro-batch search. ``max_tokens="auto"`` is chosen at fit start instead,
    from a few measured shapes (:mod:`~lightning_gpuopt.batch_size.token_search`), so that the costliest batch
    fits; ``state_dict`` keeps it (a resumed run runs the same batches).

    With a ``GPUOptDataModule`` whose ``eval_batch_size`` is not given (and that does not batch by tokens), the
    evaluation batch is sized after the first search from measured validation steps
    (:mod:`~lightning_gpuopt.batch_size.eval_size`); give ``eval_batch_size`` to choose it yourself.

    Args:
        mode: ``"micro"`` (the micro-batch size) or ``"max"`` (``batch_size`` itself).
        target_fraction: share of this process's device memory a step may take at its peak, in (0, 1].
        multiple_of: round answers down to a multiple of it; ``None``: 8 on CUDA, 1 elsewhere.
        min_batch_size: the smallest (micro-)batch allowed; if even it does not fit, fitting fails.
        max_batch_size: the largest to consider; ``None``: the batch size (``"micro"``), the dataset's share per device.
        lr_scaling: ``mode="max"`` only: ``"linear"`` or ``"sqrt"`` scales the learning rate with the batch size.
        verbose: log the result once on rank zero.
        predict: deprecated and ignored (the search measures real steps only); removed in the next release.

    Raises:
        ValueError: an argument is out of range.
        RuntimeError: at ``setup``/``on_fit_start``, a setup it cannot measure; the message names the alternative.
        MicroBatchOOMError: even ``min_batch_size`` does not fit; the message has the measured breakdown.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
        >>> from torch.utils.data import DataLoader
        >>> from lightning_gpuopt.testing import SimulatedMemory
        >>> finder = MemoryAwareBatchSize()
        >>> trainer = Trainer(max_steps=2, callbacks=[finder], logger=False, enable_checkpointing=False,
        ...     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        >>> with SimulatedMemory(limit_bytes=64 * 2**20):  # a 64 MiB "GPU" on the CPU
        ...     trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 256), batch_size=64))
        >>> finder.micro_batch_size, finder.k, finder.trials
        (64, 1, 4)
    """

    def __init__(
        self,
        mode: str = "micro",
        target_fraction: float = 0.9,
        multiple_of: int | None = None,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        lr_scaling: str | None = None,
        verbose: bool = True,
        predict: bool | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}")
        if (
            isinstance(target_fraction, bool)
            or not isinstance(target_fraction, (int, float))
            or not 0 < target_fraction <= 1
        ):
            raise ValueError(f"`target_fraction` must be in (0, 1], got {target_fraction!r}")
        _check_size("multiple_of", multiple_of, allow_none=True)
        _check_size("min_batch_size", min_batch_size)
        _check_size("max_batch_size", max_batch_size, allow_none=True)
        if max_batch_size is not None and max_batch_size < min_batch_size:
            raise ValueError(
                f"`max_batch_size` must be >= `min_batch_size` ({min_batch_size}), got {max_batch_size}"
            )
        if lr_scaling not in _LR_RULES:
            raise ValueError(f"`lr_scaling` must be one of {_LR_RULES}, got {lr_scaling!r}")
        if lr_scaling is not None and mode != "max":
            raise ValueError(
                f"`lr_scaling` applies to mode='max' only (the optimizer batch changes), got mode={mode!r}"
            )
        self.mode = mode
        self.target_fraction = float(target_fraction)
        self.multiple_of = multiple_of
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.lr_scaling = lr_scaling
        self.verbose = verbose
        if predict is not None:
            warnings.warn(
                "MemoryAwareBatchSize(predict=...) is deprecated and ignored: the search measures real training "
                "steps only. Remove the argument; it goes in the next release.",
                DeprecationWarning,
                stacklevel=2,
            )
        #: The largest micro-batch that fits (``mode="max"``: the batch size chosen); ``None`` before a search.
        self.micro_batch_size: int | None = None
        #: The batch size the answer is for (``mode="max"``: the one set).
        self.batch_size: int | None = None
        #: The model's peak at ``micro_batch_size``, in bytes.
        self.predicted_peak_bytes: int | None = None
        #: Wall time of the last search, in seconds (``None``: no search yet on this process).
        self.search_seconds: float | None = None
        #: Real training steps the last search measured (0: none yet, or restored from a checkpoint); under FSDP2
        #: every rank runs as many, at the same sizes.
        self.trials = 0
        #: What a step may use at its peak, in bytes, at the last search.
        self.budget_bytes: int | None = None
        #: The last search's measurements and model (this process; not saved).
        self.result: SearchResult | None = None
        #: The ``max_tokens`` chosen for a ``GPUOptDataModule(max_tokens="auto")`` (``None``: none chosen).
        self.max_tokens: int | None = None
        #: The last token-budget search on this process (not saved).
        self.token_search: TokenSearchRun | None = None
        #: The evaluation batch size chosen for a ``GPUOptDataModule`` (``None``: none chosen in this fit).
        self.eval_batch_size: int | None = None
        self._k = 1
        self._precision: str | None = None
        self._lr_factor = 1.0
        self._world_size = 1  # this fit's ranks, saved: a resume on another number does not apply batch_size
        self._saved_world_size: int | None = None
        self._requested = False
        self._engine: MicroBatchEngine | None = None
        self._cap: int | None = None  # the largest micro-batch the engine may run, in this fit
        self._resolved_multiple = 1
        self._apply_pending = False
        self._run: SearchRun | None = None  # the last search on this process, for its messages
        self._deferred: tuple[str, int] | None = None  # a search put off: (why, batches skipped so far)

    # ------------------------------------------------------------------ what users read

    @property
    def k(self) -> int:
        """Micro-batches per training batch now in force."""
        return self._engine.k if self._engine is not None else self._k

    @property
    def prediction_note(self) -> str:
        """Deprecated: always ``""`` (the search no longer starts from a traced prediction); goes in the next release."""
        warnings.warn(
            "MemoryAwareBatchSize.prediction_note is deprecated and always '': the search measures real training "
            "steps only. It goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return ""

    def remeasure(self) -> None:
        """Measure again at the next training batch that starts an accumulation window."""
        self._requested = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "micro_batch_size": self.micro_batch_size,
            "batch_size": self.batch_size,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "budget_bytes": self.budget_bytes,
            "trials": self.trials,
            "precision": self._precision,
            "lr_factor": self._lr_factor,
            "max_tokens": self.max_tokens,
            "world_size": self._world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.micro_batch_size = state_dict.get("micro_batch_size")
        self.batch_size = state_dict.get("batch_size")
        self._k = int(state_dict.get("k", 1))
        self.predicted_peak_bytes = state_dict.get("predicted_peak_bytes")
        self.budget_bytes = state_dict.get("budget_bytes")
        self.trials = int(state_dict.get("trials", 0))
        self._precision = state_dict.get("precision")
        self._lr_factor = float(state_dict.get("lr_factor", 1.0))
        self._apply_pending = self.micro_batch_size is not None
        self.max_tokens = state_dict.get("max_tokens")
        self._saved_world_size = state_dict.get("world_size")

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        EngineState.ensure(trainer)
        strategy = trainer.strategy
        answer = supports(Feature.BATCH_SIZE_SEARCH, strategy)
        if not answer.supported:
            raise RuntimeError(
                f"MemoryAwareBatchSize measures single-device, DDP and FSDP2 training, got {type(strategy).__name__} "
                f"({answer.reason})."
            )
        refusal = setup_refusal(Feature.BATCH_SIZE_SEARCH, trainer, pl_module)
        if refusal is not None:
            raise RuntimeError(refusal)
        if self.mode == "max" and not lightning_hasattr(pl_module, "batch_size"):
            raise RuntimeError(
                "MemoryAwareBatchSize(mode='max') sets `batch_size`, but neither the DataModule nor the "
                "LightningModule (nor its hparams) has one. Give the object whose `train_dataloader` builds the "
                "loader a `batch_size` attribute it reads, or use mode='micro'."
            )
        if self.mode == "max" and getattr(trainer.datamodule, "max_tokens", None) is not None:
            raise RuntimeError(
                "MemoryAwareBatchSize(mode='max') sets batch_size, which a GPUOptDataModule batching by tokens does "
                "not use for training: use mode='micro' (the default), with max_tokens='auto' to choose the budget."
            )
        device = strategy.root_device
        self._resolved_multiple = self.multiple_of or (8 if device.type == "cuda" else 1)
        self._world_size = int(trainer.world_size)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._engine = self._cap = None
        self.eval_batch_size = None
        if trainer.world_size > 1 and any(isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules()):
            # Checked here: Lightning converts BatchNorm layers (sync_batchnorm=True) after `setup`.
            raise RuntimeError(
                "MemoryAwareBatchSize cannot measure a model with SyncBatchNorm under a multi-process strategy: every "
                "forward synchronises across ranks, and each rank measures on its own. Use sync_batchnorm=False, or "
                "remove MemoryAwareBatchSize."
            )
        probe = get_probe(trainer.strategy.root_device)
        auto_tokens = getattr(trainer.datamodule, "max_tokens", None) == "auto"
        if probe.kind == "cpu" and auto_tokens:
            raise RuntimeError(
                "MemoryAwareBatchSize: max_tokens='auto' is chosen from device memory, and this fit runs on CPU without "
                "SimulatedMemory: give max_tokens an int."
            )
        if probe.kind == "cpu":
            rank_zero_info(
                "MemoryAwareBatchSize: training on CPU without SimulatedMemory, there is no device memory to measure; "
                "batch_size and micro-batches stay as they are."
            )
            return
        try:
            engine = MicroBatchEngine.attach(trainer, self)
        except RuntimeError as err:
            raise RuntimeError(f"MemoryAwareBatchSize: {err}") from None
        self._engine = engine
        engine.resume()  # k as the checkpoint saved it (once, by the engine)
        if auto_tokens:
            self._choose_max_tokens(trainer, pl_module, probe)
        if self.mode != "max":
            return
        if self.batch_size is not None and not self._requested:
            before, self._saved_world_size = self._saved_world_size, None  # a checkpoint's, read once
            if before is not None and int(before) != trainer.world_size:
                # Resumed on another number of ranks: the datamodule keeps the optimizer batch (or the policy's
                # per-rank size); a batch that no longer fits is split into micro-batches, as any other.
                self.batch_size = lightning_getattr(pl_module, "batch_size")
                rank_zero_info(
                    f"MemoryAwareBatchSize: resumed on {trainer.world_size} rank(s) from a checkpoint of {before}: "
                    f"batch_size {self.batch_size} per rank as the data set it, not the searched size."
                )
                return
            lightning_setattr(
                pl_module, "batch_size", self.batch_size
            )  # resumed: the size it had, applied at batch 0
            return
        self._search_batch_size(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        if engine is None or batch_idx % trainer.accumulate_grad_batches != 0:
            return
        if getattr(trainer.datamodule, "max_tokens", None) is not None:
            return  # batches by tokens: no size in samples fits them all (the budget was chosen at fit start)
        precision = _precision_of(trainer)
        switched = self._precision is not None and precision != self._precision
        if (
            self._requested
            or switched
            or self._deferred is not None
            or (self.mode == "micro" and self.micro_batch_size is None)
        ):
            why = "precision switch" if switched else "requested" if self._requested else "fit start"
            why = self._deferred[0] if self._deferred is not None and not switched else why
            self._requested = False
            self._search_micro_batch(trainer, pl_module, batch, batch_idx, why)
        elif self._apply_pending:
            self._apply_pending = False
            n = _samples(batch)
            if n is not None:
                self._cap = self.micro_batch_size
                engine.propose(
                    math.ceil(n / self.micro_batch_size),
                    Source.MEMORY,
                    "restored from checkpoint",
                    batch_size=n,
                )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._engine is not None:
            self._k = self._engine.k
            self._engine.release(self)
            self._engine = None

    def micro_batch_cap(self) -> int | None:
        """The engine's micro-batches stay within the measured size (from the search on)."""
        return self._cap

    # ------------------------------------------------------------------ the searches

    def _search_micro_batch(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int, why: str
    ) -> None:
        engine = self._engine
        n = _samples(batch)
        if n is None:
            warn(
                "MemoryAwareBatchSize: cannot find the sample dimension of the training batch, so micro-batch "
                "sizes cannot be measured; micro-batches stay as they are. Define `split_batch(self, batch, k)` "
                "or return tensors that share dim 0."
            )
            self._precision = _precision_of(trainer)
            return
        space = micro_mode_space(
            trainer,
            module,
            batch,
            n,
            batch_idx,
            engine.splittable(batch),
            self.min_batch_size,
            self.max_batch_size,
        )
        try:
            size = self._agree(trainer, module, space)
        except NoLossInTrial as err:
            # A batch the step skips (returns None) cannot be measured: on one device, measure the next one,
            # as many as MAX_DEFERRED batches later (this batch then runs, and is skipped, as it is).
            skipped = (self._deferred or (why, 0))[1] + 1
            if trainer.world_size > 1:
                raise _no_loss(err, "on this rank, and the ranks measure the same batch") from None
            if skipped >= MAX_DEFERRED:
                raise _no_loss(err, f"on {skipped} training batches in a row") from None
            self._deferred = (why, skipped)
            return
        if self._deferred is not None:
            why = f"{why}, {self._deferred[1]} batch(es) later: training_step skipped the earlier ones"
            self._deferred = None
        self._record(trainer, size, n)
        self._cap = size
        before = engine.k
        engine.propose(math.ceil(n / size), Source.MEMORY, f"measured at {why}", batch_size=n)
        k = engine.k
        change = f"k {before} -> {k}" if k != before else f"k stays {k}"
        self._announce(
            trainer,
            f"batches of {n} run as {k} micro-batch(es) of at most {math.ceil(n / k)} ({change}); "
            f"optimizer batch {n * trainer.accumulate_grad_batches * trainer.world_size} kept",
            why,
        )
        if self.eval_batch_size is None:
            self._size_evaluation(trainer, module)

    def _size_evaluation(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """A ``GPUOptDataModule`` without an explicit ``eval_batch_size``: its evaluation batch sized from measured
        validation steps (they keep no gradients or optimizer state of their own), after the training's search. The
        validation loader is built again at the next validation. Every rank takes the smallest answer."""
        from lightning_gpuopt.data import GPUOptDataModule

        datamodule, run = trainer.datamodule, self._run
        if (
            not isinstance(datamodule, GPUOptDataModule)
            or datamodule.eval_batch_size is not None
            or datamodule.max_tokens is not None
            or not is_overridden("val_dataset", datamodule, GPUOptDataModule)
            or not is_overridden("validation_step", module, pl.LightningModule)
            or trainer.limit_val_batches == 0
            or run is None
        ):
            return
        loader = datamodule.val_dataloader()
        if isinstance(loader.dataset, IterableDataset) or not hasattr(loader.dataset, "__len__"):
            return  # a stream: no first n samples to measure on (its batches run at the loader's batch size)
        probe = get_probe(trainer.strategy.root_device)
        optimizer = trainer.optimizers[0]
        missing_grads = sum(
            local_bytes(p) for g in optimizer.param_groups for p in g["params"] if p.grad is None
        )
        held = missing_grads + ((run.state_bytes or 0) if not optimizer.state else 0)
        start = self.micro_batch_size or 1
        largest = max(start, len(loader.dataset) // trainer.world_size)  # type: ignore[arg-type]
        failure: BaseException | None = None
        try:
            # torchmetrics and BatchNorm states put back, logged values dropped
            with self._engine.leave_no_trace():
                sizing = find_eval_batch_size(
                    module,
                    probe,
                    evaluation_runner(trainer, module, loader),
                    start=start,
                    largest=largest,
                    budget_bytes=run.budget_bytes,
                    held_bytes=held,
                )
            local = sizing.size
        except Exception as err:  # raised below, once every rank knows (none waits for this one)
            failure, local = err, -1
        strategy = trainer.strategy
        size = int(strategy.reduce(torch.tensor(local, device=strategy.root_device), reduce_op="min"))
        if failure is not None:
            raise failure
        if size < 1:
            raise RuntimeError(
                "MemoryAwareBatchSize: another rank could not measure its validation steps (its error says why); "
                "this rank stops with it. Give the GPUOptDataModule an eval_batch_size to skip the measurement."
            )
        if size >= self._resolved_multiple:
            size -= size % self._resolved_multiple
        self.eval_batch_size = size
        datamodule.eval_batch_size = size
        _compat.reload_val_loader(trainer)
        message = (
            f"MemoryAwareBatchSize: eval_batch_size None -> {size} ({sizing.line()}, beside "
            f"{format_bytes(held)} of gradients and optimizer state; training runs micro-batches of {start}); pass "
            "eval_batch_size to the GPUOptDataModule to choose it"
        )
        record_decision(trainer, "eval batch size", "MemoryAwareBatchSize", message, eval_batch_size=size)
        if self.verbose:
            rank_zero_info(message)

    def _search_batch_size(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """``mode="max"``: choose ``batch_size`` itself at fit start, on whole batches from the training dataset."""
        space = max_mode_space(trainer, module, self.min_batch_size, self.max_batch_size)
        old = int(lightning_getattr(module, "batch_size"))
        try:
            size = self._agree(trainer, module, space)
        except NoLossInTrial as err:
            raise _no_loss(
                err, "on samples of the training dataset (mode='max' measures them at fit start)"
            ) from None
        self._record(trainer, size, size)
        lightning_setattr(module, "batch_size", size)
        self._cap = size
        factor = scale_learning_rate(trainer, self.lr_scaling, size / old)
        self._lr_factor *= factor
        world, accumulate = trainer.world_size, trainer.accumulate_grad_batches
        lr = f"; learning rate x{factor:.4g} ({self.lr_scaling})" if self.lr_scaling else ""
        self._announce(
            trainer,
            f"batch_size {old} -> {size}: the optimizer batch changes {old * accumulate * world} -> "
            f"{size * accumulate * world} (mode='max'){lr}",
            "fit start",
        )

    def _find(
        self, trainer: pl.Trainer, module: pl.LightningModule, probe: MemoryProbe, space: SearchSpace
    ) -> SearchRun:
        engine = self._engine
        # Under FSDP2 the trial steps all-gather and reduce-scatter: the ranks run them together.
        sharded = strategy_kind(trainer.strategy) is StrategyKind.FSDP2
        return find_largest_size(
            trainer,
            module,
            probe,
            space,
            target_fraction=self.target_fraction,
            multiple_of=self._resolved_multiple,
            engine_bytes=engine.snapshot_bytes(),
            exchange=engine.exchange if sharded else None,
        )

    def _agree(self, trainer: pl.Trainer, module: pl.LightningModule, space: SearchSpace) -> int:
        """Search on every rank and reduce the answers to the smallest; every rank raises when any rank fails.

        A rank's failure is reduced too, so that the other ranks raise instead of waiting for it.
        """
        probe = get_probe(trainer.strategy.root_device)
        failure: BaseException | None = None
        try:
            run = self._find(trainer, module, probe, space)
            self._run, self.result = run, run.result
            self.budget_bytes = run.budget_bytes
            self.search_seconds = run.elapsed
            local = self.result.size or 0
        except Exception as err:  # raised below, once every rank knows
            failure, local = err, -1
        strategy = trainer.strategy
        size = int(strategy.reduce(torch.tensor(local, device=strategy.root_device), reduce_op="min"))
        if failure is not None:
            raise failure
        if size >= 1:
            return size
        if local == 0:
            raise MicroBatchOOMError(
                no_fit_message(
                    self._run, trainer.lightning_module, space.smallest, self.target_fraction, probe.total
                )
            )
        what = "fit even" if size == 0 else "measure"
        raise MicroBatchOOMError(
            f"MemoryAwareBatchSize: another rank could not {what} {space.smallest} sample(s) per step (its error "
            "message says why); this rank stops with it."
        )

    def _record(self, trainer: pl.Trainer, size: int, batch_size: int) -> None:
        result = self.result
        self.micro_batch_size = size
        self.batch_size = batch_size
        self.trials = len(result.measurements)
        if size == result.size or result.model is None:
            self.predicted_peak_bytes = result.predicted_peak_bytes
        else:  # another rank's smaller answer: this rank's model at that size
            self.predicted_peak_bytes = result.model.peak(size)
        self._precision = _precision_of(trainer)
        self._apply_pending = False

    def _choose_max_tokens(self, trainer: pl.Trainer, module: pl.LightningModule, probe: MemoryProbe) -> None:
        """``max_tokens="auto"``: the checkpoint's budget on a resume, else a search at fit start (every rank takes
        the smallest answer)."""
        datamodule = trainer.datamodule
        if self.max_tokens is not None:
            datamodule.max_tokens = self.max_tokens
            if self.verbose:
                rank_zero_info(
                    f"MemoryAwareBatchSize: max_tokens={self.max_tokens}, kept from the checkpoint."
                )
            return
        dataset = datamodule.stage_dataset("train")
        lengths = list(datamodule.sample_lengths(dataset))
        failure: BaseException | None = None
        try:
            run = search_max_tokens(
                trainer,
                module,
                probe,
                dataset,
                lengths,
                datamodule.collate_fn() or default_collate,
                _shapes_at(lengths, trainer.world_size, datamodule.long_samples),
                target_fraction=self.target_fraction,
                engine_bytes=self._engine.snapshot_bytes() if self._engine is not None else 0,
                ahead=batches_ahead(trainer),
            )
            self.token_search, mine = run, run.max_tokens or 0
        except Exception as err:  # raised below, once every rank knows (none waits for this one)
            failure, mine = err, -1
        strategy = trainer.strategy
        tokens = int(strategy.reduce(torch.tensor(mine, device=strategy.root_device), reduce_op="min"))
        if isinstance(failure, NoLossInTrial):
            raise _no_loss(
                failure, "on samples of the training dataset (max_tokens='auto' measures them at fit start)"
            ) from None
        if failure is not None:
            raise failure
        if tokens < 1:
            why = (
                run.line()
                if mine < 1
                else "another rank could not measure or fit one sample of the longest length"
            )
            raise MicroBatchOOMError(
                f"MemoryAwareBatchSize: {why} (target_fraction {self.target_fraction:g} x {format_bytes(probe.total)}). "
                "Shorten the longest samples, or see docs/batch-size.md for what uses less memory."
            )
        datamodule.max_tokens = self.max_tokens = tokens
        message = f"MemoryAwareBatchSize: {run.line()}" + (
            "" if tokens == mine else f"; every rank takes {tokens}, another rank's answer"
        )
        record_decision(trainer, "batch size", "MemoryAwareBatchSize", message, max_tokens=tokens)
        if self.verbose:
            rank_zero_info(message)

    # ------------------------------------------------------------------ what it says

    def _announce(self, trainer: pl.Trainer, change: str, why: str) -> None:
        result = self.result
        sizes = ", ".join(
            f"{m.size}{'' if not m.out_of_memory else ' (out of memory)'}" for m in result.measurements
        )
        limit = get_probe(trainer.strategy.root_device).total
        noun = "batch" if self.mode == "max" and why == "fit start" else "micro-batch"
        message = (
            f"MemoryAwareBatchSize ({why}): the largest {noun} that fits is {self.micro_batch_size} sample(s), predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of a budget {format_bytes(self.budget_bytes)} "
            f"(target_fraction {self.target_fraction:g} x {format_bytes(limit)}), from {self.trials} measured "
            f"step(s) [{sizes}] in {self._run.elapsed:.2f} s; {change}"
        )
        compiled = self._run.frames_compiled
        if compiled is not None:
            message += (
                f"; torch.compile: the trial steps compiled {compiled} frame(s), batch dimension dynamic"
            )
        record_decision(
            trainer,
            "batch size",
            "MemoryAwareBatchSize",
            message,
            micro_batch_size=self.micro_batch_size,
            predicted_peak_bytes=self.predicted_peak_bytes,
            trials=self.trials,
            mode=self.mode,
            search_seconds=self.search_seconds,
            compiled_frames=compiled,
        )
        if self.verbose:
            rank_zero_info(message)
        # The micro-batch size itself is GPUOptReport's `gpuopt/micro_batch_size`, at every logged step.
        log_metrics(
            trainer,
            {
                "gpuopt/predicted_peak_bytes": float(self.predicted_peak_bytes),
                "gpuopt/search_trials": float(self.trials),
            },
        )


def _shapes_at(lengths: list[int], world: int, long_samples: str) -> Callable[[int], list[tuple[int, int]]]:
    """The batches each budget forms on ``lengths`` (the search asks for many): one sampler, sorted once, built at
    the first budget asked."""
    planned: list[TokenBatchSampler] = []

    def shapes(tokens: int) -> list[tuple[int, int]]:
        if not planned:
            planned.append(TokenBatchSampler(lengths, tokens, num_replicas=world, long_samples=long_samples))
        return planned[0].batch_shapes(tokens)

    return shapes


def _no_loss(err: NoLossInTrial, where: str) -> NoLossInTrial:
    return NoLossInTrial(
        f"{err} {where}. Return the loss for the batches the search measures, or remove MemoryAwareBatchSize."
    )


def _precision_of(trainer: pl.Trainer) -> str:
    plugin = trainer.precision_plugin
    return f"{type(plugin).__name__}:{getattr(plugin, 'precision', '')}"


def _samples(batch: Any) -> int | None:
    try:
        return batch_size_of(batch)
    except UnsplittableBatchError:
        return None
