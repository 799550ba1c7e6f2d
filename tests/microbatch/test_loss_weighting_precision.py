"""The loss-weighting check's tolerance under every precision a user can reach on CPU.

At each precision the check must pick the weighting of the user's loss (tokens for a token mean, also one
summed by hand in bf16, sample shares for a mean over samples, a sum for a sum) and refuse a loss that couples
samples. The tolerance
(``loss_weighting_rules.tolerance``) must be loose enough for the right candidate under the precision's
rounding, and tight enough that no wrong candidate passes: both are asserted on the check's measured
differences.

The batches are built so that the two can be told apart at every precision: short samples hold "hard"
tokens (a loss near 9.4 per token), long samples "easy" ones (near 0.07), so the wrong candidates miss the
piece's loss by more than 0.3 (relative) while the precision's rounding stays under 3e-3 (bf16-true). A second
sweep lowers the contrast until the nearest wrong candidate misses by only a few times the precision's
tolerance, less than the next looser precision's: a tolerance as loose as that one would take it.
``16-mixed`` becomes ``bf16-mixed`` on CPU (Lightning says so); it and ``16-true`` run under the slow marker.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import LossWeightingError, OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.microbatch.loss_weighting_rules import tolerance
from tests.helpers import TRAINER_QUIET

VOCAB, LENGTH = 32, 16
LENGTHS = [2, 16, 5, 12, 3, 14, 8, 10]
PRECISIONS = ["64-true", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]


class HardShortEasyLong(Dataset):
    """Sequences of the lengths in LENGTHS; up to 5 tokens they are drawn from the hard half of the vocabulary."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.zeros(len(LENGTHS), LENGTH, dtype=torch.long)
        for i, n in enumerate(LENGTHS):
            low, high = (VOCAB // 2, VOCAB) if n <= 5 else (0, VOCAB // 2)
            self.ids[i] = torch.randint(low, high, (LENGTH,), generator=g)
        padding = torch.arange(LENGTH)[None, :] >= torch.tensor(LENGTHS)[:, None]
        self.labels = self.ids.masked_fill(padding, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class TokenPredictor(pl.LightningModule):
    """Logits from an embedding and a linear layer, each token predicting itself: an easy token with a logit of
    6, a hard one with ``6 - contrast`` (``contrast`` 12: a loss near 9.4 against 0.07)."""

    def __init__(self, reduction: str, contrast: float = 12.0, float32_loss: bool = False) -> None:
        super().__init__()
        weight = torch.zeros(VOCAB, VOCAB)
        for t in range(VOCAB):
            weight[t, t] = 6.0 if t < VOCAB // 2 else 6.0 - contrast
        self.embed = nn.Embedding(VOCAB, VOCAB, _weight=weight)
        self.float32_loss = float32_loss
        self.mix = nn.Linear(VOCAB, VOCAB)
        with torch.no_grad():
            self.mix.weight.copy_(torch.eye(VOCAB))
            self.mix.bias.zero_()
        self.reduction = reduction

    def training_step(self, batch, batch_idx):
        logits = self.mix(self.embed(batch["input_ids"]))
        if self.float32_loss:  # as Hugging Face's losses do, whatever the model's precision
            logits = logits.float()
        labels = batch["labels"]
        if (
            self.reduction == "score-mean"
        ):  # a token mean written by hand, in the model's compute dtype (bf16...)
            mask = labels != -100
            scores = logits.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
            return ((6.5 - scores) * mask).sum() / mask.sum()
        if self.reduction == "in-batch-negatives":  # each sample's negatives are the batch's other samples
            z = F.normalize(logits.float().mean(1), dim=-1)
            return F.cross_entropy(z @ z.T, torch.arange(len(z)))
        if self.reduction == "token-mean":
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        if self.reduction == "sum":
            return per_token.sum()
        return (per_token.sum(1) / (labels != -100).sum(1)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


EXPECTED = {
    "token-mean": "tokens",
    "score-mean": "tokens",
    "sample-mean": "samples",
    "sum": "sum",
    "in-batch-negatives": None,
}


def _check(precision: str, reduction: str, contrast: float = 12.0, float32_loss: bool = False) -> OOMRecovery:
    """One step split in two from the first batch (as after an OOM): the check runs on its two samples."""
    oom = OOMRecovery()
    oom.load_state_dict({"k": 2})
    trainer = pl.Trainer(max_steps=1, precision=precision, callbacks=[oom], **TRAINER_QUIET)
    model = TokenPredictor(reduction, contrast, float32_loss)
    loader = DataLoader(HardShortEasyLong(), batch_size=len(LENGTHS))
    if EXPECTED[reduction] is None:
        with pytest.raises(
            LossWeightingError, match="no weighting of micro-batch losses reproduces your loss"
        ):
            trainer.fit(model, loader)
    else:
        trainer.fit(model, loader)
        (decision,) = [d for d in decisions(trainer) if d.kind == "loss weighting"]
        assert decision.data["weighting"] == EXPECTED[reduction] and decision.data["checked"]
    assert oom.loss_weighting.result.tolerance == tolerance(trainer.precision)
    return oom


def _right_and_wrong(oom: OOMRecovery, reduction: str) -> tuple[float | None, dict[str, float]]:
    """The right candidate's measured difference (``None`` for a loss no weighting reproduces), and the others'."""
    result, decided = oom.loss_weighting.result, oom.loss_weighting.decided
    assert result.checked and len(result.errors) == 4, result.errors  # samples, tokens, shifted tokens, sum
    if EXPECTED[reduction] is None:
        return None, dict(result.errors)
    assert decided.kind.value == EXPECTED[reduction] and not result.tied
    wrong = {c: e for c, e in result.errors.items() if c != decided.description}
    return result.errors[decided.description], wrong


SLOW = pytest.mark.slow
CPU_PRECISIONS = [
    "64-true",
    "32-true",
    "bf16-mixed",
    "bf16-true",
    pytest.param("16-mixed", marks=SLOW),  # bf16-mixed on CPU
    pytest.param("16-true", marks=SLOW),
]


@pytest.mark.filterwarnings("ignore:.*16-mixed.*:UserWarning")  # Lightning: 16-mixed is bf16-mixed on CPU
@pytest.mark.parametrize("reduction", list(EXPECTED))
@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_the_check_picks_the_loss_own_weighting_at_every_precision(precision, reduction):
    oom = _check(precision, reduction)
    tol = oom.loss_weighting.result.tolerance
    right, wrong = _right_and_wrong(oom, reduction)
    # Not so tight that the precision's rounding fails the right candidate...
    assert right is None or right <= tol
    # ...nor so loose that a wrong one passes.
    assert all(e > tol for e in wrong.values()), wrong
    if precision.startswith("bf16") and reduction == "score-mean":
        # The rounding is real here: a float32 tolerance (2e-5) for bf16 would refuse the right candidate.
        assert right > tolerance("32-true")


#: A hard token's logit below an easy one's, per precision: the token mean's nearest wrong candidate (tokens
#: shifted by one) then misses by a few times the precision's tolerance, less than the next looser one's.
NEAR = [
    ("64-true", 1e-4, "32-true"),  # misses by 5e-6: between 1e-6 and 2e-5
    ("32-true", 4e-3, "16-true"),  # 2e-4: between 2e-5 and 1e-2
    pytest.param("16-true", 0.5, "bf16-true", marks=SLOW),  # 3e-2: between 1e-2 and 4e-2
]


@pytest.mark.parametrize(("precision", "contrast", "looser"), NEAR)
def test_a_wrong_candidate_just_outside_the_tolerance_is_not_taken(precision, contrast, looser):
    oom = _check(precision, "token-mean", contrast)
    tol = oom.loss_weighting.result.tolerance
    right, wrong = _right_and_wrong(oom, "token-mean")
    assert right <= tol
    nearest = min(wrong.values())
    assert tol < nearest < tolerance(looser), (
        wrong
    )  # a tolerance as loose as the next precision's would take it


def test_a_loss_computed_in_float32_under_64_true_is_within_its_tolerance():
    oom = _check("64-true", "token-mean", float32_loss=True)
    right, wrong = _right_and_wrong(oom, "token-mean")
    assert 1e-12 < right <= tolerance("64-true")  # float32's rounding, which a float64 tolerance would refuse
    assert all(e > tolerance("64-true") for e in wrong.values())
