"""What a user sees of the loss-weighting decision: one line, the right words, kept across a resume, and a given
setting that wins over a checkpoint's decision.

The language model of test_loss_weighting_memory.py (``{"input_ids", "labels"}``, a token mean) runs into a real
out-of-memory error under SimulatedMemory, so the decision is made the way a user's run makes it: by a fresh
``OOMRecovery()``, at its first split.
"""

from __future__ import annotations

import functools
import logging
import re
import warnings

import pytest
import torch

from lightning_gpuopt import LossWeightingError, OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.microbatch.loss_weighting import LossWeighting
from tests.microbatch.test_loss_weighting_memory import HandWrittenLM, _fit

TOKENS = "loss weighting: tokens (labels != -100) — matches your loss to "


@functools.cache
def _peak() -> int:
    return _fit(HandWrittenLM("token-mean"), [], steps=1).peak


def _split_run(oom: OOMRecovery, steps: int = 2):
    return _fit(HandWrittenLM("token-mean"), [oom], limit=int(0.75 * _peak()), steps=steps)


def _weighting(trainer) -> list:
    return [d for d in decisions(trainer) if d.kind == "loss weighting"]


@pytest.mark.parametrize("verbose", [True, False])
def test_the_decision_is_said_once_in_the_users_words(caplog, verbose):
    with caplog.at_level(logging.INFO):
        run = _split_run(OOMRecovery(verbose=verbose))
    (decision,) = _weighting(run.trainer)  # recorded either way
    assert decision.message.startswith(TOKENS) and decision.data["checked"]
    assert "replayed" not in decision.message  # the step draws no random numbers: nothing was replayed
    said = [m for m in caplog.messages if m.startswith("loss weighting:")]
    assert said == ([decision.message] if verbose else [])


def test_a_decision_made_after_a_real_oom_is_kept_by_a_resumed_run():
    first = OOMRecovery()
    _split_run(first)
    state = first.state_dict()
    assert state["loss_weighting_checked"] is True and state["loss_weighting_kind"] == "tokens"
    resumed = OOMRecovery()
    resumed.load_state_dict(state)
    run = _split_run(resumed, steps=1)
    assert not _weighting(run.trainer), "the resumed run checked again"
    assert resumed.loss_weighting.decided.description == "tokens (labels != -100)"


def test_an_undecided_state_round_trips_and_the_check_runs_at_the_first_split():
    state = OOMRecovery().state_dict()
    assert state["loss_weighting_checked"] is False
    resumed = OOMRecovery()
    resumed.load_state_dict(state)
    run = _split_run(resumed)
    (decision,) = _weighting(run.trainer)
    assert decision.message.startswith(TOKENS)


def test_a_given_weight_fn_wins_over_a_decision_in_the_checkpoint():
    first = OOMRecovery()
    _split_run(first)

    def count(batch):
        return float((batch["labels"] != -100).sum())

    given = OOMRecovery(weight_fn=count)
    given.load_state_dict(first.state_dict())
    assert given.loss_weighting.decided.count_fn is count


class VectorLossLM(HandWrittenLM):
    """Returns each token's loss, unreduced: a mistake torch's backward would also refuse."""

    def training_step(self, batch, batch_idx):
        logits = self.head(self.features(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")


def test_a_step_that_returns_no_scalar_loss_is_told_so_in_one_line():
    """Split after an OOM in the forward, the check meets a (batch, tokens) loss: the error names its shape and
    the fix, not a micro-batch size the model "cannot run"."""
    with pytest.raises(LossWeightingError) as caught:
        _fit(VectorLossLM(), [OOMRecovery()], limit=int(0.3 * _peak()), steps=1)
    message = str(caught.value)
    assert "\n" not in message and "cannot run micro-batches" not in message
    assert re.search(
        r"returned a loss of shape \(\d+, \d+\): .* reduce it \(loss.mean\(\), loss.sum\(\)\)", message
    )


def test_warn_mode_says_a_mismatch_once_however_many_checks_find_one():
    """``on_mismatch="warn"``: the check runs again after a reset (a refused measurement, a resume), and the
    user hears the first mismatch only, whatever the later ones measured."""
    weighting = LossWeighting(on_mismatch="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for message in ("loss weighting: first", "loss weighting: second"):
            weighting._refuse(message)
    assert [str(w.message) for w in caught] == ["loss weighting: first"]
