"""MemoryAwareBatchSize: measure what a batch costs, pick the largest micro-batch (or batch) that fits the memory budget."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

from lightning_gpuopt import _compat
from lightning_gpuopt._compiled import cuda_graphs_refusal
from lightning_gpuopt._warnings import warn
from lightning_gpuopt.batch_size.modes import MaxBatchSizeMode
from lightning_gpuopt.batch_size.peak_model import SearchResult, SizeSearch, StepMeasurement, memory_budget
from lightning_gpuopt.batch_size.predicted import PredictedSearch
from lightning_gpuopt.batch_size.trace import start_search
from lightning_gpuopt.batch_size.trial import TrialSteps, local_bytes
from lightning_gpuopt.batching import SPLIT_HOOK, UnsplittableBatchError, batch_size_of, first_samples
from lightning_gpuopt.callbacks.oom_recovery import MicroBatchOOMError
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory import MemoryProbe, format_bytes, get_probe
from lightning_gpuopt.microbatch import EngineState, MicroBatchEngine
from lightning_gpuopt.oom_policy import Source
from lightning_gpuopt.support import Feature, StrategyKind, strategy_kind, supports

__all__ = ["MemoryAwareBatchSize"]

_MODES = ("micro", "max")
_LR_RULES = (None, "linear", "sqrt")
#: Small tensors a real step holds that a trial does not (the loop's loss copies, logged values,
#: gradient-clipping norms): kept free under the budget.
_STEP_SLACK_BYTES = 64 * 1024


def _check_size(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int{' or None' if allow_none else ''}, got {value!r}")


class MemoryAwareBatchSize(MaxBatchSizeMode, Callback):
    """Measures the peak memory of a few real training steps and picks the largest micro-batch that fits.

    At the first training batch of a fit (``mode="micro"``), a few real training steps -- forward,
    backward and the optimizer step with the optimizer state in place -- run on the first samples of
    that batch at a few sizes (at most three steps started from the prediction, four without it; the
    last one verifies the answer). Their peaks fit
    a model of memory against micro-batch size (the optimizer phase does not grow with it; growth
    faster than linear is detected from three points) that predicts the largest size within the
    budget: the memory this process may use on the device (honouring a per-process fraction) ×
    ``target_fraction``. The trial steps leave no trace: parameters, buffers, gradients, optimizer
    state (also state the optimizer creates lazily), LR schedulers, RNG states, plain attributes of
    the module and its torchmetrics are put back, ``self.log`` is silent, no hook of another
    callback runs, the loop's counters and the training data order are untouched (the trials use the
    batch the loop already fetched). Nothing is written to disk.

    ``mode="micro"`` (default) keeps ``batch_size``, ``accumulate_grad_batches`` and the optimizer
    batch; the pack's micro-batch engine splits each batch into k = ceil(batch_size / n) micro-batches
    of at most n samples, and n caps any later growth of the micro-batch. ``mode="max"`` (opt-in)
    measures at fit start, before the loaders exist, on samples drawn from the training dataset, and
    sets ``batch_size`` of the DataModule (or LightningModule) to the largest that fits: this changes the
    optimizer batch, and it says so; ``lr_scaling`` can scale the learning rate with it. The budget
    reserves room for the batches the data pipeline holds ahead on the device at the new size.

    Under DDP every rank measures on its own device and all use the smallest answer. Under FSDP2
    (:class:`~lightning_gpuopt.FSDP2Strategy`, or ``ModelParallelStrategy`` over a ``fully_shard`` model) the
    trial steps are real sharded steps: each rank's measured peak holds the units FSDP2 gathers and its
    reduce-scatter buffers. The ranks run them together, each at the smallest size any rank's search asks
    for (each FSDP collective is preceded by a vote, so a rank that runs out of memory in a trial stops the
    others instead of leaving them waiting), and all use the smallest answer; the step is not traced there
    (the measured search, at most four steps). The result is
    kept in ``state_dict``: a resumed run does not search again. A change of the precision plugin (a
    precision switch) since the measurement triggers a new measurement at the next batch that starts
    an accumulation window; :meth:`remeasure` asks for one. On a CPU device without
    :class:`~lightning_gpuopt.testing.SimulatedMemory` there is no device memory to measure: the
    callback says so once and does nothing.

    Args:
        mode: ``"micro"`` (choose the micro-batch size; batch_size unchanged) or ``"max"`` (choose
            batch_size itself).
        target_fraction: the share of the device memory this process may use that a step may take at
            its peak, in (0, 1]; the rest is headroom for fragmentation and what the measurement
            cannot see.
        multiple_of: answers at least this large are rounded down to a multiple of it; ``None``: 8 on
            CUDA (tensor-core friendly shapes), 1 elsewhere.
        min_batch_size: the smallest (micro-)batch allowed; if even it does not fit, fitting fails.
        max_batch_size: the largest (micro-)batch to consider; ``None``: the batch size (``"micro"``),
            the per-device share of the training dataset (``"max"``).
        lr_scaling: ``mode="max"`` only: ``"linear"`` or ``"sqrt"`` scales the learning rate (and
            schedulers' base rates) by the batch-size ratio, ``None`` leaves it.
        verbose: log the result once on rank zero.
        predict: start from the prediction: before any real step, the training step is traced on fake
            tensors (:func:`~lightning_gpuopt.memory.predict_peak`, none of the step allocated) at up to three
            sizes; the first real step (small) calibrates the traced curve, the second runs at the size
            it predicts, the third verifies (:mod:`lightning_gpuopt.batch_size.predicted`). A step that
            cannot be traced, or steps that cannot show an answer, leave the measured search (at most four
            steps) to decide, and :attr:`prediction_note` says why. ``False``: the measured search alone.

    Raises:
        ValueError: an argument is out of range.
        RuntimeError: in ``setup``/``on_fit_start``, for setups it cannot run (manual optimization,
            sharded strategies other than FSDP2, FSDP2 on a torch older than 2.14, several optimizers,
            BatchSizeFinder in the same Trainer, a compiled module, ``mode="max"`` without a ``batch_size``
            attribute), naming the alternative.
        MicroBatchOOMError: even ``min_batch_size`` does not fit; the message has the measured breakdown.

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
        >>> from torch.utils.data import DataLoader
        >>> from lightning_gpuopt import MemoryAwareBatchSize
        >>> from lightning_gpuopt.testing import SimulatedMemory
        >>> finder = MemoryAwareBatchSize()
        >>> trainer = pl.Trainer(max_steps=2, callbacks=[finder], logger=False, enable_checkpointing=False,
        ...     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        >>> with SimulatedMemory(limit_bytes=64 * 2**20):  # a 64 MiB "GPU" on the CPU
        ...     trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 256), batch_size=64))
        >>> finder.micro_batch_size, finder.k, finder.trials  # predicted to fit whole: the 2nd step verified it
        (64, 1, 2)
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
        predict: bool = True,
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
        if not isinstance(predict, bool):
            raise ValueError(f"`predict` must be True or False, got {predict!r}")
        self.predict = predict
        #: How the prediction served the last search, or why the search ran without it (``""``: no search yet).
        self.prediction_note = ""
        #: The largest micro-batch that fits (``mode="max"``: the batch size chosen); ``None`` before a search.
        self.micro_batch_size: int | None = None
        #: The batch size the answer is for (``mode="max"``: the one set).
        self.batch_size: int | None = None
        #: The model's peak at ``micro_batch_size``, in bytes.
        self.predicted_peak_bytes: int | None = None
        #: Real training steps the last search measured (0: none yet, or restored from a checkpoint); under FSDP2
        #: every rank runs as many, at the same sizes.
        self.trials = 0
        #: What a step may use at its peak, in bytes, at the last search.
        self.budget_bytes: int | None = None
        #: The last search's measurements and model (this process; not saved).
        self.result: SearchResult | None = None
        self._k = 1
        self._precision: str | None = None
        self._lr_factor = 1.0
        self._requested = False
        self._engine: MicroBatchEngine | None = None
        self._resolved_multiple = 1
        self._apply_pending = False
        # Figures of the last search, for its messages.
        self._elapsed = 0.0
        self._last_error: str | None = None
        self._frames_compiled: int | None = None  # frames dynamo compiled during the trials (compiled models)
        self._grad_bytes = 0
        self._state_bytes: int | None = None

    # ------------------------------------------------------------------ what users read

    @property
    def k(self) -> int:
        """Micro-batches per training batch now in force."""
        return self._engine.k if self._engine is not None else self._k

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
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "MemoryAwareBatchSize needs automatic optimization, but the LightningModule sets "
                "`automatic_optimization = False` (a manual step cannot be measured or split). Choose the batch "
                "size yourself, or use automatic optimization."
            )
        if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
            raise RuntimeError(
                "MemoryAwareBatchSize cannot run beside Lightning's BatchSizeFinder (both choose the batch size). "
                "Remove BatchSizeFinder: MemoryAwareBatchSize(mode='max') also sets batch_size, in at most four "
                "measured steps."
            )
        compiled = supports(Feature.BATCH_SIZE_SEARCH, strategy, compiled=_compat.is_compiled(pl_module))
        if not compiled.supported:
            raise RuntimeError(
                f"MemoryAwareBatchSize does not support a torch.compile'd LightningModule here: {compiled.reason}."
            )
        refusal = cuda_graphs_refusal(pl_module, strategy.root_device, "MemoryAwareBatchSize")
        if refusal is not None:
            raise RuntimeError(refusal)
        if self.mode == "max" and not lightning_hasattr(pl_module, "batch_size"):
            raise RuntimeError(
                "MemoryAwareBatchSize(mode='max') sets `batch_size`, but neither the DataModule nor the "
                "LightningModule (nor its hparams) has one. Give the object whose `train_dataloader` builds the "
                "loader a `batch_size` attribute it reads, or use mode='micro'."
            )
        device = strategy.root_device
        self._resolved_multiple = self.multiple_of or (8 if device.type == "cuda" else 1)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._engine = None
        if trainer.world_size > 1 and any(isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules()):
            # Checked here: Lightning converts BatchNorm layers (sync_batchnorm=True) after `setup`.
            raise RuntimeError(
                "MemoryAwareBatchSize cannot measure a model with SyncBatchNorm under a multi-process strategy: every "
                "forward synchronises across ranks, and each rank measures on its own. Use sync_batchnorm=False, or "
                "remove MemoryAwareBatchSize."
            )
        probe = get_probe(trainer.strategy.root_device)
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
        if self.mode != "max":
            return
        if self.batch_size is not None and not self._requested:
            lightning_setattr(
                pl_module, "batch_size", self.batch_size
            )  # resumed: the size it had, applied at batch 0
            return
        self._search_batch_size(trainer, pl_module, probe)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        if engine is None or batch_idx % trainer.accumulate_grad_batches != 0:
            return
        precision = _precision_of(trainer)
        switched = self._precision is not None and precision != self._precision
        if self._requested or switched or (self.mode == "micro" and self.micro_batch_size is None):
            why = "precision switch" if switched else "requested" if self._requested else "fit start"
            self._requested = False
            self._search_micro_batch(trainer, pl_module, batch, batch_idx, why)
        elif self._apply_pending:
            self._apply_pending = False
            n = _samples(batch)
            if n is not None:
                engine.max_micro_batch_size = self.micro_batch_size
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
        if engine.splittable(batch):
            largest = min(n, self.max_batch_size or n)
            smallest = min(self.min_batch_size, largest)
        else:  # declared unsplittable (OOMRecovery's `unsplittable`): only the whole batch can run
            largest = smallest = n
        probe = get_probe(trainer.strategy.root_device)
        splitter = _splitter(trainer, module)

        def micro_batch(size: int) -> tuple[Any, int, int, bool]:
            if size >= n:  # k = 1: the engine runs the batch whole, after zeroing the gradients
                return batch, n, 0, True
            if splitter is None:
                return first_samples(batch, size), size, 0, False
            k = math.ceil(n / size)
            return splitter(batch, k)[0], math.ceil(n / k), 0, False  # the split hook decides the micro-batch

        size = self._agree(
            trainer,
            probe,
            smallest,
            lambda: self._search(
                trainer, module, probe, micro_batch, smallest, largest, 0.0, batch_idx, largest == n
            ),
        )
        self._record(trainer, size, n)
        engine.max_micro_batch_size = size
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

    def _search(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        probe: MemoryProbe,
        make_batch: Callable[[int], tuple[Any, int, int, bool]],
        smallest: int,
        largest: int,
        held_per_sample: float,
        batch_idx: int,
        whole_largest: bool,
    ) -> SearchResult:
        engine = self._engine
        budget = memory_budget(probe.total, self.target_fraction)
        started = time.perf_counter()
        # Under FSDP2 the trial steps all-gather and reduce-scatter: the ranks run them together.
        together = strategy_kind(trainer.strategy) is StrategyKind.FSDP2
        exchange = engine.exchange if together else None
        with TrialSteps(trainer, module, probe, batch_idx, exchange) as trials:
            # Held besides what a trial sees: the engine's own copies, and with accumulation the window's
            # earlier gradients, which the engine keeps apart while a batch runs.
            extra = engine.snapshot_bytes() + _STEP_SLACK_BYTES
            if trainer.accumulate_grad_batches > 1:
                extra += trials.grad_bytes
            arguments = dict(
                budget_bytes=budget,
                base_bytes=probe.allocated,
                smallest=smallest,
                largest=largest,
                multiple_of=self._resolved_multiple,
                held_bytes_per_sample=held_per_sample,
                whole_largest=whole_largest,
                grad_bytes=trials.grad_bytes,
                # 1/16 of the range, 2 to 16 samples: small, yet past the sizes where fixed costs dominate a step.
                first_size=min(16, max(2, largest // 16)),
            )
            if self.predict and not together:  # the first real step at the size traced steps predict
                search, self.prediction_note = start_search(
                    trainer, module, make_batch, batch_idx, extra + trials.missing_grad_bytes(), **arguments
                )
            elif self.predict:
                search = SizeSearch(**arguments)
                self.prediction_note = (
                    "under FSDP2 the step is not traced (its collectives run inside it): the measured search"
                )
            else:
                search, self.prediction_note = SizeSearch(**arguments), "predict=False: the measured search"
            run_trials(search, trials, make_batch, extra)
            if isinstance(search, PredictedSearch):
                self.prediction_note = search.note
            self._last_error = trials.last_error
            self._frames_compiled = trials.frames_compiled if trials.compiled else None
            self._grad_bytes = trials.grad_bytes
            self._state_bytes = trials.state_bytes
        self._elapsed = time.perf_counter() - started
        self.budget_bytes = budget
        return search.result

    def _agree(
        self, trainer: pl.Trainer, probe: MemoryProbe, smallest: int, search: Callable[[], SearchResult]
    ) -> int:
        """Run ``search`` on every rank and reduce the answers to the smallest; every rank raises when any rank fails.

        A rank's failure is reduced too, so that the other ranks raise instead of waiting for it.
        """
        failure: BaseException | None = None
        try:
            self.result = search()
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
            raise MicroBatchOOMError(self._no_fit_message(trainer, self.result, probe, smallest))
        what = "fit even" if size == 0 else "measure"
        raise MicroBatchOOMError(
            f"MemoryAwareBatchSize: another rank could not {what} {smallest} sample(s) per step (its error message says "
            "why); this rank stops with it."
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
            f"step(s) [{sizes}] in {self._elapsed:.2f} s ({self.prediction_note}); {change}"
        )
        compiled = self._frames_compiled
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
            prediction=self.prediction_note,
            compiled_frames=compiled,
        )
        if self.verbose:
            rank_zero_info(message)
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {
                        "gpuopt/micro_batch_size": float(self.micro_batch_size),
                        "gpuopt/predicted_peak_bytes": float(self.predicted_peak_bytes),
                        "gpuopt/search_trials": float(self.trials),
                    },
                    step=trainer.global_step,
                )

    def _no_fit_message(
        self, trainer: pl.Trainer, result: SearchResult, probe: MemoryProbe, smallest: int
    ) -> str:
        params = sum(local_bytes(p) for p in trainer.lightning_module.parameters())
        state = (
            "not measured (no trial reached the optimizer step)"
            if self._state_bytes is None
            else format_bytes(self._state_bytes)
        )
        parts = [
            f"parameters {format_bytes(params)}",
            f"gradients {format_bytes(self._grad_bytes)}",
            f"optimizer state {state}",
        ]
        done = [m for m in result.measurements if not m.out_of_memory]
        if done:
            m = min(done, key=lambda m: m.size)
            model = result.model
            parts += [
                f"memory held through a step {format_bytes(model.base_bytes)}",
                f"forward+backward at {m.size} sample(s) {format_bytes(m.forward_backward_bytes)}",
                f"optimizer step {format_bytes(m.optimizer_bytes or 0)}",
                f"peak {format_bytes(model.peak(m.size))}",
            ]
        tried = ", ".join(
            f"{m.size}{' (out of memory)' if m.out_of_memory else ''}" for m in result.measurements
        )
        error = f" Last error: {self._last_error}" if self._last_error else ""
        return (
            f"MemoryAwareBatchSize: even {smallest} sample(s) per step do not fit the memory budget of "
            f"{format_bytes(self.budget_bytes)} (target_fraction {self.target_fraction:g} x "
            f"{format_bytes(probe.total)}). Measured steps: {tried}. Memory: {'; '.join(parts)}. Next steps: a "
            "lower-memory precision (precision='bf16-mixed' or '16-mixed'), activation checkpointing of the largest "
            "blocks, a sharded strategy (FSDP, DeepSpeed ZeRO) or CPU offload, a higher target_fraction, or a "
            f"smaller model.{error}"
        )


def _precision_of(trainer: pl.Trainer) -> str:
    plugin = trainer.precision_plugin
    return f"{type(plugin).__name__}:{getattr(plugin, 'precision', '')}"


def run_trials(
    search: SizeSearch,
    trials: TrialSteps,
    make_batch: Callable[[int], tuple[Any, int, int, bool]],
    extra: int,
) -> None:
    """Measure the sizes ``search`` asks for with ``trials`` until it is over (under FSDP2: until every rank's is).

    ``extra``: bytes held through a real step that a trial does not hold (added to the measured base).
    Under FSDP2 every rank runs each trial step at the same size, the smallest any rank's search asks for
    (:meth:`TrialSteps.agree_size`; the ranks use the smallest answer, so the rank with the least memory
    leads), and records it, so that no rank runs more trial steps than one search may. A step that another
    rank's OOM stopped here is recorded as out of memory: the answer the ranks agree on lies below it anyway.
    """
    while (size := trials.agree_size(search.next_size())) is not None:
        # A split hook may choose another size: record what ran.
        batch, actual, nbytes, whole = make_batch(size)
        measurement = trials.measure(batch, actual, nbytes, whole)
        del batch
        if measurement is None:
            measurement = StepMeasurement(actual, None)
        elif trials.held_bytes is not None:
            search.base_bytes = trials.held_bytes + extra
        search.record(measurement)


def _samples(batch: Any) -> int | None:
    try:
        return batch_size_of(batch)
    except UnsplittableBatchError:
        return None


def _splitter(trainer: pl.Trainer, module: pl.LightningModule) -> Callable[[Any, int], list] | None:
    for owner in (module, trainer.datamodule):
        hook = getattr(owner, SPLIT_HOOK, None) if owner is not None else None
        if callable(hook):
            return lambda batch, k: list(hook(batch, k))
    return None
