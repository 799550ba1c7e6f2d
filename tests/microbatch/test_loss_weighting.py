"""loss_reduction="auto": the weighting that reproduces the user's own loss, found by running it.

Every parity case compares three runs from the same θ_0 on the same batches: the full batch (the
reference), k = 2 with the exact weighting given by hand (the case's floor) and k = 2 with
``OOMRecovery()`` defaults. The measure is ``tests/helpers.py``'s: ‖Δθ − Δθ_ref‖/‖Δθ_ref‖ and the first
batch's gradient distance, each at most 2 × the floor.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import GPUOptWarning, LossWeightingError, OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.microbatch.loss_weighting_rules import Weighting
from tests.helpers import (
    TRAINER_QUIET,
    assert_same_training,
    gradient_distance,
    parameters_of,
    training_distance,
)
from tests.microbatch.loss_weighting_models import (
    KINDS,
    HFModule,
    PaddedText,
    TokenMeanLM,
    TokenText,
    exact_count,
    train,
)

EXPECTED = {
    "causal-lm": Weighting.TOKENS_SHIFTED,
    "masked-lm": Weighting.TOKENS,
    "token-classification": Weighting.TOKENS,
    "sequence-classification": Weighting.SAMPLES,
}


def _forced(**kwargs) -> OOMRecovery:
    """OOMRecovery split in two from the first batch (as after an OOM), with no memory limit."""
    callback = OOMRecovery(**kwargs)
    callback.load_state_dict({"k": 2})
    return callback


def _weighting_decisions(trainer: pl.Trainer) -> list:
    return [d for d in decisions(trainer) if d.kind == "loss weighting"]


def _assert_parity(
    make, dataset, exact: dict, steps: int = 3, **kwargs
) -> tuple[float, float, OOMRecovery, Any]:
    ref = train(make(), dataset, [], steps=steps, **kwargs)
    floor_run = train(make(), dataset, [_forced(**exact)], steps=steps, **kwargs)
    auto = _forced()
    run = train(make(), dataset, [auto], steps=steps, **kwargs)
    assert auto.k == 2
    floor = training_distance(ref.theta0, floor_run.theta, ref.theta)
    assert_same_training(ref.theta0, run.theta, ref.theta, floor=floor)
    grad_floor = gradient_distance(floor_run.grads, ref.grads)
    assert gradient_distance(run.grads, ref.grads) <= 2 * max(grad_floor, 1e-12)
    return floor, grad_floor, auto, run


# ----------------------------------------------------------------------------- Hugging Face heads


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("kind", KINDS)
def test_hf_head_splits_like_the_full_batch_with_defaults(kind, optimizer):
    pytest.importorskip("transformers")
    dataset = PaddedText(kind)
    _, _, auto, run = _assert_parity(
        lambda: HFModule(kind, optimizer), dataset, {"weight_fn": exact_count(kind)}
    )
    assert auto.loss_weighting.decided.kind is EXPECTED[kind]
    (decision,) = _weighting_decisions(run.trainer)
    assert decision.data["weighting"] == EXPECTED[kind].value
    assert decision.data["mismatch"] <= decision.data["tolerance"]


# ----------------------------------------------------------------------------- no regression without HF


class Regression(Dataset):
    def __init__(self, n: int = 32, dim: int = 6) -> None:
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class MeanRegressor(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd", reduction: str = "mean") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer, self.reduction = optimizer, reduction

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y, reduction=self.reduction)

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.01 if self.reduction == "sum" else 0.1)


class Images(Dataset):
    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(4)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the identity."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x):
        return F.relu(x + self.body(x))


class BatchNormResNet(pl.LightningModule):
    """A small ResNet (stem, two basic blocks, pooled linear head) with BatchNorm in training mode."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            Block(8),
            Block(8),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.05)


CASES = {
    "sample-mean": (lambda o: MeanRegressor(o), Regression, {"loss_reduction": "mean"}, Weighting.SAMPLES),
    "sum": (lambda o: MeanRegressor(o, "sum"), Regression, {"loss_reduction": "sum"}, Weighting.SUM),
    "token-mean": (lambda o: TokenMeanLM(o), TokenText, {"loss_reduction": "tokens"}, Weighting.TOKENS),
    # BatchNorm in training mode normalises each micro-batch by its own statistics: the floor (k = 2 with
    # sample shares) is the documented BatchNorm approximation, and the defaults must stay within it.
    "batchnorm-resnet": (BatchNormResNet, Images, {"loss_reduction": "mean"}, Weighting.SAMPLES),
}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("case", list(CASES))
def test_models_without_hf_split_with_the_defaults_within_their_floor(case, optimizer):
    make, data, exact, expected = CASES[case]
    _, _, auto, _ = _assert_parity(lambda: make(optimizer), data(), exact)
    assert auto.loss_weighting.decided.kind is expected


# ----------------------------------------------------------------------------- coupled losses


class InBatchNegatives(pl.LightningModule):
    """A contrastive loss: every sample's negatives are the other samples of its batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        logits = F.normalize(self.a(x), dim=1) @ F.normalize(self.b(x + 0.1), dim=1).T / 0.1
        return F.cross_entropy(logits, torch.arange(len(x)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model, dataset, callbacks, steps=2):
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, **TRAINER_QUIET)
    trainer.fit(model, DataLoader(dataset, batch_size=16, shuffle=False))
    return trainer


def test_in_batch_negatives_are_refused_before_any_split():
    model = InBatchNegatives()
    before = parameters_of(model)
    with pytest.raises(
        LossWeightingError, match=r"no weighting of micro-batch losses reproduces your loss"
    ) as err:
        _fit(model, Regression(), [_forced()])
    assert "unsplittable=True" in str(err.value) and "weight_fn" in str(err.value)
    after = parameters_of(model)
    assert all(torch.equal(before[n], after[n]) for n in before), "nothing may have trained"


def test_code_that_catches_out_of_memory_does_not_catch_a_refused_split():
    """A refusal about the loss is a configuration error: an `except torch.OutOfMemoryError` around the fit (a user's
    own retry) lets it through."""
    with pytest.raises(LossWeightingError, match="no weighting of micro-batch losses reproduces your loss"):
        try:
            _fit(InBatchNegatives(), Regression(), [_forced()])
        except torch.OutOfMemoryError:
            pytest.fail("the refusal was caught as an out-of-memory error")


class BatchSpread(MeanRegressor):
    """A loss with a batch statistic: the spread of the predictions across the batch (undefined on one sample)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.net(x)
        return F.mse_loss(prediction, y) + 0.1 * prediction.std()


def test_a_batch_statistic_one_sample_cannot_give_is_refused_not_left_unchecked():
    with pytest.raises(
        LossWeightingError, match=r"reproduces your loss .*\(relative differences: sample shares: inf"
    ):
        _fit(BatchSpread(), Regression(), [_forced()])


def test_in_batch_negatives_with_on_mismatch_warn_warn_once_and_split():
    with pytest.warns(GPUOptWarning, match=r"relative differences: sample shares: \d") as record:
        trainer = _fit(InBatchNegatives(), Regression(), [_forced(on_mismatch="warn")], steps=3)
    assert trainer.global_step == 3
    assert len([w for w in record if issubclass(w.category, GPUOptWarning)]) == 1


def test_a_wrong_weight_fn_is_flagged():
    with pytest.raises(
        LossWeightingError,
        match=r"the given weighting, weight_fn .*tokens \(labels != -100\) does reproduce it.*\(check the one given\)",
    ):
        _fit(TokenMeanLM(), TokenText(), [_forced(weight_fn=lambda batch: len(batch["labels"]))])


def test_a_right_explicit_setting_is_used_as_given_and_recorded():
    trainer = _fit(TokenMeanLM(), TokenText(), [_forced(loss_reduction="tokens")])
    (decision,) = _weighting_decisions(trainer)
    assert decision.message.startswith(
        "loss weighting: tokens (labels != -100) (given) — matches your loss to"
    )


# ----------------------------------------------------------------------------- no trace, checkpoint


class Traced(pl.LightningModule):
    """Records, at its first real micro-batch, what the check may have touched."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
        import torchmetrics

        self.seen = torchmetrics.SumMetric()
        self.check_calls = 0
        self.first: dict | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not self.training:
            self.check_calls += 1
        elif self.first is None:
            self.first = {
                "rng": torch.get_rng_state(),
                "running_mean": self.net[1].running_mean.clone(),
                "seen": self.seen.compute().clone() if self.seen.update_count else torch.tensor(0.0),
            }
        self.seen.update(torch.tensor(float(len(x))))
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AtBatchStart(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.rng = torch.get_rng_state()
            self.running_mean = pl_module.net[1].running_mean.clone()


def test_the_check_leaves_no_trace_and_its_decision_is_kept_in_the_checkpoint():
    model, start, oom = Traced(), AtBatchStart(), _forced()
    trainer = _fit(model, Regression(), [oom, start], steps=2)
    assert model.check_calls == 3  # the piece and its two parts, in eval mode (dropout off)
    assert torch.equal(model.first["rng"], start.rng)
    assert torch.equal(model.first["running_mean"], start.running_mean)
    assert float(model.first["seen"]) == 0.0
    assert float(model.seen.compute()) == 32.0  # the check's updates were undone: every sample once
    assert float(trainer.callback_metrics["train_loss"]) > 0
    state = {k: v for k, v in oom.state_dict().items() if k.startswith("loss_weighting_")}
    assert state == {
        "loss_weighting_checked": True,
        "loss_weighting_kind": "samples",
        "loss_weighting_description": "sample shares",
        "loss_weighting_key": None,
        "loss_weighting_ignore_index": -100,
    }
    resumed = OOMRecovery()
    resumed.load_state_dict(oom.state_dict())
    again = Traced()
    _fit(again, Regression(), [resumed], steps=1)
    assert again.check_calls == 0 and resumed.loss_weighting.decided.kind is Weighting.SAMPLES


class WeightDecayOnly(TokenMeanLM):
    """A loss that does not depend on the batch: every mean over the batch reproduces it (a tie)."""

    def training_step(self, batch, batch_idx):
        return sum((p**2).sum() for p in self.parameters()) + 0.0 * batch["input_ids"].sum()


class InfiniteLoss(TokenMeanLM):
    """A loss that is not finite on the checked samples (and on every batch)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("inf")


def test_a_tie_without_a_hugging_face_head_is_said_in_one_warning_naming_every_tied_weighting():
    oom = _forced()
    with pytest.warns(GPUOptWarning) as record:
        run = train(WeightDecayOnly(), TokenText(), [oom], steps=2)
    (warning,) = [str(w.message) for w in record if issubclass(w.category, GPUOptWarning)]
    assert warning.startswith(
        "loss weighting: sample shares, tokens (labels != -100), tokens (labels != -100, shifted by one) all "
        "reproduce your loss on the two checked samples (their losses are too close to tell them apart); "
        "keeping sample shares."
    )
    assert oom.loss_weighting.decided.kind is Weighting.SAMPLES
    (decision,) = _weighting_decisions(run.trainer)
    assert decision.data["checked"]


def test_a_loss_that_is_not_finite_on_the_checked_samples_splits_unchecked_and_says_why():
    oom = _forced()
    with pytest.warns(GPUOptWarning) as record:
        run = train(InfiniteLoss(), TokenText(), [oom], steps=1)
    (decision,) = _weighting_decisions(run.trainer)
    assert not decision.data["checked"]
    assert "not checked: your loss was not finite on the checked samples" in decision.message
    assert oom.loss_weighting.decided.kind is Weighting.SAMPLES  # the fallback for a batch with tokens
    assert [w for w in record if issubclass(w.category, GPUOptWarning)]  # the unchecked split is not silent


def test_weighting_alike_needs_every_candidate_to_count_the_chunks():
    from lightning_gpuopt.microbatch.loss_weighting import _weigh_alike
    from lightning_gpuopt.microbatch.loss_weighting_rules import candidates

    text = TokenText(n=4)
    chunks = [{"labels": text.labels[:2]}, {"labels": text.labels[2:]}]
    tokens = [c for c in candidates(chunks[0]) if c.kind is Weighting.TOKENS]
    samples = [c for c in candidates(chunks[0]) if c.kind is Weighting.SAMPLES]
    assert not _weigh_alike([*samples, *tokens], chunks)  # random lengths: tokens weigh them differently
    assert _weigh_alike([*samples, *tokens], [{"labels": text.tokens[:2]}, {"labels": text.tokens[2:]}])
    no_labels = [{"input_ids": text.tokens[:2]}, {"input_ids": text.tokens[2:]}]
    assert not _weigh_alike([*samples, *tokens], no_labels)  # tokens cannot count them: not alike


class UnpaddedText(PaddedText):
    """Causal-LM text with every sample at full length: samples and (shifted) tokens count alike."""

    def __init__(self) -> None:
        super().__init__("causal-lm")
        self.mask = torch.ones_like(self.mask)
        self.ids = torch.randint(1, 48, self.ids.shape, generator=torch.Generator().manual_seed(4))
        self.labels = self.ids.clone()


@pytest.mark.slow
def test_a_tie_under_a_hugging_face_head_is_decided_by_the_head_without_a_warning(recwarn):
    pytest.importorskip("transformers")
    oom = _forced()
    run = train(HFModule("causal-lm", "sgd"), UnpaddedText(), [oom], steps=1)
    (decision,) = _weighting_decisions(run.trainer)
    assert "(a tie, decided by the Hugging Face causal LM head)" in decision.message
    assert oom.loss_weighting.decided.kind is Weighting.TOKENS_SHIFTED
    assert not [w for w in recwarn if issubclass(w.category, GPUOptWarning)]
