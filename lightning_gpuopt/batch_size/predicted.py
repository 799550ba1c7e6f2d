"""The size search started from a prediction: traced steps predict the answer, real steps verify it.

:func:`~lightning_gpuopt.memory.predict_peak` traces a training step on fake tensors (nothing
allocated) and says what its forward and backward add above the memory held through the step (the
*transient* bytes: activations and temporaries). :func:`plan_traces` picks the sizes to trace (at
most three, each toward the size predicted to fit, so that the last trace lies near the answer and
memory that grows faster than linearly is traced, not extrapolated), :class:`TransientCurve`
interpolates between them, and :class:`PredictedSearch` runs at most :data:`PREDICTED_TRIALS` real
steps:

1. a small step, the plain search's first: it creates the optimizer state, and the curve is moved
   onto it (memory no trace sees, such as kernel workspaces a device allocates inside its kernels,
   nearly constant in the batch);
2. the largest size the moved curve predicts to fit, aimed 30 % of the extrapolated growth low (the
   traced slope is not checked yet): where the fixed part dominates, a small error in the predicted
   peak is a large error in the size, and the first step removed the fixed part's error;
3. the curve's increments scaled up to the two measured steps where those grew faster (the slope
   checked; a flatter measured chord is not trusted), aimed 2 % of the growth low (or by the traced
   curve's bend), which verifies the answer; or 90 % of the second step when that ran out of memory (if
   it fits, it is within 10 % of the largest that fits).

A first step that does not fit, or steps that end without a verified answer, hand over to the plain
:class:`~lightning_gpuopt.batch_size.search.SizeSearch`, which continues from the shared first step
exactly as it would have alone: the answer is the largest size any step verified, never below the
plain search's. :attr:`PredictedSearch.note` says how the prediction served, or why it handed over.

Pure Python: no torch, no Lightning; :mod:`~lightning_gpuopt.batch_size.trace` traces, the trial steps measure.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from lightning_gpuopt.batch_size.peak_model import StepMeasurement
from lightning_gpuopt.batch_size.search import SearchResult, SizeSearch
from lightning_gpuopt.memory.units import format_bytes

__all__ = [
    "FIRST_STEP_MARGIN",
    "PREDICTED_TRIALS",
    "PredictedSearch",
    "TracedStep",
    "TransientCurve",
    "plan_traces",
]

#: Real steps a search started from a prediction measures before it hands over to the plain search.
PREDICTED_TRIALS = 3
#: The first real step aims its transient bytes this much above the prediction (and so lower in size):
#: a first step that does not fit costs the plain search's four more steps.
FIRST_STEP_MARGIN = 0.15
#: Where the calibrated curve extrapolates past the largest measured step, the step aims this share of the
#: extrapolated growth below the budget: with one measured step (the traced slope, unchecked), with two.
_CURVE_MARGIN = 0.3
_SLOPE_MARGIN = 0.02
#: With two measured steps the share is at least the traced curve's bend (its steepest chord over its
#: flattest, less one; at most _CURVE_MARGIN): two steps calibrate a slope, not where the growth bends (a
#: whole batch's peak moves between the forward and points of the backward as the batch grows).
#: The measured slope is taken as at most this many times the traced one (and never below it).
_MAX_SCALE = 4.0
#: After a calibrated step did not fit, the next aims at this share of it: if it fits, it is within 10 %
#: of the largest that fits (which lies below the size that did not).
_RETREAT = 0.9
#: Traces at most before the first real step (each costs about as much as a real step's wall time, and allocates
#: none of the step: on the CPU, single operator calls measure their kernels' scratch). Each completed real
#: step that a calibrated one follows is traced too.
MAX_TRACES = 3
#: A third trace is skipped when the size it would trace is this close to a traced one (relative).
_CLOSE = 0.05


@dataclass(frozen=True)
class TracedStep:
    """What a traced training step at ``size`` samples adds above the memory it holds, in bytes.

    Attributes:
        size: samples in the traced (micro-)batch.
        forward_backward_bytes: the most activations and temporaries alive at once in forward and backward.
        optimizer_bytes: the most temporaries alive at once in the optimizer step.
        state_bytes: the optimizer state the step creates (held by every later step).
        peak_bytes: the traced peak of the whole step (for reports).
        model_bytes: the parameters and buffers the step holds (0: not reported).
    """

    size: int
    forward_backward_bytes: int
    optimizer_bytes: int = 0
    state_bytes: int = 0
    peak_bytes: int = 0
    model_bytes: int = 0


@dataclass(frozen=True)
class TransientCurve:
    """Predicted forward+backward bytes above the held memory, against the size: piecewise linear through traces.

    Between traced sizes, the chord; past the largest, its last chord's slope (never negative); below the
    smallest, the first chord extended (no lower than the line through the origin). One trace: the line
    through the origin (every byte counted per sample).

    Example:
        >>> curve = TransientCurve((TracedStep(4, 400), TracedStep(20, 1200)))
        >>> curve(2), curve(12), curve(40)
        (300.0, 800.0, 2200.0)
    """

    traces: tuple[TracedStep, ...]

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("a TransientCurve needs at least one traced step, got none")
        object.__setattr__(self, "traces", tuple(sorted(self.traces, key=lambda t: t.size)))

    @property
    def optimizer_bytes(self) -> int:
        return max(t.optimizer_bytes for t in self.traces)

    @property
    def state_bytes(self) -> int:
        return max(t.state_bytes for t in self.traces)

    @property
    def model_bytes(self) -> int:
        return max(t.model_bytes for t in self.traces)

    def __call__(self, n: float) -> float:
        points = [(t.size, float(t.forward_backward_bytes)) for t in self.traces]
        x0, y0 = points[0]
        if len(points) == 1:
            return y0 * n / x0
        if n <= x0:  # the first chord extended down (no lower than through the origin)
            (xa, ya), (xb, yb) = points[:2]
            return max(y0 * n / x0, ya + (yb - ya) * (n - xa) / (xb - xa))
        for (xa, ya), (xb, yb) in itertools.pairwise(points):
            if n <= xb:
                return ya + (yb - ya) * (n - xa) / (xb - xa)
        (xa, ya), (xb, yb) = points[-2:]
        return yb + max(0.0, (yb - ya) / (xb - xa)) * (n - xb)


def _largest_within(fits: Callable[[int], bool], smallest: int, largest: int) -> int | None:
    """The largest ``n`` in ``[smallest, largest]`` with ``fits(n)`` (monotone), or ``None``."""
    if smallest > largest or not fits(smallest):
        return None
    lo, hi = smallest, largest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_traces(
    trace: Callable[[int], TracedStep],
    peak: Callable[[TransientCurve, int], float],
    budget_bytes: float,
    smallest: int,
    largest: int,
    max_traces: int = MAX_TRACES,
) -> TransientCurve:
    """Trace at a small size, then toward the size predicted to fit, and return the curve through the traces.

    The second trace is where the first one's line through the origin reaches the budget (past the answer
    when memory grows faster than linearly, below it when a part does not grow), the third where the
    chord of the first two does: near the answer the curve is a trace, not an extrapolation. When that is
    within 5 % of a traced size, the third is halfway instead, so that the curve bends where memory
    grows faster than linearly. A trace's cost does not depend on its size.

    Args:
        trace: ``trace(n)`` traces a step at ``n`` samples.
        peak: ``peak(curve, n)``: the step's whole peak at ``n`` predicted from ``curve``.
        budget_bytes: the peak to aim at.
        smallest: the smallest size allowed.
        largest: the largest size worth trying.
        max_traces: the most traces.

    Example:
        >>> step = lambda n: TracedStep(n, 100 + 10 * n + n * n)  # memory growing faster than linearly
        >>> curve = plan_traces(step, lambda c, n: 1000 + c(n), 3000, 1, 1024)
        >>> [t.size for t in curve.traces]  # the first trace's line says 32, its chord with the second 44
        [2, 32, 44]
        >>> max(n for n in range(1, 100) if 1000 + curve(n) <= 3000)  # the truth: 38 (39 needs 2011 bytes)
        38
    """
    first = min(largest, max(smallest, 2))
    traces = [trace(first)]
    while len(traces) < max_traces:
        curve = TransientCurve(tuple(traces))
        target = _largest_within(lambda n, c=curve: peak(c, n) <= budget_bytes, smallest, largest) or smallest
        traced = [t.size for t in traces]
        if target in traced or (len(traced) > 1 and any(abs(target - s) <= _CLOSE * s for s in traced)):
            # Near a trace already: halfway to it instead, so that the curve bends where memory does.
            target = (first + max(traced)) // 2
            if target in traced:
                break
        traces.append(trace(target))
    return TransientCurve(tuple(traces))


@dataclass
class PredictedSearch(SizeSearch):
    """A :class:`SizeSearch` whose second real step is the predicted answer (see the module), the rest verify it.

    Use it as a :class:`SizeSearch` (:meth:`next_size`, :meth:`record`, :attr:`result`; the caller keeps
    ``base_bytes`` up to date).

    Args (besides :class:`SizeSearch`'s):
        curve: the traced curve (:func:`plan_traces`).

    Example:
        >>> curve = TransientCurve((TracedStep(2, 240), TracedStep(64, 6440)))
        >>> guided = PredictedSearch(budget_bytes=20_000, base_bytes=5_000, smallest=1, largest=4096, curve=curve)
        >>> def used(n):  # the real step: 10 % more than traced (kernel scratch, say)
        ...     return StepMeasurement(n, int(1.1 * (40 + 100 * n)), 0)
        >>> while (n := guided.next_size()) is not None:
        ...     guided.record(used(n))
        >>> [m.size for m in guided.measurements], guided.result.size, guided.used_prediction  # the truth: 135
        ([2, 105, 135], 135, True)
    """

    curve: TransientCurve | None = None
    #: ``tracer(n)`` traces a step at ``n`` samples: each completed step's size is traced as well.
    tracer: Callable[[int], TracedStep] | None = field(default=None, repr=False)
    #: Why the search handed over to the plain search, or how the prediction served (for reports).
    note: str = ""
    fallback: SizeSearch | None = field(default=None, repr=False)
    #: The first size the calibrated curve predicted, and its predicted peak.
    predicted_size: int | None = None
    predicted_size_peak: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.curve is None:
            raise ValueError("PredictedSearch needs a `curve` (plan_traces), got None")
        self.max_trials = PREDICTED_TRIALS

    # ------------------------------------------------------------------ what the caller reads

    @property
    def used_prediction(self) -> bool:
        """Whether the answer came from the predicted steps alone (no hand-over to the plain search)."""
        return self.fallback is None

    def record(self, measurement: StepMeasurement) -> None:
        super().record(measurement)
        if self.fallback is not None:
            self.fallback.record(measurement)
            return
        self._trace_at(measurement)

    def _trace_at(self, measurement: StepMeasurement) -> None:
        """Trace a completed step's size too: the calibration then compares a measured step with a trace of
        the same size, not with the chord between traces (where memory bends, the chord is off by more than
        any trace)."""
        n = measurement.size
        if self.tracer is None or measurement.out_of_memory or len(self.measurements) >= self.max_trials:
            return  # nothing to trace, or no calibrated step follows
        if any(abs(n - t.size) <= _CLOSE * t.size for t in self.curve.traces):
            return  # a trace this close serves (a short chord would set the slope past the last trace)
        if self.whole_largest and n == self.largest:
            return
        try:
            extra = self.tracer(n)
        except Exception:  # a trace is a help, never a failure: the chord stays
            return
        self.curve = TransientCurve((*self.curve.traces, extra))

    def next_size(self) -> int | None:
        if self.fallback is not None:
            self.fallback.base_bytes = self.base_bytes
            return self.fallback.next_size()
        n = self._guided_next()
        if n is not None or self.fallback is None:
            return n
        return self.next_size()

    @property
    def result(self) -> SearchResult:
        """The largest size any step verified (the predicted ones and, after a hand-over, the plain search's)."""
        return super().result

    # ------------------------------------------------------------------ policy

    def _traced(self) -> str:
        sizes = [str(t.size) for t in self.curve.traces]
        return sizes[0] if len(sizes) == 1 else ", ".join(sizes[:-1]) + " and " + sizes[-1]

    def _hand_over(self, why: str) -> None:
        """Continue as the plain search: its first step is this search's first step, shared."""
        self.note = f"predicted from steps of {self._traced()} samples; {why}: measured instead"
        # This search's settings, but the plain search's own step budget (max_trials).
        kept = {
            f.name: getattr(self, f.name)
            for f in fields(SizeSearch)
            if f.name not in ("max_trials", "measurements")
        }
        self.fallback = SizeSearch(**kept, measurements=[self.measurements[0]])

    def _measured_optimizer(self) -> int | None:
        done = [m.optimizer_bytes for m in self.measurements if m.optimizer_bytes is not None]
        return max(done) if done else None

    def _measured(self) -> list[StepMeasurement]:
        """Completed steps on the curve (not the whole batch), one per size (the latest), by size."""
        by_size = {
            m.size: m
            for m in self.measurements
            if not m.out_of_memory and not (self.whole_largest and m.size == self.largest)
        }
        return [by_size[n] for n in sorted(by_size)]

    def calibrated(self, n: float) -> float:
        """Forward+backward bytes at ``n``: the curve through the measured steps.

        One step: the curve moved to it (a part no trace sees is constant in the size). Two or more: the
        curve's increments from the largest, scaled up to the two largest steps' where those grew faster
        (the traced slope was short by that much), never down.
        """
        points = self._measured()
        if not points:
            return self.curve(n)
        b = points[-1]
        if len(points) == 1:
            return b.forward_backward_bytes + self.curve(n) - self.curve(b.size)
        a = points[-2]
        traced = self.curve(b.size) - self.curve(a.size)
        measured = b.forward_backward_bytes - a.forward_backward_bytes
        # Steeper than traced: the trace missed growth, scale up. Flatter: not trusted, since between traces
        # the curve is a chord and memory that bends past the measured steps lies above it.
        scale = min(_MAX_SCALE, max(1.0, measured / traced)) if traced > 0 and measured > 0 else 1.0
        return b.forward_backward_bytes + scale * (self.curve(n) - self.curve(b.size))

    def calibrated_peak(self, n: int) -> float:
        """The whole step's peak at ``n``: the calibrated curve over the memory held now."""
        optimizer = self._measured_optimizer()
        optimizer = self.curve.optimizer_bytes if optimizer is None else optimizer
        return self.base_bytes + self.held_bytes_per_sample * n + max(self.calibrated(n), optimizer)

    def _slope_margin(self, n: int) -> float:
        """The share of the growth the step after two measured ones aims low at ``n``: :data:`_SLOPE_MARGIN`
        between traces (a chord between two traced sizes), else the traced curve's bend where that is larger
        (its steepest chord over its flattest, less one; at most :data:`_CURVE_MARGIN`, and that where some
        chord does not grow): past the last trace the curve is an extrapolation, and memory may bend there."""
        t = self.curve.traces
        if n <= t[-1].size:
            return _SLOPE_MARGIN
        slopes = [
            (b.forward_backward_bytes - a.forward_backward_bytes) / (b.size - a.size)
            for a, b in itertools.pairwise(t)
        ]
        if len(slopes) < 2:
            return _SLOPE_MARGIN
        if min(slopes) <= 0:  # memory that does not grow somewhere: irregular, no bend to measure
            return _CURVE_MARGIN
        return min(_CURVE_MARGIN, max(_SLOPE_MARGIN, max(slopes) / min(slopes) - 1))

    def _target(self, below: int) -> int | None:
        """The largest size under ``below`` the calibrated curve says fits (the whole batch first), a little low
        where it extrapolates: by a share of the growth past the largest measured size."""
        points = self._measured()

        def budget_for(n: int) -> float:
            if not points or n <= points[-1].size:
                return self.budget_bytes
            share = self._slope_margin(n) if len(points) >= 2 else _CURVE_MARGIN
            return self.budget_bytes - share * (
                self.calibrated_peak(n) - self.calibrated_peak(points[-1].size)
            )

        top = min(self.largest, below - 1)
        if self.whole_largest:
            # The whole batch starts without the micro-batches' gradients, but whether that makes it cheaper
            # depends on where its peak lies: it is tried only where the micro-batch curve says it fits.
            if below > self.largest and self.calibrated_peak(self.largest) <= budget_for(self.largest):
                return self.largest
            top = min(top, self.largest - 1)
        target = _largest_within(lambda n: self.calibrated_peak(n) <= self.budget_bytes, self.smallest, top)
        if target is None:
            return None
        budget = budget_for(target)
        return _largest_within(lambda n: self.calibrated_peak(n) <= budget, self.smallest, top) or target

    def _guided_next(self) -> int | None:
        done = self.measurements
        sizes = {m.size for m in done}
        if not done:  # small, like the plain search's first step: it creates the optimizer state
            first = min(self.largest, max(self.smallest, self.first_size or 2))
            return first
        best, worst = self._bounds()
        if best is None:
            return self._hand_over(f"the first step ({done[0].size} samples) did not fit")
        if best >= self.largest:
            return self._done()
        failed = worst <= self.largest or (self.whole_largest and self.largest in sizes)
        out_of_memory = failed and not any(m.size == worst and not m.out_of_memory for m in done)
        if out_of_memory:
            # Out of memory where the calibrated curve said it fits: 90 % of it, which if it fits is within
            # 10 % of the largest that fits (that lies below the size that did not).
            candidate = math.ceil(_RETREAT * (worst - 1))
        else:
            target = self._target(worst)
            candidate = self._round(target) if target is not None else best
        if candidate <= self._round(best) or candidate in sizes:
            return self._done()
        if len(done) >= self.max_trials:
            if best >= _RETREAT * candidate and not out_of_memory:  # within 10 % of what the curve says fits
                return self._done()
            what = f"{best} samples fit and {worst} did not" if failed else f"{best} samples fit"
            return self._hand_over(
                f"{what}; the calibrated curve points to {candidate}, past {self.max_trials} steps"
            )
        if self.predicted_size is None:
            self.predicted_size = candidate
            self.predicted_size_peak = math.ceil(self.calibrated_peak(candidate))
        return candidate

    def _done(self) -> None:
        if not self.note:
            self.note = (
                f"started from the prediction (steps of {self._traced()} samples predicted, calibrated by the "
                f"first real step, {self.measurements[0].size} samples)"
            )
            if self.predicted_size is not None:
                measured = next(
                    (self.measured_peak(m) for m in self.measurements if m.size == self.predicted_size), None
                )
                outcome = "out of memory" if measured is None else f"measured {format_bytes(measured)}"
                self.note += (
                    f": {self.predicted_size} samples predicted to peak at {format_bytes(self.predicted_size_peak)}, "
                    f"{outcome}"
                )
        return None
