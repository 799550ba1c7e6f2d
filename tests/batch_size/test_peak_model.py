"""The pure math behind MemoryAwareBatchSize: the peak model and its fit."""

from __future__ import annotations

import pytest

from lightning_gpuopt.batch_size.peak_model import PeakModel, StepMeasurement, fit_peak_model, memory_budget


def test_curvature_is_detected_from_three_points():
    steps = [StepMeasurement(n, 1000 + 100 * n + 10 * n * n, 0) for n in (10, 40, 90)]
    model = fit_peak_model(steps, base_bytes=0)
    assert model.quadratic_bytes == pytest.approx(10)
    assert model.per_sample_bytes == pytest.approx(100)
    assert model.intercept_bytes == pytest.approx(1000)


def test_straight_points_give_the_local_line():
    steps = [StepMeasurement(n, 5000 + 300 * n, 0) for n in (2, 30, 70)] + [StepMeasurement(200, None)]
    model = fit_peak_model(steps, base_bytes=100)
    assert (model.quadratic_bytes, model.per_sample_bytes, model.intercept_bytes) == (0.0, 300.0, 5000.0)
    assert fit_peak_model([StepMeasurement(4, None)], base_bytes=0) is None


def test_one_point_counts_every_byte_per_sample():
    model = fit_peak_model([StepMeasurement(4, 400, 50)], base_bytes=1000)
    assert (model.intercept_bytes, model.per_sample_bytes, model.optimizer_bytes) == (0.0, 100.0, 50)


def test_peak_is_the_larger_phase_plus_what_every_step_holds():
    model = PeakModel(
        base_bytes=1000, intercept_bytes=10, per_sample_bytes=5, optimizer_bytes=200, held_bytes_per_sample=2
    )
    assert model.peak(10) == 1000 + 20 + 200  # the optimizer step dominates
    assert model.peak(100) == 1000 + 200 + 510
    assert model.largest_size(1710, 1, 10_000) == 100
    assert model.largest_size(1000, 1, 10) is None


def test_budget():
    assert memory_budget(1000, 1.0) == 1000
    assert memory_budget(1000, 0.5, reserve_bytes=100) == 400
