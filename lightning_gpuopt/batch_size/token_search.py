"""``max_tokens`` from memory: MemoryAwareBatchSize's search for a GPUOptDataModule that batches by tokens.

At fit start, before the training loader exists, a few real training steps (leaving no trace, as the batch-size
search's) run on batches of the training dataset's own samples at chosen shapes: 2 and 8 samples near the median
length (the 2 twice: the first step allocates what every later one holds), 2 and 4 near the longest. What each adds above the memory held through a step -- its forward and backward,
the batch itself and the batches the data pipeline holds ahead -- is fitted in (batch, length)
(:mod:`~lightning_gpuopt.batch_size.token_peaks`), and ``max_tokens`` is the largest budget whose costliest batch
-- of those the sampler forms at that budget -- fits: a step then never needs a split, whatever the length of its
samples.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_gpuopt.batch_size.find import STEP_SLACK_BYTES
from lightning_gpuopt.batch_size.peak_model import memory_budget
from lightning_gpuopt.batch_size.token_peaks import ShapeMeasurement, TokenPeakModel, fit_token_peaks
from lightning_gpuopt.batch_size.trial import TrialSteps
from lightning_gpuopt.memory import MemoryProbe, format_bytes
from lightning_gpuopt.memory.walk import batch_nbytes

__all__ = ["TokenSearchRun", "samples_near", "search_max_tokens"]


@dataclass(frozen=True)
class TokenSearchRun:
    """What the search measured and chose.

    Attributes:
        max_tokens: the budget chosen (``None``: even one sample of the longest length does not fit).
        model: the fitted memory model (bytes a step adds above ``held_bytes``).
        shapes: the measured shapes (``(size, length)``), out-of-memory ones left out.
        budget_bytes: what a step may use at its peak.
        held_bytes: what every step holds (parameters, gradients, optimizer state).
        costliest: the ``(size, length)`` of the costliest batch at ``max_tokens``.
        elapsed: the search's wall time, in seconds.
    """

    max_tokens: int | None
    model: TokenPeakModel
    shapes: tuple[ShapeMeasurement, ...]
    budget_bytes: int
    held_bytes: int
    costliest: tuple[int, int] | None
    elapsed: float

    def line(self) -> str:
        """One line for the log: what was measured and what was chosen."""
        shapes = ", ".join(f"{m.size}x{m.length}" for m in self.shapes)
        if self.max_tokens is None or self.costliest is None:
            return f"measured {shapes}: even one sample of the longest length does not fit {format_bytes(self.budget_bytes)}"
        size, length = self.costliest
        peak = self.held_bytes + self.model.added(size, length)
        return (
            f"max_tokens='auto' -> {self.max_tokens} (measured {shapes} in {self.elapsed:.1f} s; the costliest batch, "
            f"{size} x {length} tokens, predicted at {format_bytes(peak)} of a {format_bytes(self.budget_bytes)} budget)"
        )


def samples_near(lengths: Sequence[int], size: int, length: int) -> list[int]:
    """The ``size`` samples at most ``length`` long whose lengths are closest to it (lowest indices on ties).

    Example:
        >>> samples_near([5, 9, 7, 9, 12], 2, 9)
        [1, 3]
    """
    fitting = [i for i, n in enumerate(lengths) if n <= length]
    return sorted(sorted(fitting, key=lambda i: (length - lengths[i], i))[:size])


def search_max_tokens(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    probe: MemoryProbe,
    dataset: Any,
    lengths: Sequence[int],
    collate: Callable[[list[Any]], Any],
    shapes_at: Callable[[int], Iterable[tuple[int, int]]],
    *,
    target_fraction: float,
    engine_bytes: int,
    ahead: int,
) -> TokenSearchRun:
    """Measure a few shapes of real training steps on the dataset's samples, and choose ``max_tokens``.

    Args:
        trainer, module, probe: as for the batch-size search.
        dataset, lengths, collate: the training dataset, its samples' lengths, and the loader's collate.
        shapes_at: the ``(size, length)`` of every batch a budget forms (the sampler's own batches).
        target_fraction: the share of the memory this process may use that a step may take at its peak.
        engine_bytes: what the micro-batch engine holds through a real step.
        ahead: batches the data pipeline holds on the device beside the one a step runs.
    """
    started = time.perf_counter()
    budget = memory_budget(probe.total, target_fraction)
    median, longest = int(statistics.median_low(lengths)), max(lengths)
    # The first step allocates what every later one holds (gradients, optimizer state, workspaces): measured,
    # then measured again, so that no shape's figure carries it.
    wanted = [(2, median), (2, median), (8, median), (2, longest), (4, longest)]
    shapes: list[ShapeMeasurement] = []
    held = probe.allocated
    with TrialSteps(trainer, module, probe) as trials:
        for size, length in wanted:
            chosen = samples_near(lengths, size, length)
            if len(chosen) < size:
                continue
            host = collate([dataset[i] for i in chosen])
            batch = trainer.precision_plugin.convert_input(module.on_before_batch_transfer(host, 0))
            before = probe.allocated
            batch = trainer.strategy.batch_to_device(batch)
            nbytes = max(batch_nbytes(batch), probe.allocated - before)
            measured = trials.measure(batch, size, nbytes, whole=True)
            del batch
            if measured is None or measured.out_of_memory:
                continue
            step = max(measured.forward_backward_bytes or 0, measured.optimizer_bytes or 0)
            real = max(lengths[i] for i in chosen)
            shapes = [
                s for s in shapes if (s.size, s.length) != (size, real)
            ]  # the later of two measurements
            shapes.append(ShapeMeasurement(size, real, step + (1 + ahead) * nbytes))
        held = trials.held_bytes if trials.held_bytes is not None else held
    extra = (
        engine_bytes + STEP_SLACK_BYTES + (trials.grad_bytes if trainer.accumulate_grad_batches > 1 else 0)
    )
    elapsed = time.perf_counter() - started
    if len(shapes) < 2:  # the smallest shapes ran out of memory: nothing to fit, nothing fits
        return TokenSearchRun(
            None, TokenPeakModel(0.0, 0.0), tuple(shapes), budget, held + extra, None, elapsed
        )
    model = fit_token_peaks(shapes)
    tokens = model.max_tokens(shapes_at, longest, budget - held - extra)
    costliest = model.costliest(shapes_at(tokens)) if tokens is not None else None
    return TokenSearchRun(tokens, model, tuple(shapes), budget, held + extra, costliest, elapsed)
