"""The loss of the whole optimizer step, across accumulated batches and ranks, where the loss is a token mean.

Batches by tokens hold different numbers of real tokens. One process on the union of an optimizer step's
batches computes the mean over all of the step's real tokens; Lightning averages each batch's mean (over
``accumulate_grad_batches``, and DDP over the ranks), which differs whenever the counts differ. With
``OOMRecovery()`` (its defaults: the weighting decided by the check) the engine scales each batch's loss by
its share of the step's tokens, so the run equals the union's, in 64-true within the suite's same-training
measure at a floor of 1e-9:

- on one device, ``accumulate_grad_batches`` 2 and 3, at k = 1 and k = 2 (the check decides at the first batch
  when nothing splits);
- a sample-mean loss keeps Lightning's own averaging (nothing changes where counts are samples);
- on 2 DDP ranks whose batches hold different token counts (``ddp_step_shares_run.py``, slow), against one
  process on the union of the ranks' batches, with and without accumulation.

The reference is written out by hand: per optimizer step, the sum of every batch's token losses over the
step's token count, one backward, one SGD step.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.microbatch.loss_weighting_rules import Candidate, Weighting
from lightning_gpuopt.microbatch.step_shares import StepShares
from tests.helpers import TRAINER_QUIET, assert_same_training, parameters_of, run_ranks, training_distance
from tests.microbatch.test_loss_weighting_memory import HandWrittenLM, PaddedTokens

BATCH = 8
FLOOR = 1e-9


def _token_sum(model: HandWrittenLM, batch: dict) -> torch.Tensor:
    logits = model.head(model.features(batch["input_ids"]))
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=-100, reduction="sum")


def union_loss(model: HandWrittenLM, batches: list[dict]) -> torch.Tensor:
    """One process on the union of a step's batches: the mean over all the step's real tokens."""
    total = sum(int((b["labels"] != -100).sum()) for b in batches)
    return sum(_token_sum(model, b) for b in batches) / total


def averaged_loss(model: HandWrittenLM, batches: list[dict]) -> torch.Tensor:
    """Lightning's own averaging: the mean of each batch's token mean."""
    return sum(model.training_step(b, 0) for b in batches) / len(batches)


def reference(
    model: HandWrittenLM, steps: list[list[dict]], step_loss=union_loss, lr: float = 0.5
) -> dict[str, torch.Tensor]:
    """SGD in float64 with ``step_loss(model, batches)`` over each optimizer step's batches."""
    model = model.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batches in steps:
        optimizer.zero_grad()
        step_loss(model, batches).backward()
        optimizer.step()
    return parameters_of(model)


def _batches(n_batches: int) -> list[dict]:
    data = PaddedTokens(n=n_batches * BATCH)
    return list(DataLoader(data, batch_size=BATCH, shuffle=False))


def _fit(reduction: str, accumulate: int, steps: int, callbacks: list) -> tuple[dict, dict, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = HandWrittenLM(reduction)
    theta0 = parameters_of(model)
    trainer = pl.Trainer(
        max_steps=steps,
        precision="64-true",
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        **TRAINER_QUIET,
    )
    data = PaddedTokens(n=steps * accumulate * BATCH)
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=False))
    return theta0, parameters_of(model), trainer


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulated_batches_share_the_step_by_their_tokens(accumulate, k):
    steps = 3
    oom = OOMRecovery(verbose=False)
    if k > 1:
        oom.load_state_dict({"k": k})
    theta0, theta, trainer = _fit("token-mean", accumulate, steps, [oom])
    (weighting,) = [d for d in decisions(trainer) if d.kind == "loss weighting"]
    assert weighting.data["weighting"] == "tokens" and weighting.data["checked"], weighting.message
    batches = _batches(steps * accumulate)
    ref = reference(
        HandWrittenLM("token-mean"), [batches[s * accumulate : (s + 1) * accumulate] for s in range(steps)]
    )
    assert_same_training(theta0, theta, ref, floor=FLOOR, factor=1.0, elementwise=True)
    # Lightning's own averaging of the batches' means is measurably another training here: the test can fail.
    _, plain, _ = _fit("token-mean", accumulate, steps, [])
    assert training_distance(theta0, plain, ref) > 1e-4


def test_a_sample_mean_loss_keeps_lightnings_averaging():
    theta0, theta, _ = _fit("sample-mean", 2, 3, [OOMRecovery(verbose=False)])
    _, plain, _ = _fit("sample-mean", 2, 3, [])
    assert_same_training(theta0, theta, plain, floor=FLOOR, factor=1.0, elementwise=True)


class _Ranks:
    """A stand-in for the ranks' exchange: ``total`` sums what every rank passes at the same batch."""

    def __init__(self, world_size: int, counts: list[float]) -> None:
        self.world_size, self.counts = world_size, counts

    def total(self, value: float) -> float:
        return sum(self.counts)


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.lists(st.integers(1, 500), min_size=2, max_size=2), min_size=1, max_size=4),
    world=st.integers(1, 2),
)
def test_the_shares_sum_to_the_union_mean(counts, world):
    """For any token counts (batches × ranks), the factors the ranks apply, averaged over the ranks (DDP),
    divided by the accumulation and corrected at the step, give every batch its tokens over the step's tokens."""
    accumulate = len(counts)
    tokens = Candidate(Weighting.TOKENS, "tokens", "labels")
    per_rank = [StepShares() for _ in range(world)]
    effective = [[0.0] * world for _ in counts]
    for b, row in enumerate(counts):
        row = row[:world]
        for r in range(world):
            batch = {"labels": torch.ones(1, row[r], dtype=torch.long)}
            factor = per_rank[r].factor(tokens, batch, _Ranks(world, row), b == 0)
            per_rank[r].keep()
            effective[b][r] = (
                factor / accumulate / world
            )  # what the ranks' averaged gradient holds of the batch
    grads = [torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)) for _ in range(world)]
    for r, p in enumerate(grads):
        p.grad = torch.ones(1, dtype=torch.float64)
        per_rank[r].finish([p], accumulate)
    ratio = float(grads[0].grad)
    assert all(float(p.grad) == ratio for p in grads)  # every rank corrects alike
    total = sum(sum(row[:world]) for row in counts)
    for b, row in enumerate(counts):
        for r in range(world):
            assert effective[b][r] * ratio == pytest.approx(row[r] / total, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_ranks_with_different_token_counts_train_like_one_process_on_their_union(tmp_path, accumulate):
    script = Path(__file__).with_name("ddp_step_shares_run.py")
    results = run_ranks(script, tmp_path, accumulate, timeout=240)
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["weighting"] == "tokens"
    steps = results[0]["steps"]
    rank_batches = [r["batches"] for r in results]
    union = [
        [rank_batches[r][s * accumulate + a] for a in range(accumulate) for r in range(2)]
        for s in range(steps)
    ]
    counts = {r: [int((b["labels"] != -100).sum()) for b in rank_batches[r]] for r in range(2)}
    assert counts[0] != counts[1]  # the ranks' batches hold different token counts
    ref = reference(HandWrittenLM("token-mean"), union)
    theta0 = parameters_of(HandWrittenLM("token-mean").double())
    for result in results:
        assert_same_training(theta0, result["params"], ref, floor=FLOOR, factor=1.0, elementwise=True)
    averaged = reference(HandWrittenLM("token-mean"), union, averaged_loss)
    assert training_distance(theta0, averaged, ref) > 1e-4  # the ranks' plain average is another training


class ValidatedLM(HandWrittenLM):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))


def test_the_validation_loss_is_the_mean_over_the_epochs_tokens():
    """A token-mean loss logged in validation, in a fit whose steps share by tokens (accumulation 2): the epoch's
    value is the mean over all the epoch's real tokens (each batch weighted by its tokens, not its samples);
    without the pack, Lightning's mean by samples differs."""
    val = PaddedTokens(n=5 * BATCH)

    def validate(callbacks: list) -> tuple[float, float]:
        pl.seed_everything(0, verbose=False)
        model = ValidatedLM("token-mean")
        trainer = pl.Trainer(
            max_epochs=1, precision="64-true", accumulate_grad_batches=2, callbacks=callbacks, **TRAINER_QUIET
        )
        loader = DataLoader(val, batch_size=BATCH, shuffle=False)
        trainer.fit(model, DataLoader(PaddedTokens(n=4 * BATCH), batch_size=BATCH), loader)
        with torch.no_grad():
            sums = sum(_token_sum(model, b) for b in loader)
        expected = float(sums) / sum(int((b["labels"] != -100).sum()) for b in loader)
        return float(trainer.callback_metrics["val_loss"]), expected

    logged, expected = validate([OOMRecovery(verbose=False)])
    assert logged == pytest.approx(expected, rel=1e-12)
    logged, expected = validate([])
    assert abs(logged - expected) > 1e-6


class CountingLM(HandWrittenLM):
    def __init__(self) -> None:
        super().__init__("token-mean")
        self.small_calls = 0

    def training_step(self, batch, batch_idx):
        self.small_calls += len(batch["labels"]) < BATCH  # the check's pieces of 2 and 1 samples
        return super().training_step(batch, batch_idx)


def test_data_whose_samples_hold_as_many_tokens_is_not_checked_at_every_step():
    """Full-length samples (no padding): tokens and samples weigh every batch alike, so the check can never decide
    on a whole batch; it stops asking after 16 batches instead of running at every step."""
    data = PaddedTokens(n=80 * BATCH)
    data.labels = data.ids.clone()  # every token real
    model = CountingLM()
    trainer = pl.Trainer(
        max_steps=40, accumulate_grad_batches=2, callbacks=[OOMRecovery(verbose=False)], **TRAINER_QUIET
    )
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=False))
    assert 0 < model.small_calls <= 16 * 3
