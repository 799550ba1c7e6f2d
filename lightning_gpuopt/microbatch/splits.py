"""k, the evaluation k per stage, and their history: how many micro-batches each batch runs as.

:class:`Splits` holds them for the engine. A change goes through :meth:`Splits.propose` (training) or
:meth:`Splits.set_eval_k` (an evaluation stage, after an agreed OOM there); each one is recorded as a
:class:`KChange` and told to the engine's users. What a batch runs as now (:meth:`Splits.effective_k`)
also asks the users whether it may be split and how large a micro-batch may be, and lowers k under
torch.compile where a micro-batch of one sample would recompile once more (``compile_watch.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_gpuopt._validate import positive_int
from lightning_gpuopt.microbatch.compile_watch import CompileWatch
from lightning_gpuopt.votes import Source

__all__ = ["KChange", "Splits"]


@dataclass(frozen=True)
class KChange:
    """One change of k, as callbacks and the report see it.

    ``stage`` is ``"train"`` for the training k, or the evaluation stage (``"validation"``, ``"test"``,
    ``"predict"``) whose batches are split from now on.
    """

    step: int
    k_before: int
    k_after: int
    batch_size: int
    source: Source
    reason: str
    stage: str = "train"


class Splits:
    """The engine's k and evaluation k, changed only through :meth:`propose` and :meth:`set_eval_k`.

    Args:
        trainer: the Trainer (its step dates each change).
        watch: torch.compile's part (the size-1 cap).
        may_split: whether a batch may be split (the users' composed answer).
        cap: the largest micro-batch allowed (the users' composed answer; ``None``: no cap).
        told: told each :class:`KChange` (the users, in order).
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        watch: CompileWatch,
        may_split: Callable[[Any], bool],
        cap: Callable[[], int | None],
        told: Callable[[KChange], None],
    ) -> None:
        self.trainer, self.watch = trainer, watch
        self.may_split, self.cap, self.told = may_split, cap, told
        #: Micro-batches per training batch (before the cap, the batch's samples and compile lower or raise it).
        self.k = 1
        #: Chunks per evaluation batch, per stage, after an OOM there.
        self.eval_k: dict[str, int] = {}
        self.history: list[KChange] = []

    def effective_k(self, n: int, batch: Any) -> int:
        """The micro-batches a training batch of ``n`` samples runs as now: k, raised to keep micro-batches within
        the users' cap, at most one per sample, 1 for a batch a user does not allow to split."""
        if not self.may_split(batch):
            return 1
        k = self.k
        cap = self.cap()
        if cap:
            k = max(k, math.ceil(n / cap))
        return self.watch.cap(n, max(1, min(k, n)), "train")

    def eval_k_of(self, stage: str, n: int, batch: Any) -> int:
        """The chunks an evaluation batch of ``n`` samples runs as now."""
        k = max(1, min(self.eval_k.get(stage, 1), n)) if self.may_split(batch) else 1
        return self.watch.cap(n, k, stage)

    def propose(self, k: int, source: Source | str, reason: str, batch_size: int | None = None) -> int:
        """Ask for k micro-batches; returns the k now in force.

        Precedence: a proposal from ``"oom"`` raises k and always wins; any other proposal that lowers k is
        capped so the micro-batch stays within the users' cap (when ``batch_size`` is known).
        """
        positive_int("k", k, unit="micro-batches")
        source = _as_source(source)  # a caller's own source stays
        if k < self.k and source is not Source.OOM and batch_size:
            cap = self.cap()
            if cap:
                k = max(k, math.ceil(batch_size / cap))
        if k != self.k:
            change = KChange(self.trainer.global_step, self.k, k, batch_size or 0, source, reason)
            self.k = k
            self._notify(change)
        return self.k

    def set_eval_k(self, stage: str, k: int, reason: str, batch_size: int) -> None:
        """Split ``stage``'s batches into ``k`` chunks from now on (after an agreed OOM there)."""
        before = self.eval_k.get(stage, 1)
        change = KChange(self.trainer.global_step, before, k, batch_size, Source.OOM, reason, stage)
        self.eval_k[stage] = k
        self._notify(change)

    def restore_eval_k(self, eval_k: dict[str, int]) -> None:
        """Take evaluation k's restored from a checkpoint, where none is set yet (no change is announced)."""
        for stage, k in eval_k.items():
            self.eval_k.setdefault(str(stage), int(k))

    def _notify(self, change: KChange) -> None:
        self.history.append(change)
        self.told(change)


def _as_source(source: Source | str) -> Source | str:
    """``source`` as a :class:`Source` when it names one; a caller's own source as it is."""
    try:
        return Source(source)
    except ValueError:
        return source
