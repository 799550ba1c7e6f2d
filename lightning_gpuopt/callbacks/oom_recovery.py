"""OOMRecovery: on CUDA out-of-memory in a training step, split the same batch into more micro-batches and retry."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_gpuopt import _compat
from lightning_gpuopt._validate import choice, fraction, keep_options, positive_int
from lightning_gpuopt.activation_checkpointing import describe_module_types, matching_modules
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory import format_bytes, get_probe
from lightning_gpuopt.microbatch import (
    CHECKPOINTING,
    EngineState,
    KChange,
    MicroBatchEngine,
    MicroBatchOOMError,
    MicroBatchUser,
    WeightFn,
)
from lightning_gpuopt.microbatch.loss_weighting import LossReduction, LossWeighting, OnMismatch
from lightning_gpuopt.microbatch.rungs import ActivationCheckpointing, Rung
from lightning_gpuopt.oom_policy import (
    OOMFailure,
    Recovery,
    allocator_thrashing,
    grow_back_micro_batch_count,
    next_micro_batch_count,
    recently_failed_size,
    smaller_micro_batch_count,
    smallest_split_cannot_fit,
)
from lightning_gpuopt.oom_record import largest_part, part_advice, part_label
from lightning_gpuopt.refusals import refuse_unsupported
from lightning_gpuopt.support import Feature
from lightning_gpuopt.votes import Proposal, Source, Status

__all__ = ["MicroBatchOOMError", "OOMRecovery", "OOMRecoveryOptions", "TokenCount"]


class TokenCount:
    """Counts the tokens of a micro-batch that a token-mean loss averages over.

    Counts the elements of ``batch[key]`` that are not ``ignore_index`` (labels with ``-100`` padding,
    the default), or with ``ignore_index=0`` the ones of an attention mask. Picklable, unlike a lambda.

    Args:
        key: the batch entry to count in (a mapping key, or an index for tuple/list batches).
        ignore_index: the value that marks padding.

    Example:
        >>> import torch
        >>> TokenCount("labels")({"labels": torch.tensor([[5, 7, -100], [1, -100, -100]])})
        3
    """

    def __init__(self, key: str | int = "labels", ignore_index: int = -100) -> None:
        self.key = key
        self.ignore_index = ignore_index

    def __call__(self, batch: Any) -> int:
        try:
            values = batch[self.key]
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(
                f"loss_reduction='tokens' counts tokens in batch[{self.key!r}], but the batch has no such entry "
                f"({type(batch).__name__}). Pass `token_key` naming the labels or attention mask, or a `weight_fn`."
            ) from err
        if not isinstance(values, Tensor):
            raise ValueError(
                f"batch[{self.key!r}] must be a tensor to count tokens in, got {type(values).__name__}"
            )
        return int((values != self.ignore_index).sum())

    def __repr__(self) -> str:
        return f"TokenCount(key={self.key!r}, ignore_index={self.ignore_index})"


@dataclass(frozen=True)
class OOMRecoveryOptions:
    """OOMRecovery's arguments, checked once (:class:`OOMRecovery` documents each one).

    ``OOMRecovery(**fields)`` builds one; a wrong value raises the ``ValueError`` or ``TypeError`` that
    names the argument, here and nowhere else.
    """

    loss_reduction: LossReduction = "auto"
    weight_fn: WeightFn | None = None
    token_key: str | int = "labels"
    ignore_index: int = -100
    on_mismatch: OnMismatch = "raise"
    unsplittable: bool | Callable[[Any], bool] = False
    #: Normalised to a ``frozenset``.
    sum_log_keys: Iterable[str] = ()
    max_micro_batches: int | None = None
    #: Normalised to a ``float``.
    headroom: float = 0.9
    grow_back: bool = True
    grow_back_after: int = 50
    #: Normalised to a ``tuple``.
    checkpoint_modules: Sequence[str | type[nn.Module]] = ()
    verbose: bool = True
    min_micro_batch_size: int | None = None
    #: Normalised to a ``tuple``.
    rungs: Sequence[Rung] = ()

    def __post_init__(self) -> None:
        self._check_weighting()
        if isinstance(self.sum_log_keys, str):
            raise TypeError(
                f"`sum_log_keys` must be a collection of names, got the string {self.sum_log_keys!r}"
            )
        positive_int("max_micro_batches", self.max_micro_batches, allow_none=True)
        positive_int("min_micro_batch_size", self.min_micro_batch_size, unit="samples", allow_none=True)
        fraction("headroom", self.headroom)
        if not isinstance(self.grow_back, bool):
            raise ValueError(f"`grow_back` must be True or False, got {self.grow_back!r}")
        positive_int("grow_back_after", self.grow_back_after, unit="steps")
        self._check_rungs()
        object.__setattr__(self, "sum_log_keys", frozenset(self.sum_log_keys))
        object.__setattr__(self, "headroom", float(self.headroom))
        object.__setattr__(self, "checkpoint_modules", tuple(self.checkpoint_modules))

    def _check_weighting(self) -> None:
        choice("loss_reduction", self.loss_reduction, LossReduction)
        weight_fn = self.weight_fn
        if weight_fn is not None and not callable(weight_fn):
            raise TypeError(
                f"`weight_fn` must be a callable(micro_batch) -> count, got {type(weight_fn).__name__}"
            )
        if weight_fn is not None and self.loss_reduction == "sum":
            raise ValueError(
                "`weight_fn` gives shares of a mean loss; it cannot be combined with loss_reduction='sum'"
            )
        choice("on_mismatch", self.on_mismatch, OnMismatch)
        if not isinstance(self.unsplittable, bool) and not callable(self.unsplittable):
            raise TypeError(
                "`unsplittable` must be a bool or a callable(batch) -> bool, got "
                f"{type(self.unsplittable).__name__}"
            )

    def _check_rungs(self) -> None:
        modules = self.checkpoint_modules
        if isinstance(modules, (str, type)) or not all(
            isinstance(t, str) or (isinstance(t, type) and issubclass(t, nn.Module)) for t in modules
        ):
            raise TypeError(
                "`checkpoint_modules` must be a list of module classes or class names (e.g. "
                f"['TransformerBlock', torch.nn.TransformerEncoderLayer]), got {modules!r}"
            )
        rungs = tuple(self.rungs)
        if not all(isinstance(r, Rung) and r.name for r in rungs):
            raise TypeError(
                "`rungs` must be a list of named `lightning_gpuopt.Rung` objects (subclass it, set `name`, implement "
                f"`apply`), got {list(rungs)!r}"
            )
        names = [r.name for r in rungs] + ([ActivationCheckpointing.name] if modules else [])
        if len(set(names)) != len(names):
            raise ValueError(f"every recovery rung needs its own `name`, got {names}")
        object.__setattr__(self, "rungs", rungs)


class OOMRecovery(MicroBatchUser, Callback):
    """Recovers from out-of-memory errors by splitting the batch into more micro-batches, on every rank alike.

    On an OOM in a training step the attempt is dropped, memory is freed, a larger number of micro-batches
    k is chosen from what the failure tells, and **the same batch** runs again: the optimizer batch, the
    samples seen, ``batch_idx`` and ``global_step`` are those of a run that never ran out of memory, and the
    parameters match it to rounding. Under DDP and FSDP2 every rank retries alike. Each micro-batch's loss
    is weighted so that the combination is your loss (found at the first split with ``"auto"``; a loss
    that couples samples is refused, never split silently). Evaluation steps split too; ``grow_back``
    grows the micro-batch again once memory allows. The long form: ``docs/oom-recovery.md``.

    Args:
        loss_reduction: ``"auto"`` (found and checked), ``"mean"`` (samples), ``"tokens"`` or ``"sum"``.
        weight_fn: counts what a micro-batch contributes to the loss (overrides ``loss_reduction``'s count).
        token_key: the batch entry holding labels (or an attention mask) for ``"tokens"``.
        ignore_index: the padding value in ``token_key``.
        on_mismatch: when no weighting reproduces the loss: ``"raise"`` refuses to split, ``"warn"`` splits.
        unsplittable: ``True``, or a predicate on the batch, for batches that may never be split.
        sum_log_keys: logged keys summed over micro-batches instead of averaged.
        max_micro_batches: the largest k to try (``None``: down to one sample per micro-batch).
        headroom: the fraction of the memory limit a new micro-batch size aims for, in (0, 1].
        grow_back: use fewer, larger micro-batches again after ``grow_back_after`` clean steps.
        grow_back_after: clean steps before growing back (doubles after each relapse).
        checkpoint_modules: module types to recompute in the backward when one sample does not fit.
        verbose: one line per change of k on rank zero.
        min_micro_batch_size: the fewest samples a micro-batch may have (``None``: 2 with BatchNorm, else 1).
        rungs: more recovery rungs (``lightning_gpuopt.Rung``) tried before giving up.

    Raises:
        ValueError, TypeError: an argument out of range or of the wrong type.
        RuntimeError: at setup, a run it cannot serve (manual optimization, FSDP1, ...), naming the alternative.
        MicroBatchOOMError: out of memory with nothing left to split; every other rank stops too.

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_gpuopt import OOMRecovery
        >>> trainer = pl.Trainer(max_steps=2, callbacks=[OOMRecovery()], logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(BoringModel())
        >>> trainer.global_step
        2
    """

    def __init__(
        self,
        loss_reduction: LossReduction = "auto",
        weight_fn: WeightFn | None = None,
        token_key: str | int = "labels",
        ignore_index: int = -100,
        on_mismatch: OnMismatch = "raise",
        unsplittable: bool | Callable[[Any], bool] = False,
        sum_log_keys: Iterable[str] = (),
        max_micro_batches: int | None = None,
        headroom: float = 0.9,
        grow_back: bool = True,
        grow_back_after: int = 50,
        checkpoint_modules: Sequence[str | type[nn.Module]] = (),
        verbose: bool = True,
        min_micro_batch_size: int | None = None,
        rungs: Sequence[Rung] = (),
    ) -> None:
        options = OOMRecoveryOptions(
            loss_reduction=loss_reduction,
            weight_fn=weight_fn,
            token_key=token_key,
            ignore_index=ignore_index,
            on_mismatch=on_mismatch,
            unsplittable=unsplittable,
            sum_log_keys=sum_log_keys,
            max_micro_batches=max_micro_batches,
            headroom=headroom,
            grow_back=grow_back,
            grow_back_after=grow_back_after,
            checkpoint_modules=checkpoint_modules,
            verbose=verbose,
            min_micro_batch_size=min_micro_batch_size,
            rungs=rungs,
        )
        keep_options(self, options)  # as .options, and each as an attribute
        #: The weighting the engine uses (its decision is kept in checkpoints).
        self.loss_weighting = LossWeighting(loss_reduction, weight_fn, token_key, ignore_index, on_mismatch)
        self.loss_weighting.verbose = verbose
        #: Every failed attempt of this fit, in order (training and evaluation).
        self.failures: list[OOMFailure] = []
        self._k = 1
        self._eval_k: dict[str, int] = {}
        self._checkpointing = False
        #: The recovery ladder past more micro-batches, in order: activation checkpointing of
        #: ``checkpoint_modules`` (when given), then ``rungs``.
        self.ladder: list[Rung] = list(options.rungs)
        if self.checkpoint_modules:
            self.ladder.insert(0, ActivationCheckpointing(self.checkpoint_modules))
        self._wait = grow_back_after
        self._engine: MicroBatchEngine | None = None
        self._reset_watch()

    def _reset_watch(self) -> None:
        self._clean_steps = 0
        self._step_start: int | None = None
        self._recent_failures: dict[int, int] = {}  # micro-batch size -> global step of its last OOM
        self._grown_at: int | None = None  # the step of the last grow-back, to notice it failing
        self._retries: list[int] = []
        self._proposal: Proposal | None = None  # for the vote after the next batch (grow back, thrashing)

    # ------------------------------------------------------------------ what users read

    @property
    def k(self) -> int:
        """Micro-batches per training batch now in force."""
        return self._engine.k if self._engine is not None else self._k

    @property
    def eval_k(self) -> dict[str, int]:
        """Chunks per evaluation batch, by stage (``"validation"``, ``"test"``, ``"predict"``), after an OOM there."""
        return dict(self._engine.eval_k) if self._engine is not None else dict(self._eval_k)

    @property
    def checkpointing(self) -> bool:
        """Whether activation checkpointing of ``checkpoint_modules`` was turned on (it stays on for the run)."""
        return self._checkpointing

    @property
    def state_key(self) -> str:
        # Lightning reads it several times per step (it names every hook call): build it once.
        key = self.__dict__.get("_state_key")
        if key is None:
            key = self.__dict__["_state_key"] = self._generate_state_key(loss_reduction=self.loss_reduction)
        return key

    def state_dict(self) -> dict[str, Any]:
        # k, the evaluation k and activation checkpointing are the engine's, saved once by it
        # (`EngineState`); `load_state_dict` still reads them from checkpoints written before.
        return {
            "oom_count": len(self.failures) + self._restored_oom_count,
            "grow_back_wait": self._wait,
            **{f"loss_weighting_{key}": value for key, value in self.loss_weighting.state_dict().items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._k = int(state_dict.get("k", 1))
        self._restored_oom_count = int(state_dict.get("oom_count", 0))
        self._eval_k = {str(stage): int(k) for stage, k in state_dict.get("eval_k", [])}
        self._checkpointing = bool(state_dict.get("checkpointing", False))
        self._wait = int(state_dict.get("grow_back_wait", self.grow_back_after))
        prefix = "loss_weighting_"
        self.loss_weighting.load_state_dict(
            {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
        )

    _restored_oom_count = 0
    _resumed = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_engine"] = None
        return state

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.checkpoint_modules and not matching_modules(pl_module, self.checkpoint_modules):
            raise ValueError(
                f"`checkpoint_modules` names {list(self.checkpoint_modules)}, but {type(pl_module).__name__} has no such "
                f"submodule; its module types are: {describe_module_types(pl_module)}."
            )
        EngineState.ensure(trainer)
        if stage != "fit":
            return
        refuse_unsupported(Feature.OOM_RECOVERY, trainer, "OOMRecovery", pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, training=True)
        self.failures = []
        self._reset_watch()
        engine = self._engine
        if (
            not self._resumed and self._k != engine.k
        ):  # a checkpoint from before the engine saved k, or a second fit
            engine.propose(self._k, Source.RESUME, "restored from checkpoint")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Strategies that restore a checkpoint after setting up the model (ModelParallelStrategy: FSDP2, HSDP)
        # hand the engine its saved state after `on_fit_start`: take it before the first batch.
        if self._engine is not None and not self._resumed:
            self._resumed = self._engine.resume() is not None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is None:  # `validate` outside of `fit`
            self._attach(trainer, training=False)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is None:
            self._attach(trainer, training=False)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is None:
            self._attach(trainer, training=False)

    def _attach(self, trainer: pl.Trainer, training: bool) -> None:
        try:
            engine = MicroBatchEngine.attach(trainer, self, training=training)
        except RuntimeError as err:
            raise RuntimeError(f"OOMRecovery: {err}") from None
        for rung in self.ladder:
            engine.add_rung(rung)
        engine.restore_eval_k(self._eval_k)
        self._engine = engine
        state = engine.resume()  # turns on the rungs the checkpoint names
        self._resumed = state is not None
        if self._checkpointing and CHECKPOINTING not in engine.active_rungs:
            # a checkpoint written before the engine saved its rungs, or a second fit: the run had turned it on
            engine.turn_on(CHECKPOINTING, "restored from checkpoint")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        if engine is None:
            return
        if self.grow_back:
            probe = get_probe(trainer.strategy.root_device)
            if probe.kind != "cpu":
                probe.reset_peak()
                self._step_start = probe.allocated

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        if engine is None or not self.grow_back:
            return
        step_start, self._step_start = self._step_start, None
        probe = get_probe(trainer.strategy.root_device)
        if step_start is None or probe.kind == "cpu":
            return
        n = engine.batch_size(batch)
        self._clean_steps += 1
        self._retries = [*self._retries[-2:], probe.alloc_retries]
        step = trainer.global_step
        if allocator_thrashing(self._retries) and engine.k < n:
            self._retries = []
            k = smaller_micro_batch_count(engine.k, n)
            self._proposal = Proposal(
                k, Status.THRASH, f"allocator thrashing at step {step} (retries rising)"
            )
            return
        if self._clean_steps < self._wait or not engine.splittable(batch):
            return
        below = recently_failed_size(self._recent_failures, step, self._wait)
        k = grow_back_micro_batch_count(
            engine.k,
            n,
            step_start,
            probe.peak,
            probe.total,
            self.headroom,
            below_size=below,
            max_micro_batch_size=engine.max_micro_batch_size,
        )
        if k is not None:
            self._proposal = Proposal(
                k,
                Status.GROW,
                f"grow back at step {step} (peak {format_bytes(probe.peak)} of {format_bytes(probe.total)})",
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._engine is not None:
            self._k = self._engine.k
            self._eval_k = dict(self._engine.eval_k)
            self._engine.release(self)  # the last release turns the rungs off
            self._engine = None
        self._proposal = None

    # ------------------------------------------------------------------ the engine's questions

    def weighting(self) -> LossWeighting:
        """The engine weights micro-batch losses with :attr:`loss_weighting`."""
        return self.loss_weighting

    def log_keys_to_sum(self) -> frozenset[str]:
        return self.sum_log_keys

    def may_split(self, batch: Any) -> bool:
        """``False`` for a batch declared unsplittable (``unsplittable``)."""
        if self.unsplittable is True:
            return False
        return not self.unsplittable(batch) if callable(self.unsplittable) else True

    def next_proposal(self) -> Proposal | None:
        """The grow-back (or thrashing) proposal made at the end of the last batch, given once."""
        proposal, self._proposal = self._proposal, None
        return proposal

    def decide_oom(self, failure: OOMFailure, smallest_failed: int, splittable: bool) -> Recovery:
        """More micro-batches, else the next rung of the ladder that applies; ``MicroBatchOOMError`` when none is left."""
        self.failures.append(failure)
        if self._engine is not None:
            record_decision(
                self._engine.trainer,
                "oom",
                "OOMRecovery",
                f"OOM in {failure.phase} with micro-batch {failure.micro_batch_size} (k {failure.k}) of a batch of "
                f"{failure.batch_size}: the attempt is dropped and the batch retried",
                **failure.decision_fields(),
            )
        if failure.phase in ("forward", "backward"):
            step = failure.step
            self._recent_failures[failure.micro_batch_size] = step
            if self._grown_at is not None and step - self._grown_at <= self._wait:
                self._wait *= 2  # the grown micro-batch did not hold: wait longer before the next try
            self._grown_at = None
            self._clean_steps = 0
        if not splittable:
            raise MicroBatchOOMError(
                f"Out of memory at step {failure.step} ({failure.phase}) on a batch of {failure.batch_size} samples "
                "declared unsplittable (`unsplittable` of OOMRecovery), so it cannot be split into micro-batches. "
                "Lower `batch_size`, use a lower-memory precision or activation checkpointing, or allow splitting. "
                f"Original error: {failure.message}"
            )
        min_size, why = self._min_size()
        futile = smallest_split_cannot_fit(failure, min_size)
        same_batch = [
            f.per_sample_bytes or 0.0
            for f in self.failures
            if (f.step, f.batch_idx, f.phase) == (failure.step, failure.batch_idx, failure.phase)
        ]
        k = (
            None
            if futile is not None
            else next_micro_batch_count(failure, smallest_failed, self.headroom, min_size, max(same_batch))
        )
        if k is not None and self.max_micro_batches is not None:
            k = min(k, self.max_micro_batches) if failure.k < self.max_micro_batches else None
        if k is not None:
            return Recovery(k)
        for rung in self._engine.available_rungs() if self._engine is not None else []:
            if rung.applies(failure):
                return Recovery(None, rungs=(rung.name,))
        raise MicroBatchOOMError(self._exhausted_message(failure, min_size, why, futile))

    def _min_size(self) -> tuple[int, str]:
        """The fewest samples a micro-batch may have, and why."""
        if self.min_micro_batch_size is not None:
            return self.min_micro_batch_size, f"min_micro_batch_size={self.min_micro_batch_size}"
        module = self._engine.trainer.lightning_module if self._engine is not None else None
        if module is not None and any(
            isinstance(m, _compat.batch_norm_types()) and m.training for m in module.modules()
        ):
            return 2, "BatchNorm in training mode needs more than one value per channel"
        return 1, ""

    def rung_turned_on(self, rung: Rung, reason: str) -> None:
        if isinstance(rung, ActivationCheckpointing):
            self._checkpointing = True
            names = sorted({type(m).__name__ for m in rung.modules})
            what, kind = (
                f"activation checkpointing on for {len(rung.modules)} module(s) ({', '.join(names)})",
                "checkpointing",
            )
        else:
            what, kind = f"{rung.describe()} on", "rung"
        retry = "; retrying the batch" if reason.startswith("OOM") else ""
        message = f"OOMRecovery: {what}: {reason}{retry}."
        record_decision(self._engine.trainer, kind, "OOMRecovery", message, rung=rung.name)
        if self.verbose:
            rank_zero_info(message)

    def k_changed(self, change: KChange) -> None:
        if change.source == "grow back":
            self._grown_at = change.step
            self._clean_steps = 0
        elif change.source in ("oom", "thrash"):
            self._clean_steps = 0
        if change.source not in ("oom", "grow back", "thrash", "resume") or self._engine is None:
            return
        trainer = self._engine.trainer
        n = change.batch_size or 0
        before, after = math.ceil(n / change.k_before), math.ceil(n / change.k_after)
        if change.stage != "train":
            message = (
                f"{change.reason}: {change.stage} batches of {n} run as {change.k_after} chunks of {after}"
            )
        elif n:
            message = (
                f"{change.reason}: micro-batch {before} -> {after} (k {change.k_before} -> {change.k_after}); "
                f"optimizer batch {n * trainer.accumulate_grad_batches * trainer.world_size} kept"
            )
        else:
            message = f"{change.reason}: k {change.k_before} -> {change.k_after}"
        record_decision(
            trainer,
            "micro-batches",
            "OOMRecovery",
            message,
            k_before=change.k_before,
            k_after=change.k_after,
            batch_size=n,
            cause=change.source,
            stage=change.stage,
        )
        if self.verbose and n and change.source != "resume":
            rank_zero_info(message)

    def _exhausted_message(
        self, failure: OOMFailure, min_size: int = 1, why: str = "", futile: int | None = None
    ) -> str:
        trainer = self._engine.trainer
        module = trainer.lightning_module
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        state = 0
        for optimizer in trainer.optimizers:
            for per_param in optimizer.state.values():
                state += sum(
                    v.numel() * v.element_size() for v in per_param.values() if isinstance(v, Tensor)
                )
        parts = [
            f"parameters {format_bytes(params)}",
            f"gradients {format_bytes(grads)}",
            f"optimizer state {format_bytes(state)}",
        ]
        sizes = {"parameters": params, "gradients": grads, "optimizer_state": state}
        if failure.baseline_bytes is not None:  # what the step began with besides the training state
            sizes["other_held"] = max(0, failure.baseline_bytes - params - state)
            parts.append(f"other memory held before the step {format_bytes(sizes['other_held'])}")
        per_sample = failure.per_sample_bytes  # above the baseline, less the gradients held then
        if per_sample is None and failure.demand_bytes is not None:
            per_sample = failure.demand_bytes / failure.micro_batch_size
        if per_sample is not None:
            parts.append(f"activations >= {format_bytes(per_sample)} per sample")
            sizes["activations"] = int(per_sample * failure.micro_batch_size)
        if failure.limit_bytes is not None:
            parts.append(f"limit {format_bytes(failure.limit_bytes)}")
        biggest = largest_part(sizes)
        largest = (
            f" The largest part is {part_label(biggest, split=True)} ({format_bytes(sizes[biggest])}): to cut it, "
            f"{part_advice(biggest, smaller_fits=False, split=True)}."
        )
        limit = (
            ""
            if self.max_micro_batches is None or failure.micro_batch_size <= 1
            else (f" (max_micro_batches={self.max_micro_batches} reached)")
        )
        if self._checkpointing:
            tried = " Activation checkpointing of `checkpoint_modules` was on."
        elif failure.phase in ("forward", "backward"):
            tried = " `OOMRecovery(checkpoint_modules=[...])` can recompute the largest blocks' activations instead."
        else:
            tried = ""
        where = (
            f"step {failure.step} ({failure.phase})"
            if failure.phase in ("forward", "backward")
            else (f"{failure.phase} batch {failure.batch_idx}")
        )
        if futile is not None:
            what = (
                f"Out of memory at {where} with micro-batches of {failure.micro_batch_size} sample(s) (k {failure.k} "
                f"for a batch of {failure.batch_size}), and no smaller micro-batch can fit: the model needs at least "
                f"{min_size} sample(s) per micro-batch ({why or 'the smallest possible'}), and micro-batches of "
                f"{min_size} need at least {format_bytes(futile)} (every micro-batch after the first runs beside all "
                "gradients). "
            )
        else:
            needs = (
                f"; the model needs at least {min_size} samples per micro-batch ({why})"
                if min_size > 1
                else ""
            )
            what = (
                f"Out of memory at {where} even with micro-batches of "
                f"{failure.micro_batch_size} sample(s) (k {failure.k} for a batch of {failure.batch_size}){limit}{needs}. "
            )
        return (
            what
            + f"Memory: {'; '.join(parts)}.{largest}{tried} Next steps: a lower-memory precision (precision='bf16-mixed' or "
            "'16-mixed'), activation checkpointing of the largest blocks, a sharded strategy "
            "(FSDP, DeepSpeed ZeRO) or CPU offload, or a smaller model; for evaluation, a smaller `eval_batch_size`. "
            "PyTorch's allocator setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation. "
            f"Original error: {failure.message}"
        )
