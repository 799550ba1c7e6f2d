"""One attempt at a batch: what it changes, so that a failed attempt leaves no trace.

An attempt runs a batch's micro-batches. Before it, :class:`SideEffects` copies what a failed attempt
must not change (torchmetrics states, BatchNorm running statistics); ``self.log`` calls made during it
are captured in an :class:`Attempt` and emitted once every rank keeps the attempt, averaged over the
micro-batches with their loss weights (or summed, for the keys the user asks to sum).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpuopt import _compat
from lightning_gpuopt.batch_split import UnsplittableBatchError, batch_size_of

__all__ = [
    "Attempt",
    "SideEffects",
    "Snapshot",
    "batch_samples",
    "emit_logs",
    "merge_grads",
    "restore_grads",
    "split_output",
]

try:  # torchmetrics is a dependency, but the engine must not break if a user removed it
    from torchmetrics import Metric as _Metric
except ImportError:  # pragma: no cover
    _Metric = None

#: One captured ``self.log`` call: name, value, positional and keyword arguments, the micro-batch's weight.
LogCall = tuple[str, Any, tuple, dict, float]
Snapshot = list[tuple[Any, dict[str, Any]]]


@dataclass
class Attempt:
    """The side effects of one attempt at a batch, kept so a failed attempt leaves no trace."""

    logs: list[LogCall] = field(default_factory=list)
    #: The running micro-batch's ``self.log`` calls (name, value, args, kwargs): a fresh list per micro-batch,
    #: weighted by :meth:`keep` after it ran, so that a compiled step that logs never guards on a weight.
    calls: list[tuple[str, Any, tuple, dict]] = field(default_factory=list)

    def start(self) -> None:
        """A micro-batch starts: its log calls go to a new list."""
        self.calls = []

    def keep(self, weight: float) -> None:
        """The micro-batch ran: its log calls join the attempt's, with its loss weight."""
        self.logs.extend((name, value, args, kwargs, weight) for name, value, args, kwargs in self.calls)
        self.calls = []


class SideEffects:
    """The module state an attempt changes besides gradients: torchmetrics states and BatchNorm statistics."""

    def __init__(self, module: nn.Module) -> None:
        self.metrics = [m for m in module.modules() if _Metric is not None and isinstance(m, _Metric)]
        self.norms = [
            m for m in module.modules() if isinstance(m, _compat.batch_norm_types()) and m.track_running_stats
        ]

    def snapshot(self) -> Snapshot:
        """A copy of every state an attempt may change."""
        saved: Snapshot = []
        for metric in self.metrics:
            state = {name: _copy_state(getattr(metric, name)) for name in _compat.metric_state_names(metric)}
            state.update(_compat.metric_counters(metric))
            saved.append((metric, state))
        for norm in self.norms:
            buffers = {
                name: buf.clone() for name, buf in norm.named_buffers(recurse=False) if buf is not None
            }
            saved.append((norm, buffers))
        return saved

    @staticmethod
    def restore(snapshot: Snapshot) -> None:
        """Put back what :meth:`snapshot` copied."""
        for obj, state in snapshot:
            if isinstance(obj, _compat.batch_norm_types()):
                for name, value in state.items():
                    getattr(obj, name).copy_(value)
            else:
                for name, value in state.items():
                    setattr(obj, name, _copy_state(value))

    def nbytes(self) -> int:
        """Bytes one snapshot holds."""
        tensors = [b for norm in self.norms for b in norm.buffers(recurse=False) if b is not None]
        tensors += [
            v
            for metric in self.metrics
            for name in _compat.metric_state_names(metric)
            if isinstance(v := getattr(metric, name), Tensor)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)


def emit_logs(
    log: Callable[..., Any], logs: list[LogCall], weights: list[float], n: int, sum_keys: Iterable[str] = ()
) -> None:
    """Emit an attempt's captured ``self.log`` calls once, as if the batch had run whole.

    Values logged by several micro-batches are averaged with the micro-batches' weights (summed for
    ``sum_keys``); a torchmetrics ``Metric`` is logged as is (its state already holds every sample); a
    ``batch_size`` given to ``self.log`` becomes the whole batch's ``n``.
    """
    if len(weights) == 1:
        for name, value, args, kwargs, _ in logs:
            log(name, value, *args, **kwargs)
        return
    grouped: dict[str, list[tuple[Any, tuple, dict, float]]] = {}
    for name, value, args, kwargs, weight in logs:
        grouped.setdefault(name, []).append((value, args, kwargs, weight))
    for name, entries in grouped.items():
        value, args, kwargs, _ = entries[-1]
        if not isinstance(value, (Tensor, int, float)):
            log(name, value, *args, **kwargs)
            continue
        values = [torch.as_tensor(v).detach() for v, *_ in entries]
        if name in sum_keys:
            combined = torch.stack([v.double() for v in values]).sum().to(values[0].dtype)
        else:
            share = sum(w for *_, w in entries)
            combined = sum(v.double() * w for v, (*_, w) in zip(values, entries)) / share
            combined = combined.to(
                values[0].dtype if values[0].is_floating_point() else torch.get_default_dtype()
            )
        kwargs = dict(kwargs)
        if kwargs.get("batch_size") is not None:
            kwargs["batch_size"] = n
        log(name, combined, *args, **kwargs)


def batch_samples(batch: Any) -> int:
    """The samples in ``batch`` as the engine counts them (1 for a batch without a sample dimension: it runs whole)."""
    try:
        return batch_size_of(batch)
    except UnsplittableBatchError:
        return 1


def split_output(out: Any) -> tuple[Tensor | None, dict[str, Any] | None]:
    """A training step's output as (loss, the other entries of a returned dict)."""
    if isinstance(out, Mapping):
        return out.get("loss"), {key: value for key, value in out.items() if key != "loss"}
    return out, None


def restore_grads(params: list[Tensor], stash: list[Tensor | None] | None) -> None:
    """Put back the gradients of earlier batches of an accumulation window (``stash``), dropping the attempt's."""
    if stash is not None:
        for p, old in zip(params, stash):
            p.grad = old


def merge_grads(params: list[Tensor], stash: list[Tensor | None] | None) -> None:
    """Add the kept attempt's gradients to those of earlier batches of the window."""
    if stash is None:
        return
    for p, old in zip(params, stash):
        if old is not None:
            p.grad = old if p.grad is None else old.add_(p.grad)


def _copy_state(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, list):
        return list(value)
    return value
