"""The optimizer of a traced step: found in what ``configure_optimizers`` returns, rebuilt over the fake parameters."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_gpuopt.memory.counter import StorageCounter
from lightning_gpuopt.memory.fake_state import FakeState
from lightning_gpuopt.memory.prediction_types import MemoryCategory, PredictionInputError

__all__ = [
    "build_optimizer",
    "optimizer_in",
]


def _rebuild_optimizer(
    optimizer: torch.optim.Optimizer, mapping: dict[int, torch.Tensor]
) -> torch.optim.Optimizer:
    """The same optimizer type and hyperparameters over the fake parameters, without state."""
    groups = []
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k != "params"}
        new["params"] = [mapping.get(id(p), p) for p in group["params"]]
        groups.append(new)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **kwargs)


def optimizer_in(configured: Any) -> torch.optim.Optimizer | None:
    """The first optimizer in what ``configure_optimizers`` returned, or ``None``.

    Accepts an optimizer, a dict with an ``"optimizer"`` key, and lists or tuples of either (nested a few deep).

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> optimizer_in(([{"optimizer": opt}], [])) is opt
        True
    """
    out = configured
    for _ in range(4):
        if isinstance(out, torch.optim.Optimizer):
            return out
        if isinstance(out, Mapping):
            out = out.get("optimizer")
        elif isinstance(out, (list, tuple)) and out:
            out = out[0]
        else:
            return None
    return out if isinstance(out, torch.optim.Optimizer) else None


def _optimizer_from_configure(module: Any) -> torch.optim.Optimizer | None:
    configure = getattr(module, "configure_optimizers", None)
    return optimizer_in(configure()) if callable(configure) else None


def build_optimizer(
    model: nn.Module, optimizer: Any, state: FakeState, counter: StorageCounter
) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = _rebuild_optimizer(optimizer, state.mapping)
    elif optimizer is not None:
        opt = optimizer(p for p in model.parameters() if p.requires_grad)
    else:
        opt = _optimizer_from_configure(model)
        if opt is None:
            raise PredictionInputError(
                f"`configure_optimizers` of {type(model).__name__} must return an optimizer (or a list or dict "
                "holding one) for the prediction; pass `optimizer=` instead"
            )

    class _StateOf(dict):
        # The optimizer's per-parameter state: a tensor stored here is optimizer state from that moment.
        def __setitem__(self, key: Any, value: Any) -> None:
            super().__setitem__(key, value)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                counter.update(value, MemoryCategory.OPTIMIZER_STATE)

    opt.state = defaultdict(_StateOf)
    return opt
