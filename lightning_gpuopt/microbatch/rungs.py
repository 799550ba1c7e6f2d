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

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_gpuopt.activation_checkpointing import (
    checkpoint_modules,
    matching_modules,
    uncheckpoint_modules,
)
from lightning_gpuopt.oom_policy import OOMFailure

__all__ = ["MORE_MICRO_BATCHES", "ActivationCheckpointing", "Ladder", "Rung"]

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


class Ladder:
    """One engine's recovery rungs past more micro-batches, in order: which are on, which could change nothing.

    A rung's index here is its bit in the ranks' votes (:func:`~lightning_gpuopt.votes.rung_bits`), so every
    callback's rungs must be added alike on every rank.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.rungs: list[Rung] = []
        #: ``listener(rung, reason)``, told after a rung was turned on (by an OOM, or on resume).
        self.listeners: list[Callable[[Rung, str], None]] = []
        #: The names of the rungs turned on in this run (saved with k).
        self.active: list[str] = []
        self._spent: set[str] = set()

    def names(self) -> list[str]:
        return [rung.name for rung in self.rungs]

    def index(self, name: str) -> int:
        """The position of the rung ``name``; raises ``ValueError`` naming the ladder when there is none."""
        try:
            return self.names().index(name)
        except ValueError:
            raise ValueError(
                f"no recovery rung named {name!r} in this run's ladder ({self.names()}); add it with "
                "`MicroBatchEngine.add_rung` (OOMRecovery(rungs=[...]) does)"
            ) from None

    def add(self, rung: Rung) -> None:
        """Add ``rung`` at the end (once per name)."""
        if not isinstance(rung, Rung) or not rung.name:
            raise TypeError(
                f"a recovery rung must be a named `Rung` (lightning_gpuopt.microbatch.rungs), got {rung!r}"
            )
        if rung.name not in self.names():
            self.rungs.append(rung)

    def available(self) -> list[Rung]:
        """The rungs still to try, in order: off, and not found unable to change anything."""
        return [rung for rung in self.rungs if not rung.active and rung.name not in self._spent]

    def turn_on(self, indices: Iterable[int], reason: str) -> bool:
        """Turn on the rungs at ``indices`` on this rank; returns whether anything changed."""
        changed = False
        for i in indices:
            rung = self.rungs[i]
            if rung.active:
                continue
            if not rung.apply(self.trainer, reason):
                self._spent.add(rung.name)  # nothing to change: not asked again in this fit
                continue
            rung.active = changed = True
            if rung.name not in self.active:
                self.active.append(rung.name)
            for listener in list(self.listeners):
                listener(rung, reason)
        return changed

    def turn_off(self) -> None:
        """Undo every rung that is on (the engine is released)."""
        for rung in self.rungs:
            if rung.active:
                rung.undo(self.trainer)
                rung.active = False
