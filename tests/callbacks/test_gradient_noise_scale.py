"""GradientNoiseScale: the estimate on a problem whose noise scale is known, and the update it leaves alone."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt import GradientNoiseScale, OOMRecovery
from lightning_gpuopt.goodput import NoiseScaleEMA, noise_scale_terms
from lightning_gpuopt.microbatch import MicroBatchEngine
from tests.callbacks.goodput_models import Quadratic, quadratic_loader
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
    class Dropped(Quadratic):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return 0.5 * self.drop(self.theta - x).square().sum(dim=1).mean()

    noise = GradientNoiseScale()
    _fit(Dropped(), quadratic_loader(16, steps=5), [noise], steps=5)
    assert noise.history == []
    assert "not split into 2 micro-batches because it has dropout (drop, p=0.1)" in caplog.text


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
