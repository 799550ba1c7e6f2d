"""The private Lightning, torch and torchmetrics attributes the pack touches, one function each.

When a release moves one of them, ``tests/test_compat.py`` fails here, by name, instead of somewhere deep
inside a training step.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ddp_kwargs",
    "is_compiled",
    "metric_state_names",
    "reset_grad_scaler",
    "should_accumulate",
    "tensor_parallel_size",
]


def is_compiled(module: Any) -> bool:
    """Whether Lightning was handed ``torch.compile(module)`` (it records the compiler in ``_compiler_ctx``)."""
    return getattr(module, "_compiler_ctx", None) is not None


def should_accumulate(trainer: Any) -> bool:
    """Whether the optimizer does not step after the current training batch (Lightning's own rule)."""
    return trainer.fit_loop._should_accumulate()


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel``."""
    return dict(getattr(strategy, "_ddp_kwargs", {}) or {})


def tensor_parallel_size(strategy: Any) -> int:
    """``ModelParallelStrategy``'s tensor-parallel size (1 when not set or ``"auto"``)."""
    size = getattr(strategy, "_tensor_parallel_size", 1)
    return size if isinstance(size, int) else 1


def metric_state_names(metric: Any) -> list[str]:
    """The names of a torchmetrics ``Metric``'s states (``add_state``), in ``_defaults``."""
    return list(metric._defaults)


def reset_grad_scaler(scaler: Any, optimizer: Any) -> None:
    """Forget what a ``torch.amp.GradScaler`` recorded for ``optimizer`` in this step (unscaled, stepped).

    After a step that raised, the scaler would otherwise refuse the next one ("unscale_() has already been
    called on this optimizer since the last update()").
    """
    states = scaler._per_optimizer_states
    if id(optimizer) in states:
        del states[id(optimizer)]
