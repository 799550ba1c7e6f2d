"""Samples that cannot tell the weightings apart leave the decision open until a batch's samples can.

A batch whose samples all have the same length counts tokens in proportion to samples: a token mean and a mean
over samples then give the same weights to its micro-batches, and the check on two of its samples cannot say
which one the loss is. Either weighting is exact for such a batch; the decision waits for the first split batch
whose samples differ (padded text after a first batch of full-length sequences, say), where the check runs and
decides. Nothing is guessed: the parameters equal the unsplit run's, in 64-true, whatever came first.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.decisions import decisions
from tests.helpers import TRAINER_QUIET, assert_same_training, parameters_of, run_ranks
from tests.microbatch.test_loss_weighting_memory import VOCAB, HandWrittenLM

BATCH, LENGTH, STEPS = 8, 12, 4
EXPECTED = {"token-mean": "tokens", "sample-mean": "samples"}


class FullThenPadded(Dataset):
    """``BATCH``-sample batches: the first ``full`` of them full-length sequences, the rest padded (lengths 2 to
    ``LENGTH``, labels -100 on the padding). ``offset`` shifts the draws (another rank's data)."""

    def __init__(self, full: int, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(3 + offset)
        n = STEPS * BATCH
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
        lengths[: full * BATCH] = LENGTH
        self.labels = self.ids.masked_fill(torch.arange(LENGTH)[None, :] >= lengths[:, None], -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _fit(reduction: str, full: int, k: int | None):
    pl.seed_everything(0, verbose=False)
    model = HandWrittenLM(reduction)
    theta0 = parameters_of(model)
    callbacks = []
    if k is not None:
        oom = OOMRecovery()
        oom.load_state_dict({"k": k})  # every step splits in k, as after an OOM
        callbacks.append(oom)
    trainer = pl.Trainer(max_steps=STEPS, precision="64-true", callbacks=callbacks, **TRAINER_QUIET)
    trainer.fit(model, DataLoader(FullThenPadded(full), batch_size=BATCH, shuffle=False))
    return theta0, parameters_of(model), trainer


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("full", [0, 1, 2])
@pytest.mark.parametrize("reduction", list(EXPECTED))
def test_the_weighting_is_decided_where_the_samples_tell_the_candidates_apart(reduction, full, k):
    theta0, reference, _ = _fit(reduction, full, None)
    _, theta, trainer = _fit(reduction, full, k)
    (weighting,) = [d for d in decisions(trainer) if d.kind == "loss weighting"]
    assert weighting.step == full, "decided at the first batch whose samples differ"
    assert weighting.data["checked"] and weighting.data["weighting"] == EXPECTED[reduction]
    assert_same_training(theta0, theta, reference, floor=1e-9, factor=1.0, elementwise=True)


def test_a_run_of_equal_lengths_only_never_needs_to_decide():
    theta0, reference, _ = _fit("token-mean", STEPS, None)
    _, theta, trainer = _fit("token-mean", STEPS, 2)
    assert not [d for d in decisions(trainer) if d.kind == "loss weighting"]
    assert_same_training(theta0, theta, reference, floor=1e-9, factor=1.0, elementwise=True)


@pytest.mark.slow
def test_under_ddp_the_rank_whose_samples_differ_decides_for_every_rank(tmp_path):
    """Rank 0's first batch has equal lengths, rank 1's is padded: rank 1's check decides at step 0, and the
    ranks end equal, with the single-process run on both ranks' batches."""
    script = Path(__file__).with_name("ddp_weighting_alike_run.py")
    ranks = run_ranks(script, tmp_path)
    for rank, got in enumerate(ranks):
        assert got["error"] is None and got["steps"] == STEPS, (rank, got["error"])
        assert [(d["step"], d["weighting"], d["checked"]) for d in got["weighting"]] == [(0, "tokens", True)]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


class FullThenPaddedMask(FullThenPadded):
    """The same text with an attention mask and no labels: two candidates (sample shares and mask tokens) count
    full-length samples alike."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": (self.labels[i] != -100).long()}


class MaskMeanLM(HandWrittenLM):
    """A token mean over the attention mask (its labels made inside the step)."""

    def training_step(self, batch, batch_idx):
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return super().training_step({"input_ids": batch["input_ids"], "labels": labels}, batch_idx)


def test_two_candidates_alike_wait_for_samples_that_tell_them_apart_too():
    def fit(k):
        pl.seed_everything(0, verbose=False)
        model = MaskMeanLM("token-mean")
        theta0 = parameters_of(model)
        oom = OOMRecovery()
        if k is not None:
            oom.load_state_dict({"k": k})
        trainer = pl.Trainer(max_steps=STEPS, precision="64-true", callbacks=[oom], **TRAINER_QUIET)
        trainer.fit(model, DataLoader(FullThenPaddedMask(full=1), batch_size=BATCH, shuffle=False))
        return theta0, parameters_of(model), trainer

    theta0, reference, _ = fit(None)
    _, theta, trainer = fit(2)
    (weighting,) = [d for d in decisions(trainer) if d.kind == "loss weighting"]
    assert weighting.step == 1 and weighting.data["weighting"] == "attention-mask tokens"
    assert_same_training(theta0, theta, reference, floor=1e-9, factor=1.0, elementwise=True)
