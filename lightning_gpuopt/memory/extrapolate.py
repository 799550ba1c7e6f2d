"""Fewer traces for more answers: the peak as a line in the batch size, a deep model's depth extrapolated
from one and two of its repeated blocks, one trace scaled to another batch size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch  # noqa: F401 (the examples use it)
from torch import nn

from lightning_gpuopt._compat import first_items
from lightning_gpuopt.memory.blocks import block_list
from lightning_gpuopt.memory.predict import predict_peak
from lightning_gpuopt.memory.prediction_types import (
    MemoryCategory,
    PeakPrediction,
    PhasePeak,
    PredictionMethod,
)

__all__ = [
    "BATCH_CATEGORIES",
    "PeakLine",
    "predict_peak_deep",
    "predict_peak_line",
    "scale_to_batch",
]


# ---------------------------------------------------------------------------------------------------
# Peak as a line in the batch size: two traces, extrapolated
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeakLine:
    """``peak(n) = fixed_bytes + per_sample_bytes × n``, from two predictions.

    Attributes:
        fixed_bytes: the part that does not grow with the batch (model state, the optimizer step).
        per_sample_bytes: what each sample adds at the peak.
        predictions: the traced predictions the line goes through.
    """

    fixed_bytes: float
    per_sample_bytes: float
    predictions: tuple[PeakPrediction, ...] = field(default_factory=tuple)

    def peak(self, n: int) -> int:
        """Predicted peak bytes at ``n`` samples (never below the smaller prediction's peak for n past it)."""
        return math.ceil(self.fixed_bytes + self.per_sample_bytes * n)

    def largest_fitting(self, budget_bytes: int, largest: int | None = None) -> int:
        """The largest ``n`` whose predicted peak stays within ``budget_bytes`` (0: not even one sample)."""
        if self.per_sample_bytes <= 0:
            return largest or 0 if self.fixed_bytes <= budget_bytes else 0
        n = int((budget_bytes - self.fixed_bytes) // self.per_sample_bytes)
        while n > 0 and self.peak(n) > budget_bytes:
            n -= 1
        n = max(0, n)
        return min(n, largest) if largest is not None else n


def predict_peak_line(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    sizes: tuple[int, int] = (1, 8),
    **kwargs: Any,
) -> PeakLine:
    """Trace at two batch sizes and draw the line through them (two traces, whatever the size asked later).

    Args:
        model: as for :func:`predict_peak`.
        make_batch: ``make_batch(n)`` returns a batch of ``n`` samples (fake or meta tensors are fine).
        sizes: the two sizes to trace, smaller first.
        **kwargs: passed to :func:`predict_peak`.

    Example:
        >>> net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1))
        >>> line = predict_peak_line(net, lambda n: torch.zeros(n, 64),
        ...                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), step=lambda m, x: m(x).sum())
        >>> line.per_sample_bytes > 0 and line.peak(8) == line.predictions[1].peak_bytes
        True
    """
    small, large = sizes
    if not 0 < small < large:
        raise ValueError(f"`sizes` must be two increasing positive ints, got {sizes!r}")
    a = predict_peak(model, make_batch(small), **kwargs)
    b = predict_peak(model, make_batch(large), **kwargs)
    slope = max(0.0, (b.peak_bytes - a.peak_bytes) / (large - small))
    fixed = b.peak_bytes - slope * large
    return PeakLine(fixed, slope, (a, b))


# ---------------------------------------------------------------------------------------------------
# Deep models: trace one and two repeated blocks, extrapolate in depth
# ---------------------------------------------------------------------------------------------------
#: Categories that grow with the batch (the rest is model state: parameters, gradients, optimizer state, ...).
BATCH_CATEGORIES = (MemoryCategory.ACTIVATIONS, MemoryCategory.TEMPORARIES, MemoryCategory.INPUTS)


def predict_peak_deep(model: nn.Module, batch: Any, *args: Any, **kwargs: Any) -> PeakPrediction:
    """:func:`predict_peak` for a deep model: trace it with one and with two of its repeated blocks, extrapolate.

    A model whose depth is a ``nn.ModuleList`` of identical blocks (a transformer's layers, found by
    :func:`~lightning_gpuopt.memory.blocks.block_list`) costs a trace of its full depth; every block adds
    the same bytes to every category, so two short traces (the list cut to its first one and two blocks,
    restored after) give the full depth's peak: ``P(L) = P(1) + (L - 1) × (P(2) - P(1))``. Models
    without such a list are traced whole. Arguments are those of :func:`predict_peak`.

    Example:
        >>> net = nn.Sequential(*(nn.Linear(64, 64) for _ in range(1)), nn.ModuleList(nn.Linear(64, 64) for _ in range(8)))
        >>> net.forward = lambda x: [x := layer(x) for layer in net[1]][-1]
        >>> kw = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), step=lambda m, x: m(x).sum())
        >>> deep, whole = predict_peak_deep(net, torch.zeros(32, 64), **kw), predict_peak(net, torch.zeros(32, 64), **kw)
        >>> deep.peak_bytes == whole.peak_bytes
        True
    """
    found = block_list(model)
    if found is None:
        return predict_peak(model, batch, *args, **kwargs)
    name, blocks = found
    depth = len(blocks)
    with first_items(blocks, 1):
        one = predict_peak(model, batch, *args, **kwargs)
    if one.method is not PredictionMethod.TRACED:
        return predict_peak(model, batch, *args, **kwargs)
    with first_items(blocks, 2):
        two = predict_peak(model, batch, *args, **kwargs)

    def grow(a: int, b: int) -> int:
        return a + (depth - 1) * (b - a)

    def grow_dict(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: grow(a.get(k, 0), b.get(k, 0)) for k in dict.fromkeys([*b, *a])}

    first = {(ph.phase, ph.step): ph for ph in one.phases}
    phases = tuple(
        PhasePeak(
            ph.phase,
            ph.step,
            grow(first[(ph.phase, ph.step)].peak_bytes, ph.peak_bytes),
            grow_dict(first[(ph.phase, ph.step)].categories, ph.categories),
            grow_dict(first[(ph.phase, ph.step)].modules, ph.modules),
            ph.module,
            grow(first[(ph.phase, ph.step)].host_bytes, ph.host_bytes),
            grow(first[(ph.phase, ph.step)].transient_bytes, ph.transient_bytes),
        )
        for ph in two.phases
        if (ph.phase, ph.step) in first
    )
    best = max(phases, key=lambda ph: ph.peak_bytes)
    note = f"{depth} blocks of {name or 'the model'} extrapolated from traces of 1 and 2"
    return dataclasses.replace(
        two,
        **{**best.at_peak(), "modules": {k: v for k, v in best.modules.items() if v}},
        phases=phases,
        decision="; ".join(filter(None, [note, two.decision])),
    )


def scale_to_batch(prediction: PeakPrediction, n: int) -> int:
    """Peak bytes of ``prediction`` at ``n`` samples: its activations, temporaries and inputs scaled by ``n`` / its batch.

    One trace, extrapolated linearly in the batch size from its own breakdown (the model state does
    not grow with the batch). Exact where the peak's phase stays the same; two traces
    (:func:`predict_peak_line`) also see a phase change.

    Example:
        >>> p = PeakPrediction(300, {"parameters": 100, "activations": 200}, {}, "forward", 1, "", 0, 4,
        ...                    PredictionMethod.TRACED, "cpu")
        >>> scale_to_batch(p, 8)
        500
    """
    growing = sum(prediction.categories.get(c.value, 0) for c in BATCH_CATEGORIES)
    fixed = prediction.peak_bytes - growing
    return fixed + math.ceil(growing * n / max(1, prediction.batch_size))
