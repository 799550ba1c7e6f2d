"""The recovery ladder: what the engine tries, in order, when a training step runs out of memory.

The first rung is always more micro-batches (the engine's k, chosen by the OOM handler's policy). When
the micro-batches cannot get smaller, the handler asks the next rungs, in order, for the first that
:meth:`Rung.applies` to the failure; the ranks vote on it (each rung has a bit in the vote), and every
rank :meth:`Rung.apply`\\ s the rungs any rank asked for before the batch is retried. A rung stays on for
the rest of the run; the engine saves which rungs are on (and each rung's :meth:`Rung.state_dict`) and
turns them on again when a run resumes; :meth:`Rung.undo` runs when the engine is released.

To add a rung, subclass :class:`Rung` and pass it to ``OOMRecovery(rungs=[...])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_gpuopt.activation_checkpointing import (
    checkpoint_modules,
    matching_modules,
    uncheckpoint_modules,
)
from lightning_gpuopt.oom_policy import OOMFailure

__all__ = ["MORE_MICRO_BATCHES", "ActivationCheckpointing", "Rung"]

#: The name of the first rung, the engine's own: more micro-batches per batch.
MORE_MICRO_BATCHES = "more micro-batches"


class Rung:
    """One rung of the recovery ladder past more micro-batches.

    Subclasses set :attr:`name` (unique in a run; saved in checkpoints) and implement :meth:`apply`;
    :meth:`applies`, :meth:`undo`, :meth:`state_dict` and :meth:`load_state_dict` have working defaults.
    :meth:`apply` runs on every rank alike, between attempts, outside any ``except`` block.
    """

    #: The rung's name in decisions, reports and checkpoints.
    name: str = ""

    def __init__(self) -> None:
        #: Whether the rung is on in this run (set by the engine around :meth:`apply` and :meth:`undo`).
        self.active = False

    def applies(self, failure: OOMFailure) -> bool:
        """Whether turning this rung on may help with ``failure`` (asked only while it is off)."""
        return failure.phase in ("forward", "backward")

    def apply(self, trainer: pl.Trainer, reason: str) -> bool:
        """Turn the rung on for the rest of the run; returns whether anything changed."""
        raise NotImplementedError

    def undo(self, trainer: pl.Trainer) -> None:
        """Turn the rung off (the engine is released: the fit ended)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps beyond the rung being on (plain values)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take what :meth:`state_dict` returned, before the rung is turned on again on resume."""

    def describe(self) -> str:
        """A few words for messages: what the rung does."""
        return self.name


class ActivationCheckpointing(Rung):
    """Recompute the activations of ``module_types`` in the backward (``torch.utils.checkpoint``).

    Offered by ``OOMRecovery(checkpoint_modules=[...])`` when even the smallest micro-batch does not fit.
    """

    name = "activation checkpointing"

    def __init__(self, module_types: Sequence[str | type[nn.Module]]) -> None:
        super().__init__()
        self.module_types = list(module_types)
        self.modules: list[nn.Module] = []

    def apply(self, trainer: pl.Trainer, reason: str) -> bool:
        self.modules = checkpoint_modules(matching_modules(trainer.lightning_module, self.module_types))
        return True

    def undo(self, trainer: pl.Trainer) -> None:
        uncheckpoint_modules(self.modules)
        self.modules = []

    def describe(self) -> str:
        names = sorted({type(m).__name__ for m in self.modules}) or [str(t) for t in self.module_types]
        return f"activation checkpointing of {len(self.modules)} module(s) ({', '.join(names)})"
