"""The micro-batch engine: the one owner of k (micro-batches per training batch) for a Trainer.

Installed by the first callback that needs it, it wraps ``trainer.strategy.training_step`` so that
each training batch runs as k micro-batches inside Lightning's own step: every micro-batch goes
forward through the original strategy step (autocast and the precision context intact) and backward
through the original ``LightningModule.backward`` (user overrides kept, the loss scaled by the
GradScaler when there is one), each loss weighted by its share of the batch. Lightning gets back one
detached loss for the whole batch and skips its own backward once; ``optimizer_zero_grad`` moves
before the first micro-batch. The optimizer step, clipping, schedulers and every hook after the
backward run as usual, once per batch.

When an attempt raises an out-of-memory error, the engine drops the attempt's partial gradients and
outputs, restores what the attempt touched (torchmetrics states, BatchNorm statistics, captured
``self.log`` calls), frees memory outside the ``except`` block and asks its OOM handler (OOMRecovery)
for a new k, then runs the same batch again. Without a handler the error propagates.

Callbacks talk to the engine through :meth:`MicroBatchEngine.attach`, :meth:`~MicroBatchEngine.propose`
and the ``oom_handler`` attribute; the rest is private.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpuopt.batching import SPLIT_HOOK, UnsplittableBatchError, batch_size_of, split_batch
from lightning_gpuopt.memory import free_memory, get_probe, is_oom_error
from lightning_gpuopt.oom_policy import OOMFailure, parse_tried_bytes

__all__ = ["KChange", "MicroBatchEngine", "WeightFn"]

#: Counts what a micro-batch contributes to the batch's loss (samples, tokens, ...); normalised per batch.
WeightFn = Callable[[Any], "int | float | Tensor"]

_ENGINE_ATTR = "_gpuopt_microbatch_engine"

try:  # torchmetrics is a dependency, but the engine must not break if a user removed it
    from torchmetrics import Metric as _Metric
except ImportError:  # pragma: no cover
    _Metric = None


@dataclass(frozen=True)
class KChange:
    """One change of k, as callbacks and the report see it."""

    step: int
    k_before: int
    k_after: int
    batch_size: int
    source: str
    reason: str


@dataclass
class _Attempt:
    """The side effects of one attempt at a batch, kept so a failed attempt leaves no trace."""

    logs: list[tuple[str, Any, tuple, dict, float]] = field(default_factory=list)
    extras: list[dict[str, Any]] = field(default_factory=list)
    weight: float = 1.0


class _Refused(RuntimeError):
    """A training setup the engine cannot run; raised with the alternative named."""


class MicroBatchEngine:
    """Runs each training batch as k micro-batches; the only owner of k for one Trainer.

    Get it with :meth:`attach` (one engine per Trainer, shared by every callback of the pack) and give
    it back with :meth:`release`; the patches are removed when the last user releases it.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.k = 1
        #: The largest micro-batch size allowed (MemoryAwareBatchSize's budget); ``None``: no cap.
        self.max_micro_batch_size: int | None = None
        #: ``handler(failure, smallest_failed_size, splittable) -> k`` for the retry, or raises.
        #: ``None``: an OOM propagates unchanged.
        self.oom_handler: Callable[[OOMFailure, int, bool], int] | None = None
        #: Counts a micro-batch's share of the loss; ``None``: samples (``batch_size_of``).
        self.weight_fn: WeightFn | None = None
        #: ``"mean"``: losses weighted by their share; ``"sum"``: summed unweighted.
        self.loss_reduction = "mean"
        #: Logged keys summed over micro-batches instead of averaged.
        self.sum_log_keys: frozenset[str] = frozenset()
        #: Whether the current batch may be split; a predicate on the batch.
        self.splittable: Callable[[Any], bool] = lambda batch: True
        self.history: list[KChange] = []
        self.listeners: list[Callable[[KChange], None]] = []
        self._users: set[int] = set()
        self._installed = False
        self._attempt: _Attempt | None = None
        self._skip_backward = False
        self._skip_zero_grad = False
        self._phase = "forward"

    # ------------------------------------------------------------------ public interface

    @classmethod
    def attach(cls, trainer: pl.Trainer, user: object) -> MicroBatchEngine:
        """The Trainer's engine, created and installed on first use; ``user`` holds it until :meth:`release`."""
        engine = getattr(trainer, _ENGINE_ATTR, None)
        if engine is None:
            engine = cls(trainer)
            setattr(trainer, _ENGINE_ATTR, engine)
        engine._users.add(id(user))
        engine._install()
        return engine

    @classmethod
    def get(cls, trainer: pl.Trainer) -> MicroBatchEngine | None:
        """The Trainer's engine if one is attached."""
        return getattr(trainer, _ENGINE_ATTR, None)

    def release(self, user: object) -> None:
        """Stop using the engine; the last user's release removes every patch."""
        self._users.discard(id(user))
        if not self._users:
            self._uninstall()
            if getattr(self.trainer, _ENGINE_ATTR, None) is self:
                delattr(self.trainer, _ENGINE_ATTR)

    def propose(self, k: int, source: str, reason: str, batch_size: int | None = None) -> int:
        """Ask for k micro-batches; returns the k now in force.

        Precedence: a proposal from ``"oom"`` raises k and always wins; any proposal that lowers k is
        capped so the micro-batch stays within :attr:`max_micro_batch_size` (when ``batch_size`` is known).
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` (micro-batches) must be a positive int, got {k!r}")
        if k < self.k and source != "oom" and self.max_micro_batch_size and batch_size:
            k = max(k, math.ceil(batch_size / self.max_micro_batch_size))
        if k != self.k:
            change = KChange(self.trainer.global_step, self.k, k, batch_size or 0, source, reason)
            self.k = k
            self.history.append(change)
            for listener in self.listeners:
                listener(change)
        return self.k

    def snapshot_bytes(self) -> int:
        """Device bytes the engine's own copies hold through a training step, for memory budgets.

        Before each batch the engine copies what a failed attempt must not change (BatchNorm statistics,
        torchmetrics tensor states); 0 until it is installed.
        """
        if not self._installed:
            return 0
        tensors = [b for norm in self._norms for b in norm.buffers(recurse=False) if b is not None]
        tensors += [v for metric in self._metrics for name in metric._defaults if isinstance(v := getattr(metric, name), Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ installation

    def _install(self) -> None:
        if self._installed:
            return
        trainer, module = self.trainer, self.trainer.lightning_module
        self._check_supported(trainer, module)
        self._module = module
        self._orig_training_step = trainer.strategy.training_step
        self._orig_backward = module.backward
        self._orig_zero_grad = module.optimizer_zero_grad
        self._orig_log = module.log
        trainer.strategy.training_step = self._training_step
        module.backward = self._backward
        module.optimizer_zero_grad = self._optimizer_zero_grad
        module.log = self._log
        self._metrics = [m for m in module.modules() if _Metric is not None and isinstance(m, _Metric)]
        self._norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        self._installed = True

    def _uninstall(self) -> None:
        if not self._installed:
            return
        for obj, name in (
            (self.trainer.strategy, "training_step"),
            (self._module, "backward"),
            (self._module, "optimizer_zero_grad"),
            (self._module, "log"),
        ):
            if name in vars(obj):
                delattr(obj, name)
        self._installed = False

    @staticmethod
    def _check_supported(trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not module.automatic_optimization:
            raise _Refused(
                "Micro-batching needs automatic optimization, but the LightningModule sets "
                "`automatic_optimization = False`. Split the batch yourself inside `training_step`, or use "
                "automatic optimization."
            )
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise _Refused(
                f"Micro-batching supports exactly one optimizer, got {len(optimizers)}. Combine the parameter "
                "groups into one optimizer, or remove OOMRecovery for this module."
            )
        if isinstance(optimizers[0], torch.optim.LBFGS):
            raise _Refused(
                "Micro-batching cannot run closure optimizers such as LBFGS (they re-evaluate the closure "
                "several times per step). Use a first-order optimizer such as SGD or AdamW."
            )

    # ------------------------------------------------------------------ patched hooks

    def _backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        # Lightning's backward on the returned (detached) loss: the engine already ran every backward.
        if self._skip_backward:
            self._skip_backward = False
            return None
        return self._orig_backward(loss, *args, **kwargs)

    def _optimizer_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        # Lightning zeroes after training_step; the engine zeroed before the first micro-batch instead.
        if self._skip_zero_grad:
            self._skip_zero_grad = False
            return None
        return self._orig_zero_grad(*args, **kwargs)

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        attempt = self._attempt
        if attempt is None:
            return self._orig_log(name, value, *args, **kwargs)
        attempt.logs.append((name, value, args, kwargs, attempt.weight))
        return None

    # ------------------------------------------------------------------ the training step

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        self._skip_backward = self._skip_zero_grad = False
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", trainer.fit_loop.epoch_loop.batch_idx)
        optimizer = trainer.optimizers[0]
        accumulate = trainer.accumulate_grad_batches
        first_in_window = batch_idx % accumulate == 0  # Lightning's own rule for zeroing
        n = self._batch_size(batch)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if first_in_window:
            self._orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            stash = None
        else:  # keep the gradients of earlier batches of this window apart, so a failure drops only ours
            stash = [p.grad for p in params]
            for p in params:
                p.grad = None
        snapshot = self._snapshot()
        probe = get_probe(trainer.strategy.root_device)
        measured = probe.kind != "cpu"  # host RSS says nothing about one step; read device figures only
        smallest_failed = n + 1
        while True:
            k = self._effective_k(n, batch)
            baseline = probe.allocated if measured else None
            failure: OOMFailure | None = None
            try:
                output = self._run(batch, args[1:], kwargs, n, k, accumulate)
            except Exception as err:
                if self.oom_handler is None or not is_oom_error(err):
                    self._restore_grads(params, stash)
                    raise
                failure = self._describe(err, probe if measured else None, batch_idx, n, k, baseline)
            if failure is None:
                break
            # Outside the except block: the traceback and the activations it pinned are gone.
            for p in params:
                p.grad = None
            self._restore(snapshot)
            free_memory()
            smallest_failed = min(smallest_failed, failure.micro_batch_size)
            new_k = self.oom_handler(failure, smallest_failed, self.splittable(batch))
            self.propose(new_k, "oom", f"OOM at step {failure.step} ({failure.phase})", batch_size=n)
        self._merge_grads(params, stash)
        self._skip_backward = True
        self._skip_zero_grad = first_in_window
        return output

    def _effective_k(self, n: int, batch: Any) -> int:
        if not self.splittable(batch):
            return 1
        k = self.k
        if self.max_micro_batch_size:
            k = max(k, math.ceil(n / self.max_micro_batch_size))
        return max(1, min(k, n))

    def _batch_size(self, batch: Any) -> int:
        try:
            return batch_size_of(batch)
        except UnsplittableBatchError:
            return 1  # no sample dimension: the batch runs whole

    def _micro_batches(self, batch: Any, k: int) -> list[Any]:
        if k == 1:
            return [batch]
        for owner in (self._module, getattr(self.trainer, "datamodule", None)):
            hook = getattr(owner, SPLIT_HOOK, None) if owner is not None else None
            if callable(hook):
                chunks = list(hook(batch, k))
                if len(chunks) != k:
                    raise ValueError(
                        f"`{type(owner).__name__}.{SPLIT_HOOK}(batch, k={k})` must return {k} micro-batches, "
                        f"got {len(chunks)}"
                    )
                return chunks
        return split_batch(batch, k).chunks

    def _weights(self, chunks: list[Any]) -> list[float]:
        if len(chunks) == 1:
            return [1.0]
        if self.loss_reduction == "sum":
            return [1.0] * len(chunks)
        counts = [float(self.weight_fn(c)) if self.weight_fn is not None else float(batch_size_of(c)) for c in chunks]
        total = sum(counts)
        if total <= 0:
            raise ValueError(
                f"The micro-batch weights sum to {total}: the weight function found nothing to count "
                "(no samples or tokens) in this batch. Check `weight_fn` / the token key."
            )
        return [c / total for c in counts]

    def _run(self, batch: Any, rest: tuple, kwargs: dict, n: int, k: int, accumulate: int) -> Any:
        chunks = self._micro_batches(batch, k)
        weights = self._weights(chunks)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        attempt = _Attempt()
        total: Tensor | None = None
        self._attempt = attempt
        try:
            for chunk, weight in zip(chunks, weights):
                self._phase = "forward"
                attempt.weight = weight
                out = self._orig_training_step(chunk, *rest, **kwargs)
                loss, extra = _split_output(out)
                if loss is None:
                    raise _Refused(
                        "training_step returned None (skipping the batch) or no 'loss', which micro-batching "
                        "cannot split. Return the loss for every batch, or remove OOMRecovery."
                    )
                attempt.extras.append(extra)
                self._phase = "backward"
                scaled = loss if weight == 1.0 else loss * weight
                if accumulate != 1:
                    scaled = scaled / accumulate
                if scaler is not None:
                    scaled = scaler.scale(scaled)
                self._orig_backward(scaled)
                part = loss.detach() if weight == 1.0 else loss.detach() * weight
                total = part if total is None else total + part
                del out, loss, scaled
        finally:
            self._attempt = None
        self._emit_logs(attempt.logs, weights, n)
        loss_out = total.clone().requires_grad_(True)  # a leaf: Lightning's own backward on it is skipped
        if attempt.extras and attempt.extras[0] is not None:
            return {"loss": loss_out, **_merge_extras(attempt.extras, k)}
        return loss_out

    def _emit_logs(self, logs: list[tuple[str, Any, tuple, dict, float]], weights: list[float], n: int) -> None:
        if len(weights) == 1:
            for name, value, args, kwargs, _ in logs:
                self._orig_log(name, value, *args, **kwargs)
            return
        grouped: dict[str, list[tuple[Any, tuple, dict, float]]] = {}
        for name, value, args, kwargs, weight in logs:
            grouped.setdefault(name, []).append((value, args, kwargs, weight))
        for name, entries in grouped.items():
            value, args, kwargs, _ = entries[-1]
            if not isinstance(value, (Tensor, int, float)):  # a Metric: its state already holds every sample
                self._orig_log(name, value, *args, **kwargs)
                continue
            values = [torch.as_tensor(v).detach() for v, *_ in entries]
            if name in self.sum_log_keys:
                combined = torch.stack([v.double() for v in values]).sum().to(values[0].dtype)
            else:
                share = sum(w for *_, w in entries)
                combined = sum(v.double() * w for v, (*_, w) in zip(values, entries)) / share
                combined = combined.to(values[0].dtype if values[0].is_floating_point() else torch.get_default_dtype())
            kwargs = dict(kwargs)
            if kwargs.get("batch_size") is not None:
                kwargs["batch_size"] = n
            self._orig_log(name, combined, *args, **kwargs)

    # ------------------------------------------------------------------ side effects of an attempt

    def _snapshot(self) -> list[tuple[Any, dict[str, Any]]]:
        saved: list[tuple[Any, dict[str, Any]]] = []
        for metric in self._metrics:
            state = {name: _copy_state(getattr(metric, name)) for name in metric._defaults}
            state["_update_count"] = metric._update_count
            state["_computed"] = metric._computed
            saved.append((metric, state))
        for norm in self._norms:
            saved.append((norm, {name: buf.clone() for name, buf in norm.named_buffers(recurse=False) if buf is not None}))
        return saved

    @staticmethod
    def _restore(snapshot: list[tuple[Any, dict[str, Any]]]) -> None:
        for obj, state in snapshot:
            if isinstance(obj, _BatchNorm):
                for name, value in state.items():
                    getattr(obj, name).copy_(value)
            else:
                for name, value in state.items():
                    setattr(obj, name, _copy_state(value))

    @staticmethod
    def _restore_grads(params: list[Tensor], stash: list[Tensor | None] | None) -> None:
        if stash is not None:
            for p, old in zip(params, stash):
                p.grad = old

    @staticmethod
    def _merge_grads(params: list[Tensor], stash: list[Tensor | None] | None) -> None:
        if stash is None:
            return
        for p, old in zip(params, stash):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)

    def _describe(
        self, err: BaseException, probe: Any, batch_idx: int, n: int, k: int, baseline: int | None
    ) -> OOMFailure:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        allocated = limit = None
        if probe is not None:
            try:
                allocated, limit = probe.allocated, probe.total
            except Exception:  # a probe that cannot answer must not hide the OOM
                pass
        return OOMFailure(
            step=self.trainer.global_step,
            batch_idx=batch_idx,
            phase=self._phase,
            batch_size=n,
            k=k,
            micro_batch_size=math.ceil(n / k),
            baseline_bytes=baseline,
            allocated_bytes=allocated,
            tried_bytes=parse_tried_bytes(str(err)),
            limit_bytes=limit or None,
            message=message,
        )


def _split_output(out: Any) -> tuple[Tensor | None, dict[str, Any] | None]:
    if isinstance(out, Mapping):
        return out.get("loss"), {key: value for key, value in out.items() if key != "loss"}
    return out, None


def _merge_extras(extras: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Tensors with a sample dimension are concatenated in order; anything else is the last micro-batch's."""
    if len(extras) == 1:
        return extras[0]
    merged: dict[str, Any] = {}
    for key, last in extras[-1].items():
        values = [e.get(key) for e in extras]
        if all(isinstance(v, Tensor) and v.dim() > 0 for v in values):
            merged[key] = torch.cat([v.detach() for v in values])
        else:
            merged[key] = last.detach() if isinstance(last, Tensor) else last
    return merged


def _copy_state(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, list):
        return list(value)
    return value
