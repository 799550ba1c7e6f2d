"""The peak memory of a training step as a function of its (micro-)batch size.

A training step's peak is the larger of its phases: forward and backward grow with the number of
samples ``n`` (linearly for most models, faster for some: anything that pairs samples), the optimizer
step does not. Memory held through the whole step (parameters, gradients, optimizer state, the batch)
is a base under both::

    peak(n) = base + held_per_sample * n + max(forward_backward(n), optimizer)
    forward_backward(n) = intercept + per_sample * n + quadratic * n**2

``held_per_sample`` is for batches that grow with ``n`` and stay on the device through the step (the
batch itself and the next one prefetched, when the batch size itself is being chosen); it is 0 when
only the micro-batch changes. :func:`fit_peak_model` fits :class:`PeakModel` to measured steps
(:class:`StepMeasurement`); :mod:`lightning_gpuopt.batch_size.search` decides which sizes to measure.

Pure Python: no torch, no Lightning, no device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PeakModel", "StepMeasurement", "fit_peak_model", "memory_budget"]

#: Curvature smaller than this share of the measured range is rounding (allocator blocks), not growth.
_CURVATURE_TOLERANCE = 0.001


@dataclass(frozen=True)
class StepMeasurement:
    """What one real training step at ``size`` samples used, in bytes.

    Attributes:
        size: samples in the (micro-)batch of the step.
        forward_backward_bytes: what forward and backward added at their peak above the memory held
            when the step began; ``None`` when the step ran out of memory.
        optimizer_bytes: what the optimizer step added at its peak above the base; ``None`` when it
            did not run (out of memory earlier) or was not measured.
    """

    size: int
    forward_backward_bytes: int | None
    optimizer_bytes: int | None = None

    @property
    def out_of_memory(self) -> bool:
        """Whether the step ran out of memory (nothing was measured)."""
        return self.forward_backward_bytes is None


@dataclass(frozen=True)
class PeakModel:
    """Peak memory of a training step at ``n`` samples: ``base + held·n + max(forward_backward(n), optimizer)``.

    Attributes:
        base_bytes: memory held through every step whatever ``n`` (parameters, gradients, optimizer state, ...).
        intercept_bytes: what forward+backward adds whatever ``n`` (weight-gradient temporaries, workspaces).
        per_sample_bytes: what forward+backward adds per sample (activations kept for backward).
        quadratic_bytes: what it adds per sample squared (models that pair samples); 0 for most.
        optimizer_bytes: what the optimizer step adds (its temporaries); flat in ``n``.
        held_bytes_per_sample: device bytes per sample of batches held through the step (0 when the
            batch is fixed and counted in ``base_bytes``).

    Example:
        >>> model = PeakModel(base_bytes=1000, intercept_bytes=50, per_sample_bytes=10, optimizer_bytes=120)
        >>> model.peak(4), model.peak(20)  # the optimizer step dominates small batches
        (1120, 1250)
        >>> model.largest_size(budget_bytes=1300, smallest=1, largest=1000)
        25
    """

    base_bytes: int
    intercept_bytes: float
    per_sample_bytes: float
    quadratic_bytes: float = 0.0
    optimizer_bytes: int = 0
    held_bytes_per_sample: float = 0.0

    def forward_backward(self, n: int) -> float:
        """What forward and backward add at ``n`` samples."""
        return self.intercept_bytes + self.per_sample_bytes * n + self.quadratic_bytes * n * n

    def peak(self, n: int) -> int:
        """The predicted peak of a step at ``n`` samples, in bytes (rounded up)."""
        phases = max(self.forward_backward(n), self.optimizer_bytes)
        return math.ceil(self.base_bytes + self.held_bytes_per_sample * n + phases)

    def largest_size(self, budget_bytes: float, smallest: int, largest: int) -> int | None:
        """The largest ``n`` in ``[smallest, largest]`` whose predicted peak is within the budget; ``None`` if none is."""
        if smallest > largest or self.peak(smallest) > budget_bytes:
            return None
        lo, hi = smallest, largest
        while lo < hi:  # invariant: peak(lo) fits; the model grows with n on the sizes searched
            mid = (lo + hi + 1) // 2
            if self.peak(mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo


def memory_budget(total_bytes: int, target_fraction: float, reserve_bytes: int = 0) -> int:
    """What a training step may use: the memory this process may use × ``target_fraction`` − ``reserve_bytes``.

    Example:
        >>> memory_budget(1000, 0.9, reserve_bytes=100)
        800
    """
    return int(total_bytes * target_fraction) - int(reserve_bytes)


def fit_peak_model(
    measurements: list[StepMeasurement],
    base_bytes: int,
    held_bytes_per_sample: float = 0.0,
) -> PeakModel | None:
    """The peak model that explains the measured steps; ``None`` when none completed.

    One point gives a pessimistic line through the origin (every byte counted per sample: a lower bound
    on the size that fits as long as forward+backward does not grow faster than linearly). Two points
    give the line through them. From three points on, the three largest sizes decide: when the middle
    one lies clearly below the chord of the outer two, memory grows faster than linearly and the
    parabola through them is used; otherwise the line through the two largest (the local slope, where
    the answer is). Slopes and curvature are never negative: memory does not shrink with more samples.

    Args:
        measurements: the steps measured so far, in any order; out-of-memory steps are ignored.
        base_bytes: see :class:`PeakModel`.
        held_bytes_per_sample: see :class:`PeakModel`.

    Example:
        >>> steps = [StepMeasurement(2, 220, 300), StepMeasurement(10, 1020, 310)]
        >>> fit_peak_model(steps, base_bytes=5000).per_sample_bytes
        100.0
    """
    done = [m for m in measurements if not m.out_of_memory]
    if not done:
        return None
    optimizer = max((m.optimizer_bytes for m in done if m.optimizer_bytes is not None), default=0)
    by_size: dict[int, float] = {}
    for m in done:  # a size measured twice: keep its larger figure
        by_size[m.size] = max(by_size.get(m.size, 0.0), float(m.forward_backward_bytes))
    points = sorted(by_size.items())
    intercept, slope, quadratic = 0.0, points[0][1] / points[0][0], 0.0
    if len(points) >= 2:
        (x1, y1), (x2, y2) = points[-2], points[-1]
        slope = max(0.0, (y2 - y1) / (x2 - x1))
        intercept = y2 - slope * x2
    if len(points) >= 3:
        (x0, y0), (x1, y1), (x2, y2) = points[-3:]
        left, right = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        curvature = (right - left) / (x2 - x0)
        sag = (y0 + (y2 - y0) * (x1 - x0) / (x2 - x0)) - y1  # how far the middle point lies below the chord
        if curvature > 0 and sag > _CURVATURE_TOLERANCE * max(y2 - y0, 1.0):
            quadratic = curvature
            slope = right - curvature * (x1 + x2)
            intercept = y2 - slope * x2 - quadratic * x2 * x2
    return PeakModel(
        base_bytes=int(base_bytes),
        intercept_bytes=intercept,
        per_sample_bytes=slope,
        quadratic_bytes=quadratic,
        optimizer_bytes=int(optimizer),
        held_bytes_per_sample=float(held_bytes_per_sample),
    )
