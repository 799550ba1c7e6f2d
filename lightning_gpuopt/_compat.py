"""The private Lightning, torch and torchmetrics attributes the pack touches, one function each.

When a release moves one of them, ``tests/test_compat.py`` fails here, by name, instead of somewhere deep
inside a training step.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "cluster_environment",
    "ddp_kwargs",
    "drop_train_loader",
    "is_compiled",
    "mark_checkpoint_saved",
    "metric_counters",
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


def metric_counters(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s bookkeeping besides its states (updates counted, the cached result), by
    attribute name: copied and restored with the states so that a dropped attempt leaves no trace."""
    return {"_update_count": metric._update_count, "_computed": metric._computed}


def cluster_environment(trainer: Any) -> Any:
    """The Trainer's cluster environment (SLURM, torchelastic, ...), as Lightning detected it."""
    return trainer._accelerator_connector.cluster_environment


def mark_checkpoint_saved(callback: Any, step: int, path: str) -> None:
    """Tell a ``ModelCheckpoint`` that ``path`` was saved at ``step``, so it saves nothing more at this step
    (Lightning's own skip rule) nor again at train end (``save_last``)."""
    callback._last_global_step_saved = step
    callback._last_checkpoint_saved = path
    callback.last_model_path = path


def drop_train_loader(fit_loop: Any) -> None:
    """Make the fit loop rebuild the training DataLoader at the next epoch's start (new ``num_workers``)."""
    if hasattr(fit_loop, "_combined_loader"):
        fit_loop._combined_loader = None
