"""The few-step search for the largest (micro-)batch that fits, and the loop that runs a search's trial steps.

:class:`SizeSearch` picks which sizes to measure (at most four real steps), fits
:class:`~lightning_gpuopt.batch_size.peak_model.PeakModel` to what they used, and answers the largest
size whose *measured* step stays within the budget.
:func:`run_trials` drives it with a source of trial steps (:class:`Trials`: the real
:class:`~lightning_gpuopt.batch_size.trial.TrialSteps`, or a test's stand-in).

Pure Python: no torch, no Lightning, no device; the trial steps measure and these functions decide.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from lightning_gpuopt.batch_size.peak_model import PeakModel, StepMeasurement, fit_peak_model

__all__ = ["MAX_TRIALS", "SearchResult", "SizeSearch", "TrialBatch", "Trials", "run_trials"]

#: Real steps a search measures at most (the last one verifies the answer).
MAX_TRIALS = 4
#: How far past the first size the second measurement goes (one point cannot tell a large constant part
#: from a large slope; a close second point would make a badly conditioned slope, a farther one could
#: run out of memory where memory grows faster than linearly).
_SECOND_STEP_GROWTH = 8
#: Before three points exist, a target more than this far past the largest size that fitted is
#: approached in a geometric step, so the third point lands where the model can still be checked.
_CAUTIOUS_RATIO = 1.5
#: When the verifying step lies past the measured sizes, it aims this share of the extrapolated growth
#: below the budget, so that rounding in the measurements does not make it fail.
_EXTRAPOLATION_MARGIN = 0.02
#: A step that would raise the answer by less than this share of the largest size that fitted is not run: it
#: costs a whole step at about the answer for a batch under 2 % larger (the whole batch of
#: ``whole_largest`` excepted: it saves the micro-batching).
_MIN_GAIN = 0.02


@dataclass(frozen=True)
class SearchResult:
    """The outcome of a :class:`SizeSearch`.

    Attributes:
        size: the answer: the largest size measured within the budget, rounded down to ``multiple_of``
            (unless it is the largest size allowed); ``None`` when even the smallest did not fit.
        verified_size: the largest size measured within the budget (``size`` before rounding).
        predicted_peak_bytes: the model's peak at ``size`` (``None`` without a size).
        measured_peak_bytes: the peak measured at ``verified_size`` (``None`` without a size).
        model: the model fitted to every measurement (``None`` when no step completed).
        measurements: every measured step, in order.
    """

    size: int | None
    verified_size: int | None
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    model: PeakModel | None
    measurements: tuple[StepMeasurement, ...]


@dataclass
class SizeSearch:
    """Chooses the sizes to measure, at most :data:`MAX_TRIALS` real steps, and the largest that fits the budget.

    Ask :meth:`next_size`, measure a real step at that size, :meth:`record` it; repeat until
    :meth:`next_size` returns ``None``, then read :attr:`result`. The sizes: a small first step; a
    second where the pessimistic one-point model says there is still plenty of room (at most 8× the
    first); then toward the model's answer, geometrically while only two points exist (a model that
    grows faster than linearly shows from the third); the last step verifies the prediction. The
    answer is always a size that was measured within the budget.

    Args:
        budget_bytes: what a step may use at its peak.
        base_bytes: see :class:`PeakModel`.
        smallest: the smallest size allowed (``min_batch_size``).
        largest: the largest size worth trying (the batch size, ``max_batch_size``, the dataset).
        multiple_of: answers at least this large are rounded down to a multiple of it, except ``largest``.
        held_bytes_per_sample: see :class:`PeakModel`.
        max_trials: the most real steps to measure.
        whole_largest: a step at ``largest`` runs the batch whole, unlike the micro-batch steps the other
            sizes stand for, and starts without the ``grad_bytes`` of gradients they hold: it is judged on
            its own measurement and is no point of the model. It is tried as soon as the model allows it
            could fit (it would be the answer), and when no smaller size fits.
        grad_bytes: see ``whole_largest``.
        first_size: the first size to measure; ``None``: 2 (or the nearest allowed). Small enough to fit
            where anything does, large enough that its step is dominated by what grows with the size.

    Example:
        >>> def used(n):  # a fake step: 40 B + 10 B per sample, optimizer step 100 B
        ...     return StepMeasurement(n, 40 + 10 * n, 100)
        >>> search = SizeSearch(budget_bytes=1500, base_bytes=1000, smallest=1, largest=4096)
        >>> while (n := search.next_size()) is not None:
        ...     search.record(used(n))
        >>> search.result.size, len(search.result.measurements)
        (45, 4)
    """

    budget_bytes: int
    base_bytes: int
    smallest: int
    largest: int
    multiple_of: int = 1
    held_bytes_per_sample: float = 0.0
    max_trials: int = MAX_TRIALS
    whole_largest: bool = False
    grad_bytes: int = 0
    first_size: int | None = None
    measurements: list[StepMeasurement] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.smallest < 1 or self.largest < self.smallest:
            raise ValueError(
                f"sizes must satisfy 1 <= smallest <= largest, got smallest={self.smallest}, largest={self.largest}"
            )
        if self.multiple_of < 1:
            raise ValueError(f"`multiple_of` must be a positive int, got {self.multiple_of}")

    # ------------------------------------------------------------------ what the caller uses

    def record(self, measurement: StepMeasurement) -> None:
        """Add a measured step."""
        self.measurements.append(measurement)

    def measured_peak(self, measurement: StepMeasurement) -> int | None:
        """The whole step's peak from a measurement (``None`` when it ran out of memory)."""
        if measurement.out_of_memory:
            return None
        phases = max(measurement.forward_backward_bytes, measurement.optimizer_bytes or 0)
        return math.ceil(self.base_bytes + self.held_bytes_per_sample * measurement.size + phases)

    def fits(self, measurement: StepMeasurement) -> bool:
        """Whether a measured step stayed within the budget."""
        peak = self.measured_peak(measurement)
        return peak is not None and peak <= self.budget_bytes

    @property
    def model(self) -> PeakModel | None:
        """The model fitted to the measurements so far (a whole-batch step at ``largest`` excluded, see ``whole_largest``)."""
        points = [m for m in self.measurements if not (self.whole_largest and m.size == self.largest)]
        return fit_peak_model(points, self.base_bytes, self.held_bytes_per_sample)

    def next_size(self) -> int | None:
        """The size to measure next, or ``None`` when the search is over."""
        if len(self.measurements) >= self.max_trials:
            return None
        if not self.measurements:
            return min(self.largest, max(self.smallest, self.first_size or 2))
        best, worst = self._bounds()
        tried = {m.size for m in self.measurements}
        whole_untried = self.whole_largest and self.largest not in tried
        if best is None:  # nothing fitted yet: the smallest size allowed, then the whole batch
            if worst > self.smallest:
                return self.smallest
            return self.largest if whole_untried else None
        if best >= self.largest or (worst <= best + 1 and not whole_untried):
            return None
        candidate = self._candidate(best, worst, whole_untried)
        if candidate == self.largest and whole_untried:
            return candidate
        if candidate is None or not best < candidate < worst:
            return None
        if candidate < best * (1 + _MIN_GAIN):
            return None
        return candidate

    @property
    def result(self) -> SearchResult:
        """The largest size measured within the budget (rounded to ``multiple_of``), with the model's prediction there."""
        best, worst = self._bounds()
        model = self.model
        size = measured = None
        predicted = None
        if best is not None:
            size = self._round(best)
            measured = max(
                self.measured_peak(m) for m in self.measurements if m.size == best and self.fits(m)
            )
            between = self._between(best, worst, measured)
            if between is not None:
                size, predicted = self._round(between[0]), between[1]
        if predicted is None:
            predicted = model.peak(size) if model is not None and size is not None else None
        if (
            self.whole_largest and size == self.largest
        ):  # the model is of micro-batch steps: this one was measured
            predicted = measured
        return SearchResult(
            size=size,
            verified_size=best,
            predicted_peak_bytes=predicted,
            measured_peak_bytes=measured,
            model=model,
            measurements=tuple(self.measurements),
        )

    # ------------------------------------------------------------------ policy

    def _between(self, best: int, worst: int, best_peak: int) -> tuple[int, int] | None:
        """Between the largest size that fitted and the smallest measured over the budget (a real step ran at
        each, so the peak between them is interpolated, not extrapolated): the largest size whose peak on the
        line through the two stays within the budget, with that peak. ``None`` when no step ran at ``worst``
        (an OOM, or not measured) or no size lies between."""
        if worst - best < 2:
            return None
        peaks = [self.measured_peak(m) for m in self.measurements if m.size == worst and not m.out_of_memory]
        if not peaks or (self.whole_largest and worst == self.largest):
            return None
        slope = (min(peaks) - best_peak) / (worst - best)
        if slope <= 0:
            return None
        n = min(worst - 1, best + math.floor((self.budget_bytes - best_peak) / slope))
        return (n, math.ceil(best_peak + slope * (n - best))) if n > best else None

    def _bounds(self) -> tuple[int | None, int]:
        """(largest size that fitted or None, smallest size that did not or ``largest + 1``)."""
        if self.whole_largest and any(m.size == self.largest and self.fits(m) for m in self.measurements):
            return self.largest, self.largest + 1
        measured = [m for m in self.measurements if not (self.whole_largest and m.size == self.largest)]
        fitted = [m.size for m in measured if self.fits(m)]
        failed = [m.size for m in measured if not self.fits(m)]
        if self.whole_largest and self.largest in {m.size for m in self.measurements}:
            failed.append(self.largest)
        worst = min(failed, default=self.largest + 1)
        best = max((s for s in fitted if s < worst), default=None)
        return best, worst

    def _round(self, n: int) -> int:
        if n >= self.largest:
            return self.largest
        if n >= self.multiple_of:
            n -= n % self.multiple_of
        return max(self.smallest, n)

    def _candidate(self, best: int, worst: int, whole_untried: bool) -> int | None:
        """The next size to measure: a step toward the model's answer, or the answer itself (rounded) to verify it."""
        model = self.model
        completed = {m.size for m in self.measurements if not m.out_of_memory and m.size != self.largest}
        target = (
            model.largest_size(self.budget_bytes, self.smallest, self.largest) if model is not None else None
        )
        if (
            whole_untried
            and model is not None
            and model.peak(self.largest) - self.grad_bytes <= self.budget_bytes
        ):
            target = (
                self.largest
            )  # whole, without the micro-batches' gradients, the batch may fit: the best answer
        elif target is not None and target >= self.largest and self.whole_largest:
            target = self.largest - 1  # the micro-batch curve, below the whole batch
        if target is None or target >= worst:  # the model is wrong above `best`: halve the gap
            return (best + worst) // 2 if worst <= self.largest else min(worst - 1, 2 * best)
        if len(completed) == 1:  # one point: no slope yet; a far second point gives a well-conditioned one
            far = min(self.largest - self.whole_largest, _SECOND_STEP_GROWTH * best)
            if far < worst:
                return far
            # That far did not fit. With two steps left, the geometric middle (scale-free: it likely fits
            # and gives the slope, so the last step can verify the fitted model's answer); with one left,
            # halfway. Either way the one-point model's (pessimistic) answer if that is larger.
            if self.max_trials - len(self.measurements) >= 2:
                middle = max(best + 1, round(math.sqrt(best * worst)))
            else:
                middle = (best + worst) // 2
            return max(target, middle)
        if (
            len(completed) == 2
            and target > _CAUTIOUS_RATIO * best
            and self.max_trials - len(self.measurements) >= 2
        ):
            return min(max(best + 1, round(math.sqrt(best * target))), self.largest - self.whole_largest)
        if target == self.largest:
            return target
        largest_measured = max(completed)
        if target > largest_measured:
            margin = _EXTRAPOLATION_MARGIN * (model.peak(target) - model.peak(largest_measured))
            target = model.largest_size(self.budget_bytes - margin, largest_measured, self.largest) or target
        final = self._round(target)
        return final if final > self._round(best) else None


class TrialBatch(NamedTuple):
    """The batch a trial step runs for a size the search asked for.

    Attributes:
        batch: the (micro-)batch, on the device.
        samples: the samples in it (a split hook may choose another size than asked: what runs is recorded).
        nbytes: device bytes allocated for this batch alone (0 when it is the fetched batch or a view of it).
        whole: the step runs the batch whole, starting without gradients (else as a micro-batch, with them).
    """

    batch: Any
    samples: int
    nbytes: int
    whole: bool


class Trials(Protocol):
    """Where a search's trial steps run: :class:`~lightning_gpuopt.batch_size.trial.TrialSteps`."""

    #: Bytes held after the last step that completed, its outputs freed (``None``: none completed yet).
    held_bytes: int | None

    def agree_size(self, size: int | None) -> int | None:
        """The size every rank's next step runs at, from what this rank's search asks for; ``None``: no step."""

    def measure(
        self, batch: Any, size: int, batch_bytes: int = 0, whole: bool = False
    ) -> StepMeasurement | None:
        """One trial step; ``None`` when another rank's failure stopped it before it ended here."""


def run_trials(
    search: SizeSearch,
    trials: Trials,
    make_batch: Callable[[int], TrialBatch],
    extra: int,
) -> SearchResult:
    """Measure the sizes ``search`` asks for with ``trials`` until it is over (under FSDP2: until every rank's is).

    ``extra``: bytes held through a real step that a trial does not hold (added to the measured base).
    Under FSDP2 every rank runs each trial step at the same size, the smallest any rank's search asks for
    (:meth:`Trials.agree_size`; the ranks use the smallest answer, so the rank with the least memory
    leads), and records it, so that no rank runs more trial steps than one search may. A step that another
    rank's OOM stopped here is recorded as out of memory: the answer the ranks agree on lies below it anyway.
    """
    while (size := trials.agree_size(search.next_size())) is not None:
        # A split hook may choose another size: record what ran.
        batch, actual, nbytes, whole = make_batch(size)
        measurement = trials.measure(batch, actual, nbytes, whole)
        del batch
        if measurement is None:
            measurement = StepMeasurement(actual, None)
        elif trials.held_bytes is not None:
            search.base_bytes = trials.held_bytes + extra
        search.record(measurement)
    return search.result
