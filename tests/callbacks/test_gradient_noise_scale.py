"""GradientNoiseScale: the estimate on a problem whose noise scale is known, and the update it leaves alone."""

from __future__ import annotations

import copy
import csv
import math
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_gpuopt import GradientNoiseScale, OOMRecovery
from lightning_gpuopt.goodput import NoiseScaleEMA, noise_scale_terms
from lightning_gpuopt.microbatch import MicroBatchEngine
from tests.callbacks.goodput_models import (
    DroppedQuadratic,
    Quadratic,
    TokenQuadratic,
    quadratic_loader,
    synthetic_measurements,
    token_quadratic_loader,
)
from tests.helpers import TRAINER_QUIET, run_ranks


def _fit(model, loader, callbacks, steps=300, **kwargs):
    trainer = pl.Trainer(
        max_steps=steps, precision="64-true", callbacks=callbacks, **{**TRAINER_QUIET, **kwargs}
    )
    trainer.fit(model, loader)
    return trainer


@pytest.mark.parametrize("b_simple", [16, 128], ids=("quarter", "twice"))
def test_estimate_within_25_percent_at_k1(b_simple):
    noise = GradientNoiseScale()
    _fit(Quadratic(), quadratic_loader(b_simple), [noise])
    assert noise.estimate is not None
    assert abs(noise.estimate / b_simple - 1) <= 0.25, noise.estimate


@pytest.mark.parametrize("b_simple", [16, 128], ids=("quarter", "twice"))
def test_estimate_within_25_percent_at_k2_from_oom_recovery(b_simple):
    class K2(pl.Callback):  # the split an OOM would have asked for
        def on_fit_start(self, trainer, pl_module):
            MicroBatchEngine.get(trainer).propose(2, "oom", "test: as after an OOM")

    noise = GradientNoiseScale(split=False)
    trainer = _fit(Quadratic(), quadratic_loader(b_simple), [OOMRecovery(), noise, K2()])
    assert noise.estimate is not None
    assert abs(noise.estimate / b_simple - 1) <= 0.25, noise.estimate
    assert trainer.global_step == 300


def test_update_unchanged_by_the_measurement():
    """With the measurement's splits on, the parameters equal a run without it (64-true, to rounding)."""
    loader = quadratic_loader(64, steps=40)
    plain, measured = Quadratic(lr=0.05, optimizer="adam"), Quadratic(lr=0.05, optimizer="adam")
    _fit(plain, loader, [], steps=40)
    noise = GradientNoiseScale(every=1)
    _fit(measured, loader, [noise], steps=40)
    assert len(noise.history) >= 38  # it did split and measure (every step but the first)
    torch.testing.assert_close(measured.theta, plain.theta, rtol=1e-12, atol=1e-14)


def test_no_split_for_a_step_with_dropout(caplog):
    noise = GradientNoiseScale()
    _fit(DroppedQuadratic(), quadratic_loader(16, steps=5), [noise], steps=5)
    assert noise.history == []
    assert "not split into 2 micro-batches because it has dropout (drop, p=0.1)" in caplog.text
    # The fit ends saying that nothing was measured, why, and what to do.
    assert (
        "GradientNoiseScale: nothing measured in 5 optimizer steps: a step at k = 1 is not split into 2 "
        "micro-batches because it has dropout (drop, p=0.1). To measure, set accumulate_grad_batches >= 2 (halve batch_size"
    ) in caplog.text


def test_no_split_for_a_step_that_draws():
    class Noisy(Quadratic):
        def training_step(self, batch, batch_idx):
            (x,) = batch
            return 0.5 * (self.theta - x + 0.01 * torch.randn_like(x)).square().sum(dim=1).mean()

    noise = GradientNoiseScale()
    _fit(Noisy(), quadratic_loader(16, steps=5), [noise], steps=5)
    assert noise.history == []


def test_checkpoint_round_trip():
    noise = GradientNoiseScale()
    _fit(Quadratic(), quadratic_loader(16, steps=60), [noise], steps=60)
    again = copy.deepcopy(GradientNoiseScale())
    again.load_state_dict(noise.state_dict())
    assert again.estimate == noise.estimate and again.history == noise.history and again.ema.count > 0


def test_pure_estimator_and_bad_arguments():
    assert noise_scale_terms(5.0, 32, 3.0, 64) == (1.0, 128.0)
    ema = NoiseScaleEMA()
    assert ema.estimate is None and ema.relative_error == float("inf")
    with pytest.raises(ValueError, match="`every` must be a positive int"):
        GradientNoiseScale(every=0)
    with pytest.raises(ValueError, match="`beta` must be in"):
        GradientNoiseScale(beta=1.0)


SCRIPT = Path(__file__).with_name("ddp_goodput_run.py")


def test_estimate_on_two_ddp_ranks(tmp_path):
    results = run_ranks(SCRIPT, tmp_path, "noise", result="rank{rank}.json")
    for result in results:
        for b_simple, estimate in result["estimates"]:
            assert estimate is not None and abs(estimate / b_simple - 1) <= 0.25, (b_simple, estimate)
    assert results[0]["estimates"] == results[1]["estimates"]  # the ranks agree


def test_estimate_from_accumulation_windows_without_a_split():
    """accumulate_grad_batches=2: the window's first batch against the window, no split asked for."""
    noise = GradientNoiseScale(split=False)
    _fit(Quadratic(), quadratic_loader(16, batch_size=32, steps=600), [noise], accumulate_grad_batches=2)
    assert noise.estimate is not None and abs(noise.estimate / 16 - 1) <= 0.25, noise.estimate


# ---------------------------------------------------------------------- the trust threshold, early in a run


def _reference_error(measured: list[tuple[float, float]], beta: float) -> float:
    """The ratio's relative standard error, written out: normalised weights beta^(n-1-i), unbiased weighted
    (co)variances, the variance of a weighted mean (sum of squared weights), the delta method."""
    n = len(measured)
    weights = [beta ** (n - 1 - i) for i in range(n)]
    total = sum(weights)
    weights = [w / total for w in weights]
    squares = sum(w * w for w in weights)
    mg = sum(w * g for w, (g, _) in zip(weights, measured))
    mt = sum(w * t for w, (_, t) in zip(weights, measured))
    if n < 2 or mg <= 0 or mt <= 0:
        return math.inf
    scale = squares / (1 - squares)
    var_g = sum(w * (g - mg) ** 2 for w, (g, _) in zip(weights, measured)) * scale
    var_t = sum(w * (t - mt) ** 2 for w, (_, t) in zip(weights, measured)) * scale
    cov = sum(w * (g - mg) * (t - mt) for w, (g, t) in zip(weights, measured)) * scale
    return math.sqrt(max(var_t / mt**2 + var_g / mg**2 - 2 * cov / (mg * mt), 0.0))


@pytest.mark.parametrize(
    ("b_simple", "trust", "min_measurements", "seed"),
    [
        (64, 0.3, 1, 0),  # trusted from the 4th measurement: the error gates, not the count
        (64, 0.3, 20, 0),  # the error is below trust long before: the count gates
        (64, 0.1, 1, 0),
        (64, 0.1, 1, 2),
        (64, 0.1, 20, 1),
        (640, 0.3, 1, 0),  # a batch 10x below the noise scale: trusted later
        (640, 0.3, 20, 0),
        (640, 0.3, 20, 1),  # two measurements happen to agree: only min_measurements holds it back
        (64, 0.05, 1, 0),  # never below trust in 150 measurements
        (640, 0.1, 5, 2),
    ],
)
def test_trust_threshold_withholds_the_estimate_until_the_error_is_below_it(
    b_simple, trust, min_measurements, seed
):
    """Fed one-step estimates with a known noise scale: after every measurement, from the first, the estimate is
    None exactly while the relative error (written out independently) is above `trust` or fewer than
    `min_measurements` were taken, and once given it is the ratio of the averages, near the true noise scale."""
    beta = 0.99
    ema = NoiseScaleEMA(beta=beta, min_count=min_measurements, trust=trust)
    measured: list[tuple[float, float]] = []
    given = []
    for g2, trace in synthetic_measurements(b_simple, 150, seed=seed):
        ema.update(g2, trace)
        measured.append((g2, trace))
        count, error = len(measured), _reference_error(measured, beta)
        if math.isfinite(error):
            assert ema.relative_error == pytest.approx(error, rel=1e-9, abs=1e-15), count
        else:
            assert ema.relative_error == math.inf, count
        withheld = count < min_measurements or error > trust
        assert (ema.estimate is None) == withheld, (count, error, ema.estimate)
        if not withheld:
            assert ema.estimate == pytest.approx(ema.trace / ema.g2, rel=1e-12)
            given.append((count, ema.estimate))
    assert measured and _reference_error(measured[:1], beta) == math.inf  # the first is never trusted
    final = _reference_error(measured, beta)
    if final > trust:
        assert not given or given[-1][0] < len(measured)
        return
    assert given, "the error fell below trust, yet no estimate was given"
    first = given[0]
    assert first[0] >= max(min_measurements, 2)
    if min_measurements >= 20:  # enough measurements for the error itself to be known
        assert abs(first[1] / b_simple - 1) <= 3 * trust, first


@pytest.mark.parametrize("trust", [1.0, 1e9])
def test_first_measurement_is_never_trusted_and_the_second_can_be(trust):
    ema = NoiseScaleEMA(min_count=1, trust=trust)
    measurements = synthetic_measurements(64, 2, seed=3)
    ema.update(*measurements[0])
    assert ema.estimate is None and ema.relative_error == math.inf and ema.lower_bound() is None
    ema.update(*measurements[1])
    assert (ema.estimate is not None) == (ema.relative_error <= trust)
    assert ema.lower_bound() is None or ema.lower_bound() <= ema.value


@pytest.mark.parametrize("b_simple", [64, 6400], ids=("at_the_batch", "100x_the_batch"))
def test_lower_bound_is_there_and_below_the_truth(b_simple):
    """Over 100 runs of 50 measurements: the lower bound exists in 90 or more, even where the |G|^2 average is
    still negative (no ratio yet: 42 of the 100 at 100x), and it stays below the true noise scale in at least 95
    of 100 (2 standard errors)."""
    bounds, ratios = [], 0
    for seed in range(100):
        ema = NoiseScaleEMA()
        for g2, trace in synthetic_measurements(b_simple, 50, seed=seed):
            ema.update(g2, trace)
        bounds.append(ema.lower_bound())
        ratios += ema.value is not None
    given = [b for b in bounds if b is not None]
    assert len(given) >= 90, len(given)
    assert sum(b > b_simple for b in given) <= 5
    assert len(given) >= ratios + (30 if b_simple > 64 else 0)  # where the ratio is missing, the bound speaks


class _Logged(Quadratic):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


_END = re.compile(
    r"GradientNoiseScale: (?:noise scale (?P<estimate>[\d,]+) samples after (?P<count>\d+) measurements \("
    r"relative error (?P<error>[\d.e+-]+) <= trust (?P<trust>[\d.e+-]+)\)"
    r"|not trusted yet after (?P<count2>\d+) measurements \(relative error (?P<error2>inf|[\d.e+-]+) > trust "
    r"(?P<trust2>[\d.e+-]+)[^)]*\); (?:lower bound (?P<bound>[\d,]+) samples|no lower bound yet))"
)


@pytest.mark.parametrize(
    ("b_simple", "trust", "min_measurements", "trusted"),
    [(64, 0.3, 1, True), (64, 0.15, 10, True), (64, 0.001, 5, False), (6400, 0.1, 5, False)],
    ids=("trusted_early", "trusted_later", "never_trusted", "far_below_the_noise_scale"),
)
def test_logs_in_lightnings_rows_and_ends_with_the_estimators_state(
    tmp_path, caplog, b_simple, trust, min_measurements, trusted
):
    """A CSVLogger run: the gpuopt/ values sit at Lightning's own step numbers (with the module's train_loss), hold
    the state after each measurement (estimate withheld until trusted), and the fit's last line gives the
    estimator's figures."""
    noise = GradientNoiseScale(trust=trust, min_measurements=min_measurements)
    settings = {**TRAINER_QUIET, "logger": CSVLogger(tmp_path, name="run", version=0)}
    trainer = pl.Trainer(
        max_steps=60, precision="64-true", callbacks=[noise], log_every_n_steps=1, **settings
    )
    trainer.fit(_Logged(), quadratic_loader(b_simple, steps=60))

    rows: dict[int, dict[str, str]] = {}
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        for r in csv.DictReader(f):  # the pack's values and the module's, at the same step numbers
            rows.setdefault(int(r["step"]), {}).update({k: v for k, v in r.items() if v != ""})
    assert sorted(rows) == list(range(60))  # Lightning's numbering: no step of the pack's own
    assert noise.history, "nothing measured"
    assert (noise.estimate is not None) == trusted
    for index, (step, estimate, error) in enumerate(noise.history):
        row = rows[step]
        assert "train_loss" in row  # the module's own value at the same step
        logged = float(row["gpuopt/noise_scale"])
        if estimate is None:
            assert math.isnan(logged)
            assert index + 1 < min_measurements or error > trust  # withheld only while not trusted
        else:
            assert logged == pytest.approx(estimate, rel=1e-6)
            assert index + 1 >= min_measurements and error <= trust
        logged_error = float(row["gpuopt/noise_scale_rel_error"])
        assert logged_error == pytest.approx(error, rel=1e-6) or (error == 1e9 and math.isinf(logged_error))
    last = rows[noise.history[-1][0]]
    bound = noise.lower_bound()
    if bound is None:
        assert math.isnan(float(last["gpuopt/noise_scale_lower_bound"]))
    else:
        assert float(last["gpuopt/noise_scale_lower_bound"]) == pytest.approx(bound, rel=1e-6)

    ends = [m for m in map(_END.search, caplog.messages) if m]
    assert len(ends) == 1, caplog.messages  # one line at the end of the fit
    end = ends[0]
    if trusted:
        assert float(end["estimate"].replace(",", "")) == round(noise.estimate)
        assert int(end["count"]) == noise.ema.count
        assert float(end["error"]) == pytest.approx(noise.relative_error, rel=5e-3)
        assert float(end["trust"]) == trust
    else:
        assert int(end["count2"]) == noise.ema.count
        assert float(end["error2"]) == pytest.approx(noise.relative_error, rel=5e-3)
        assert float(end["trust2"]) == trust
        assert (end["bound"] and float(end["bound"].replace(",", ""))) == (bound and round(bound))


@pytest.mark.parametrize("beta", [0.5, 0.9, 0.99])
def test_the_reported_averages_are_bias_corrected_weighted_means_of_the_measurements(beta):
    """``gradient_sq`` and ``trace_sigma`` are the measurements' means weighted (1 - beta) beta^(t - i), over the
    weights' sum: a constant stays that constant from the first measurement on; ``None`` before any."""
    ema = NoiseScaleEMA(beta=beta)
    assert ema.gradient_sq is None and ema.trace_sigma is None
    measured = [(2.0, 300.0), (1.5, 250.0), (3.0, 500.0), (2.5, 100.0)]
    for t, (g2, trace) in enumerate(measured, start=1):
        ema.update(g2, trace)
        weights = [beta ** (t - i) for i in range(1, t + 1)]
        mean_g2 = sum(w * g for w, (g, _) in zip(weights, measured)) / sum(weights)
        mean_trace = sum(w * tr for w, (_, tr) in zip(weights, measured)) / sum(weights)
        assert ema.gradient_sq == pytest.approx(mean_g2, rel=1e-12)
        assert ema.trace_sigma == pytest.approx(mean_trace, rel=1e-12)
    constant = NoiseScaleEMA(beta=beta)
    constant.update(4.0, 40.0)
    assert constant.gradient_sq == pytest.approx(4.0, rel=1e-12) and constant.trace_sigma == pytest.approx(
        40.0, rel=1e-12
    )


def test_the_terms_from_one_sample_and_two():
    """The smallest split: a micro-batch of one sample against the batch of two."""
    g2, trace = noise_scale_terms(small_sq=5.0, b_small=1, big_sq=3.0, b_big=2)
    assert (g2, trace) == (1.0, 4.0)
    for b_small, b_big in ((0, 2), (2, 2), (3, 2)):
        with pytest.raises(ValueError, match="`b_small` must be in"):
            noise_scale_terms(5.0, b_small, 3.0, b_big)


def test_no_ratio_while_the_gradient_term_is_not_positive():
    ema = NoiseScaleEMA(beta=0.9)
    ema.update(0.0, 5.0)
    assert ema.value is None and ema.estimate is None


def test_the_lower_bound_from_the_second_measurement_and_never_below_zero():
    ema = NoiseScaleEMA(beta=0.9)
    ema.update(1.0, 100.0)
    assert ema.lower_bound() is None  # one measurement has no spread
    ema.update(1.0, 100.0)
    assert ema.lower_bound() == pytest.approx(100.0, rel=1e-9)  # no spread: the ratio itself
    wide = NoiseScaleEMA(beta=0.9)
    for trace in (1.0, 400.0, 1.0, 400.0):  # tr(Sigma)'s spread reaches below zero at two sigmas
        wide.update(1.0, trace)
    assert wide.lower_bound() is None


@pytest.mark.parametrize(("g2", "trace"), [(0.0, 100.0), (1.0, 0.0)])
def test_a_term_averaging_exactly_zero_gives_no_ratio_error_or_bound(g2, trace):
    """A gradient term of exactly 0 (a batch at the noise floor) or a noise term of exactly 0 (identical samples)
    says nothing about the ratio: no value, an unknown error and no bound, never a division by zero."""
    ema = NoiseScaleEMA(beta=0.9)
    for _ in range(3):
        ema.update(g2, trace)
    assert ema.value is None and ema.relative_error == math.inf and ema.lower_bound() is None
    assert ema.needed is None and ema.estimate is None


def test_no_spread_needs_one_measurement():
    ema = NoiseScaleEMA(beta=0.9, trust=0.1)
    for _ in range(3):
        ema.update(1.0, 100.0)
    assert ema.relative_error == 0.0 and ema.needed == 1.0


def test_on_a_token_mean_loss_shared_by_tokens_the_noise_scale_is_in_tokens(caplog):
    """Accumulation 2 over batches of different token counts, a token-mean loss: the step is shared by tokens, and
    the noise scale is measured and said in tokens (64 tokens here; counted in samples it would be about 8 times
    smaller), the optimizer batch being the step's real tokens."""
    noise = GradientNoiseScale(split=False)
    oom = OOMRecovery(loss_reduction="tokens", verbose=False)
    loader = token_quadratic_loader(64)
    trainer = _fit(TokenQuadratic(), loader, [oom, noise], steps=300, accumulate_grad_batches=2)
    assert noise.unit == "tokens"
    assert noise.estimate is not None and abs(noise.estimate / 64 - 1) <= 0.25, noise.estimate
    tokens = [int((b["labels"] != -100).sum()) for b in loader]
    steps = {tokens[2 * s] + tokens[2 * s + 1] for s in range(trainer.global_step)}
    assert noise.state_dict()["batch"] in steps  # a measured step's real tokens (its two batches')
    assert " tokens after " in noise.summary() and "tokens" in noise.summary().split("optimizer batch is")[1]
