"""Evaluation's own batch size, from measured evaluation steps.

An evaluation step keeps no activations for a backward, makes no gradients and runs no optimizer step, so it
fits many more samples than a training step; Lightning runs it at the training's batch size (#9219). Here a
validation step is measured on the validation dataset's own samples, collated and moved as its loader does,
under ``torch.no_grad`` and the precision's evaluation context, at two sizes; what it adds at its peak is fitted
as ``a + b·n``, and the answer is the largest ``n`` whose step fits the budget beside what training holds through
evaluation (its gradients and optimizer state: a trial before the first optimizer step has neither). The answer is
measured once more before it is used; a step over the budget there steps down.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gpuopt.batch_size.modes import first_items, host_batch
from lightning_gpuopt.memory import MemoryProbe, free_memory, is_oom_error

__all__ = ["EvalSizing", "evaluation_runner", "find_eval_batch_size"]

#: Measurements of the answer after the first: each steps down to what the line says fits at the measured size.
_VERIFY_TRIES = 3


@dataclass(frozen=True)
class EvalSizing:
    """What the evaluation search measured and chose.

    Attributes:
        size: the evaluation batch size (samples); at least 1.
        measured: ``(samples, bytes the step added at its peak, or None where it ran out of memory)``, in order.
        budget_bytes: what a step may use at its peak.
        held_bytes: what training holds through evaluation that the measurements did not see.
    """

    size: int
    measured: tuple[tuple[int, int | None], ...]
    budget_bytes: int
    held_bytes: int

    def line(self) -> str:
        shown = ", ".join(f"{n}" + (" (out of memory)" if b is None else "") for n, b in self.measured)
        return f"measured validation steps at {shown} sample(s)"


def find_eval_batch_size(
    module: pl.LightningModule,
    probe: MemoryProbe,
    run_step: Callable[[int], None],
    *,
    start: int,
    largest: int,
    budget_bytes: int,
    held_bytes: int,
) -> EvalSizing:
    """The largest evaluation batch whose step fits ``budget_bytes`` beside ``held_bytes``.

    ``run_step(n)`` runs one evaluation step on ``n`` samples (leaving nothing behind). The module is put in
    evaluation mode for the measurements and back as it was.
    """
    measured: list[tuple[int, int | None]] = []
    training = module.training
    module.eval()
    try:
        first = min(start, largest)
        second = min(2 * first, largest)
        base = probe.allocated
        room = budget_bytes - held_bytes - base
        points = []
        for n in dict.fromkeys((first, second)):
            added = _measure(probe, run_step, n)
            measured.append((n, added))
            if added is None:
                break
            points.append((n, added))
        size = _answer(points, room, largest)
        for _ in range(_VERIFY_TRIES):
            if size in (n for n, _ in points) or size <= 1:
                break
            added = _measure(probe, run_step, size)
            measured.append((size, added))
            if added is not None and added <= room:
                break
            points.append((size, added if added is not None else 2 * room))
            size = max(1, min(size - 1, _answer(points[-2:], room, largest)))
    finally:
        module.train(training)
    return EvalSizing(max(1, size), tuple(measured), budget_bytes, held_bytes)


def _answer(points: list[tuple[int, int]], room: int, largest: int) -> int:
    """The largest size the line through ``points`` fits in ``room`` (the one point's share with one point)."""
    if not points:
        return 1
    if len(points) == 1:
        n, added = points[0]
        per_sample = max(added / n, 1.0)
        return max(1, min(largest, math.floor(room / per_sample)))
    (n1, b1), (n2, b2) = points[-2], points[-1]
    slope = max((b2 - b1) / (n2 - n1), 1.0)
    intercept = b2 - slope * n2
    return max(1, min(largest, math.floor((room - intercept) / slope)))


def _measure(probe: MemoryProbe, run_step: Callable[[int], None], n: int) -> int | None:
    free_memory(generation=1)
    start = probe.allocated
    probe.reset_peak()
    try:
        with torch.no_grad():
            run_step(n)
    except Exception as err:
        if not is_oom_error(err):
            raise
        out_of_memory = True
    else:
        out_of_memory = False
    if out_of_memory:
        free_memory()
        return None
    added = probe.peak - start
    free_memory(generation=1)
    return added


def evaluation_runner(trainer: pl.Trainer, module: pl.LightningModule, loader: Any) -> Callable[[int], None]:
    """``run_step(n)``: a validation step on the first ``n`` samples of ``loader``'s dataset, collated and moved to
    the device as the loader's batches are, under the precision's evaluation context, its logged values dropped."""
    dataset, collate = loader.dataset, loader.collate_fn

    def run_step(n: int) -> None:
        batch = trainer.strategy.batch_to_device(
            host_batch(trainer, module, first_items(dataset, n), collate)
        )
        saved = {name: vars(module).get(name) for name in ("log", "log_dict")}
        module.log = module.log_dict = _silent  # type: ignore[method-assign]
        try:
            with trainer.precision_plugin.val_step_context():
                output = module.validation_step(batch, 0)
            del output, batch
        finally:
            for name, value in saved.items():
                if value is None:
                    vars(module).pop(name, None)
                else:
                    setattr(module, name, value)

    return run_step


def _silent(*args: Any, **kwargs: Any) -> None:
    return None
