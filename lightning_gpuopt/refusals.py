"""What a callback refuses in ``setup``, read from the Trainer: its strategy, its other callbacks, the module.

The rules and their words are :mod:`lightning_gpuopt.support`'s (pure: strategies, features, modules); this
module reads them off a Trainer, so that the rules take no Trainer.
"""

from __future__ import annotations

from typing import Any

from lightning_gpuopt._compat import is_compiled
from lightning_gpuopt._compiled import cuda_graphs_refusal
from lightning_gpuopt.support import (
    SETUP_WORDS,
    Feature,
    manual_optimization_refusal,
    supports,
    unsupported_strategy,
)

__all__ = ["refuse_unsupported", "setup_refusal"]


def setup_refusal(feature: Feature, trainer: Any, module: Any) -> str | None:
    """Why ``feature``'s callback cannot run this Trainer and module, naming what to do instead; ``None`` when it can.

    Asked in ``setup``, after the strategy: automatic optimization, Lightning's ``BatchSizeFinder`` in the same
    Trainer, a ``torch.compile``'d LightningModule under a strategy that refuses it, CUDA graphs on a CUDA device.
    """
    from lightning.pytorch.callbacks import BatchSizeFinder

    feature = Feature(feature)
    refusal = manual_optimization_refusal(feature, module)
    if refusal is not None:
        return refusal
    if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
        words = SETUP_WORDS[feature]
        return (
            f"{feature.value} cannot run beside Lightning's BatchSizeFinder ({words.finder_why}). Remove "
            f"BatchSizeFinder: {words.finder_instead}."
        )
    compiled = supports(feature, trainer.strategy, compiled=is_compiled(module))
    if not compiled.supported:
        return f"{feature.value} does not support a torch.compile'd LightningModule here: {compiled.reason}."
    return cuda_graphs_refusal(module, trainer.strategy.root_device, feature.value)


def refuse_unsupported(feature: Feature, trainer: Any, who: str, module: Any = None) -> None:
    """Raise the ``RuntimeError`` with which ``who`` (a callback) refuses this Trainer in ``setup``.

    First the strategy (:func:`unsupported_strategy`, from the table), then, given the LightningModule,
    the setups of :func:`setup_refusal`. Returns when ``feature`` can run.
    """
    reason = unsupported_strategy(trainer.strategy, feature)
    if reason is not None:
        raise RuntimeError(f"{who}: {reason}")
    refusal = setup_refusal(feature, trainer, module) if module is not None else None
    if refusal is not None:
        raise RuntimeError(refusal)
