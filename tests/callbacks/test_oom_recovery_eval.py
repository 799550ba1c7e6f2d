"""OOMRecovery in evaluation: an OOM in a validation, test or predict step splits that batch.

Evaluation batches (``eval_batch_size``) are larger than training batches here, as they often are,
so the limit hits evaluation only. Outputs, logged values and metric states must equal the run
without a limit; predictions come back whole and in order.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import Waves
from tests.helpers import TRAINER_QUIET

EVAL_BATCH = 256


class EvalNet(pl.LightningModule):
    """A wide regressor whose evaluation steps log a loss and a torchmetrics metric, and predict per sample."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 1))
        self.mse = torchmetrics.MeanSquaredError()
        self.eval_peaks: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return F.mse_loss(self.net(x), y)

    def _evaluate(self, batch, prefix):
        probe = get_probe()
        start = probe.allocated
        probe.reset_peak()
        ids, x, y = batch
        pred = self.net(x)
        self.mse.update(pred, y)
        self.log(f"{prefix}_loss", F.mse_loss(pred, y))
        self.log(f"{prefix}_mse", self.mse)
        self.eval_peaks.append((start, probe.peak))
        return {"ids": ids, "pred": pred}

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch, "test")

    def predict_step(self, batch, batch_idx):
        ids, x, _ = batch
        return {"ids": ids, "pred": self.net(x), "first_id": int(ids[0])}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(batch_size: int, length: int = 4 * EVAL_BATCH) -> DataLoader:
    return DataLoader(Waves(length=length), batch_size=batch_size, shuffle=False)


def _trainer(callbacks=(), **kwargs) -> pl.Trainer:
    return pl.Trainer(precision="64-true", callbacks=list(callbacks), **{**TRAINER_QUIET, **kwargs})


@functools.cache
def _eval_step_memory() -> tuple[int, int]:
    """(allocated at an evaluation step's start, the step's peak), measured without a limit."""
    model = EvalNet()
    with SimulatedMemory():
        _trainer().validate(model, _loader(EVAL_BATCH), verbose=False)
    return model.eval_peaks[-1]


def _limit() -> int:
    """The step's start plus 60 % of what its forward adds: the whole batch cannot fit, a half can."""
    start, peak = _eval_step_memory()
    return start + int(0.6 * (peak - start))


def _run(stage: str, limit: int | None, callbacks=()):
    model = EvalNet()
    trainer = _trainer(callbacks)
    with SimulatedMemory(limit) as mem:
        if stage == "validate":
            result = trainer.validate(model, _loader(EVAL_BATCH), verbose=False)
        elif stage == "test":
            result = trainer.test(model, _loader(EVAL_BATCH), verbose=False)
        else:
            result = trainer.predict(model, _loader(EVAL_BATCH))
    return result, mem


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluation_oom_splits_the_batch_and_logs_what_the_whole_batch_would(stage):
    reference, _ = _run(stage, None)
    cb = OOMRecovery()
    result, mem = _run(stage, _limit(), [cb])
    name = "validation" if stage == "validate" else "test"
    assert cb.failures and {f.phase for f in cb.failures} == {name}
    assert cb.eval_k[name] > 1 and mem.peak_bytes <= _limit()
    assert result[0].keys() == reference[0].keys() and len(result[0]) == 2
    for key, value in reference[0].items():
        assert result[0][key] == pytest.approx(value, rel=1e-12), key
    with pytest.raises(torch.OutOfMemoryError):  # without the callback the same limit is fatal
        _run(stage, _limit())


def test_predictions_come_back_whole_and_in_order():
    reference, _ = _run("predict", None)
    cb = OOMRecovery()
    result, _ = _run("predict", _limit(), [cb])
    assert cb.failures and cb.eval_k["predict"] > 1
    assert len(result) == len(reference) == 4
    for got, want in zip(result, reference):
        assert torch.equal(got["ids"], want["ids"])  # every sample, once, in order
        torch.testing.assert_close(got["pred"], want["pred"], rtol=1e-12, atol=0)
        assert got["first_id"] != want["first_id"]  # a plain value is the last chunk's, as documented


def test_validation_inside_fit_recovers_and_training_is_untouched():
    def fit(callbacks, limit):
        model = EvalNet()
        trainer = _trainer(callbacks, max_steps=6, val_check_interval=3, limit_val_batches=2)
        with SimulatedMemory(limit):
            trainer.fit(model, _loader(32), _loader(EVAL_BATCH))
        return model, trainer

    ref_model, ref_trainer = fit([], None)
    cb = OOMRecovery()
    model, trainer = fit([cb], _limit())
    assert cb.failures and cb.k == 1 and cb.eval_k["validation"] > 1  # training never split
    assert trainer.callback_metrics["val_loss"] == pytest.approx(
        float(ref_trainer.callback_metrics["val_loss"]), rel=1e-12
    )
    for got, want in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    (holder,) = [
        c for c in trainer.callbacks if c.state_key == "MicroBatchEngine"
    ]  # the engine saves it, once
    assert holder.state_dict()["eval_k"] == [["validation", cb.eval_k["validation"]]]


def test_evaluation_at_one_sample_still_out_of_memory_names_eval_batch_size():
    cb = OOMRecovery()
    with pytest.raises(
        MicroBatchOOMError, match=r"Out of memory at validation batch 0 .* smaller `eval_batch_size`"
    ):
        _run("validate", _eval_step_memory()[0] + 8 * 1024, [cb])  # not even one sample's 16 KiB activation
