"""Activation checkpointing of chosen module types, switched on and off without changing the user's module.

:func:`checkpoint_modules` wraps the ``forward`` of every submodule whose type matches in
``torch.utils.checkpoint.checkpoint`` (non-reentrant, RNG state preserved, so dropout recomputes the
same mask): the forward keeps only the block's inputs, and the backward recomputes what it needs. The
wrapping is an instance attribute, so :func:`uncheckpoint_modules` restores the module exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_modules", "describe_module_types", "matching_modules", "uncheckpoint_modules"]

_MARK = "_gpuopt_checkpointed_forward"
ModuleTypes = Sequence["str | type[nn.Module]"]


def _matches(module: nn.Module, types: ModuleTypes) -> bool:
    cls = type(module)
    for t in types:
        if isinstance(t, type) and isinstance(module, t):
            return True
        if isinstance(t, str) and t in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def matching_modules(root: nn.Module, types: ModuleTypes) -> list[nn.Module]:
    """Submodules of ``root`` (itself excluded) whose type is in ``types`` (classes, class names or qualified names).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> [type(m).__name__ for m in matching_modules(net, ["Linear"])]
        ['Linear', 'Linear']
    """
    return [m for name, m in root.named_modules() if name and _matches(m, types)]


def describe_module_types(root: nn.Module, limit: int = 12) -> str:
    """The distinct submodule type names of ``root``, for error messages."""
    names: list[str] = []
    for name, m in root.named_modules():
        if name and type(m).__name__ not in names:
            names.append(type(m).__name__)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def checkpoint_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Turn on activation checkpointing for each module; returns those that were not checkpointed yet.

    Example:
        >>> import torch
        >>> block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        >>> changed = checkpoint_modules([block])
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> block(x).sum().backward()   # the same result, recomputed in the backward
        >>> len(changed), len(checkpoint_modules([block]))
        (1, 0)
        >>> uncheckpoint_modules(changed)
    """
    changed = []
    for module in modules:
        if _MARK in vars(module):
            continue
        setattr(module, _MARK, vars(module).get("forward"))  # an instance-level forward, kept to restore
        module.forward = _CheckpointedForward(module)
        changed.append(module)
    return changed


def uncheckpoint_modules(modules: Iterable[nn.Module]) -> None:
    """Undo :func:`checkpoint_modules` for these modules."""
    for module in modules:
        if _MARK not in vars(module):
            continue
        original = vars(module).pop(_MARK)
        if original is None:
            vars(module).pop("forward", None)
        else:
            module.forward = original


class _CheckpointedForward:
    """``module.forward`` run under ``torch.utils.checkpoint`` (a class, not a closure, so modules still pickle)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = vars(self.module).get(_MARK) or type(self.module).forward.__get__(self.module)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)
