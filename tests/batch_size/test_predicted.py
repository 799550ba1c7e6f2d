"""The size search started from a prediction (pure): the hand-over to the measured search, and the calibration."""

from __future__ import annotations

from lightning_gpuopt.batch_size.peak_model import StepMeasurement
from lightning_gpuopt.batch_size.predicted import PredictedSearch, TracedStep, TransientCurve
from lightning_gpuopt.batch_size.search import SizeSearch


def _run(search: SizeSearch, step) -> SizeSearch:
    while (n := search.next_size()) is not None:
        search.record(step(n))
    return search


def _quadratic(n: int) -> StepMeasurement:
    """A real step growing faster than linearly (what forward and backward add above the held memory)."""
    return StepMeasurement(n, 5_000 + 400 * n + 6 * n * n, 1_000)


ARGS = dict(budget_bytes=120_000, base_bytes=20_000, smallest=1, largest=512, first_size=8)


def _within(step, budget: int, base: int):
    """``step`` as a real device runs it: out of memory over the budget (target_fraction 1)."""

    def run(n: int) -> StepMeasurement:
        m = step(n)
        return m if base + m.forward_backward_bytes <= budget else StepMeasurement(n, None, None)

    return run


def test_a_wrong_prediction_hands_over_to_the_measured_search_and_never_ends_below_it():
    # The traces saw a tenth of the memory and no curvature: the calibrated steps run out of memory.
    curve = TransientCurve(tuple(TracedStep(n, 500 * n) for n in (2, 64, 128)))
    step = _within(_quadratic, ARGS["budget_bytes"], ARGS["base_bytes"])
    plain = _run(SizeSearch(**ARGS), step)
    guided = _run(PredictedSearch(**ARGS, curve=curve), step)
    assert not guided.used_prediction and guided.note.endswith(": measured instead"), guided.note
    # The measured search continued from the shared first step exactly as it runs alone.
    assert guided.fallback.measurements == plain.measurements
    assert guided.result.size >= plain.result.size
    truth = max(n for n in range(1, 513) if 20_000 + _quadratic(n).forward_backward_bytes <= 120_000)
    assert guided.result.size <= truth


def test_a_right_prediction_needs_three_steps_where_memory_grows_faster_than_linearly():
    curve = TransientCurve(tuple(TracedStep(n, _quadratic(n).forward_backward_bytes) for n in (2, 64, 128)))
    guided = _run(PredictedSearch(**ARGS, curve=curve), _quadratic)
    truth = max(n for n in range(1, 513) if 20_000 + _quadratic(n).forward_backward_bytes <= 120_000)
    assert guided.used_prediction and len(guided.measurements) <= 3
    assert 0.9 * truth <= guided.result.size <= truth


def _bent(n: int) -> StepMeasurement:
    """A real step whose growth bends between two traced sizes (a convolution's algorithm changing with the
    batch: 14 KB per sample below 55 samples, 22.5 KB above), as measured on ResNet-18."""
    below = min(n, 55)
    return StepMeasurement(n, 140_000 + 14_336 * (below - 2) + 22_528 * max(0, n - 55), 0)


def test_completed_steps_are_traced_so_a_bend_between_traces_does_not_mislead_the_calibration():
    """Traces exact at 2, 19 and 78 samples; the bend lies between 19 and 78. Calibrated against the chord,
    the first two steps (below the bend) scale the curve down and the third overshoots; with each completed
    step traced too, the third lands on the largest size that fits."""
    args = dict(ARGS, budget_bytes=1_300_000, base_bytes=0, first_size=16)
    truth = max(n for n in range(1, 513) if _bent(n).forward_backward_bytes <= args["budget_bytes"])
    traces = tuple(TracedStep(n, _bent(n).forward_backward_bytes) for n in (2, 19, 78))
    step = _within(_bent, args["budget_bytes"], 0)
    chord_only = _run(PredictedSearch(**args, curve=TransientCurve(traces)), step)
    assert not chord_only.used_prediction  # it ran past three steps
    traced = []

    def tracer(n: int) -> TracedStep:
        traced.append(n)
        return TracedStep(n, _bent(n).forward_backward_bytes)

    guided = _run(PredictedSearch(**args, curve=TransientCurve(traces), tracer=tracer), step)
    assert guided.used_prediction and len(guided.measurements) == 3, guided.note
    assert guided.result.size == truth
    assert traced == [m.size for m in guided.measurements[:2]]  # each step a calibrated one follows
