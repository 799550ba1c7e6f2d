"""What ``torch.compile`` means for the engine's attempts: dynamic batch dimensions, the size-1 cap, and the
recompilations the pack causes (counted, and recorded as decisions with their cause).

The torch.compile facts themselves (which parts are compiled, dynamo's counters) live in
:mod:`lightning_gpuopt._compiled`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_gpuopt._compiled import (
    RecompileBudget,
    caused_compilations,
    compilations_since,
    compile_marker,
    mark_batch_dynamic,
)
from lightning_gpuopt.decisions import record_decision

__all__ = ["CompileWatch"]


class CompileWatch:
    """The engine's view of a module with compiled parts, per stage (``"train"`` or an evaluation stage)."""

    def __init__(self) -> None:
        #: Whether the module has compiled parts: splits mark the batch dimension dynamic.
        self.compiled = False
        #: The recompilations the pack caused in this fit (splits, precision switches).
        self.recompiles = RecompileBudget()
        self._causes: dict[str, str] = {}  # per stage: why its next attempt may recompile
        self._last_k: dict[str, int] = {}
        self._single_ok: set[str] = set()  # stages where a micro-batch of 2 failed under compile

    def cause(self, stage: str) -> str | None:
        """Why ``stage``'s next attempt may recompile besides a new micro-batch size; ``None``: no reason known."""
        return self._causes.get(stage)

    def set_cause(self, cause: str | None, stages: tuple[str, ...]) -> None:
        for stage in stages:
            if cause is None:
                self._causes.pop(stage, None)
            else:
                self._causes[stage] = cause

    def cap(self, n: int, k: int, stage: str) -> int:
        """``k``, lowered under compile so that no micro-batch has 1 sample while 2 may fit: dynamo specialises a
        size of 1, so it would recompile once more."""
        if not self.compiled or stage in self._single_ok or n < 4:
            return k
        return min(k, n // 2)

    def at_cap(self, n: int, k: int, stage: str) -> bool:
        return self.compiled and stage not in self._single_ok and n >= 4 and k == n // 2

    def allow_single(self, stage: str) -> None:
        """Micro-batches of 2 samples did not fit in ``stage``: 1 may run from now on."""
        self._single_ok.add(stage)

    def mark_dynamic(self, chunks: list[Any], samples: Callable[[Any], int]) -> None:
        """Under compile, a split marks the batch dimension dynamic: one recompilation serves every later size."""
        if self.compiled and len(chunks) > 1:
            for chunk in chunks:
                mark_batch_dynamic(chunk, samples(chunk))

    def before_attempt(self) -> tuple[int, Any] | None:
        return compile_marker() if self.compiled else None

    def after_attempt(
        self, trainer: pl.Trainer, marker: tuple[int, Any] | None, stage: str, n: int, k: int
    ) -> None:
        """Count what dynamo compiled during an attempt, and record what the pack's change caused."""
        if marker is None:
            return
        self.recompiles.seen(compilations_since(marker))  # every compilation uses up dynamo's per-frame limit
        last = self._last_k.get(stage)
        self._last_k[stage] = k
        cause = self._causes.pop(stage, None)
        if last is None:  # the stage's first attempt in this fit: its compilation is the model's own
            return
        if k != last:
            before, after = math.ceil(n / last), math.ceil(n / k)
            where = "" if stage == "train" else f" in {stage}"
            cause = f"{'split' if k > last else 'growing back'} {before} → {after}{where}"
            if last == 1:
                cause += " (batch dimension dynamic from now on)"
        if cause is None:
            return
        new, names = caused_compilations(marker)
        if not new:
            return
        self.recompiles.add(new, cause, names)
        record_decision(
            trainer,
            "recompilation",
            "torch.compile",
            f"recompiled after {cause}" + (f" ({new} frames)" if new > 1 else ""),
            frames=new,
            cause=cause,
            stage=stage,
        )
