"""``training_step`` returning ``None`` under OOMRecovery keeps plain Lightning's meaning (issue 26).

On one device a ``None`` skips the batch at every k: no backward, the optimizer step without gradients,
``global_step`` and step-wise LR schedules advancing as in plain Lightning. Under a split, a micro-batch's
``None`` skips the whole batch (its other micro-batches' gradients dropped), recorded once as a decision. Each
module is compared with plain Lightning (no callback) in 64-true: the global step, the learning rate and
‖Δθ − Δθ_ref‖/‖Δθ_ref‖ ≤ 1e-9. Inside an accumulation window (A = 3, issue 34) the skipped batch sits first,
in the middle or last, at k = 1, 2, 3 or in a window where an OOM made the engine split: the window's other
batches keep their gradients, and the batch_idx / global_step sequence is plain Lightning's.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from torch.nn import functional as F

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.batch_split import split_sizes
from lightning_gpuopt.decisions import decisions
from tests.helpers import training_distance
from tests.microbatch.stochastic_models import (
    Points,
    SkipsEveryThird,
    SkipsNonFinite,
    limit_forcing_split,
    train,
)

#: Samples with a NaN feature: batch 0 at k = 1 (before the first OOM), then micro-batch 2 of batch 2 and
#: micro-batch 1 of batch 3 once split in two (batches of 16).
POISONED = (5, 45, 51)
CASES = {
    "every-third": (SkipsEveryThird, Points),
    "non-finite": (SkipsNonFinite, lambda: Points(poisoned=POISONED)),
}


def _lr(run) -> float:
    return run.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]


@pytest.mark.parametrize("accumulate", [1, 2], ids=["no-accumulation", "accumulate-2"])
@pytest.mark.parametrize("split", [False, True], ids=["k1", "split"])
@pytest.mark.parametrize("case", list(CASES))
def test_none_skips_the_batch_as_in_plain_lightning(case, split, accumulate):
    make, data = CASES[case]
    steps = 6
    ref = train(
        make(), data(), simulate=False, precision="64-true", steps=steps, accumulate_grad_batches=accumulate
    )
    limit = limit_forcing_split(make, Points(), precision="64-true") if split else None
    oom = OOMRecovery(verbose=False)
    run = train(
        make(),
        data(),
        [oom],
        limit=limit,
        precision="64-true",
        steps=steps,
        accumulate_grad_batches=accumulate,
    )
    assert (oom.k >= 2) is split
    assert run.trainer.global_step == ref.trainer.global_step == steps
    assert _lr(run) == _lr(ref)
    assert training_distance(ref.theta0, run.theta, ref.theta) <= 1e-9
    skipped = [d for d in decisions(run.trainer) if d.kind == "skipped batch"]
    if not split:
        assert skipped == []
        return
    (decision,) = skipped  # the rule, once
    assert "the whole batch is skipped (the gradients of its micro-batches dropped)" in decision.message
    assert decision.data["k"] >= 2
    k = decision.data["k"]
    if (
        case == "non-finite"
    ):  # sample 45, 14th of batch 2: a later micro-batch; the earlier ones' gradients dropped
        ends = list(itertools.accumulate(split_sizes(16, k)))
        assert decision.data["micro_batch"] == 1 + sum(end <= 45 - 32 for end in ends) > 1
    else:  # the step returns None on the whole batch: its first micro-batch already
        assert decision.data["micro_batch"] == 1
    assert f"returned None for micro-batch {decision.data['micro_batch']} of {k} at step" in decision.message


class NoLossKey(SkipsEveryThird):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {"value": loss} if batch_idx == 1 else loss


@pytest.mark.parametrize("k", [1, 2])
def test_a_dict_without_loss_gets_lightnings_own_error(k):
    oom = OOMRecovery(verbose=False)
    oom.load_state_dict({"k": k})
    with pytest.raises(MisconfigurationException) as err:
        train(NoLossKey(), Points(), [oom], simulate=False)
    assert str(err.value) == (
        "In automatic_optimization, when `training_step` returns a dict, the 'loss' key needs to be present"
    )


# ----------------------------------------------------------------------------- inside an accumulation window

#: Samples per batch and batches per run: two accumulation windows of 3 (issue 34).
WINDOW_BATCH, WINDOW_A = 8, 3


class SkipsMarked(SkipsEveryThird):
    """Returns ``None`` for each batch that holds one of the ``marked`` sample ids (after logging)."""

    def __init__(self, marked: tuple[int, ...]) -> None:
        super().__init__()
        self.marked = set(marked)
        self.seen: list[int] = []  # the sample ids of every training step (the weighting check's excluded)

    def training_step(self, batch, batch_idx):
        ids, x = batch
        if torch.is_grad_enabled():
            self.seen += ids.tolist()
        loss = F.mse_loss(self.net(x), x.sum(1, keepdim=True).sin())
        self.log("train_loss", loss)
        return None if self.marked.intersection(ids.tolist()) else loss


class BatchSequence(Callback):
    """The (batch_idx, global_step) of each training batch, as Lightning's loop ran them."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((batch_idx, trainer.global_step))


def _marked(positions: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that make the batches at ``positions`` of each window skip: in the first window the batch's first
    sample (its first micro-batch at any k), in the second its last sample (its last micro-batch)."""
    first = [p * WINDOW_BATCH for p in positions]
    last = [(WINDOW_A + p) * WINDOW_BATCH + WINDOW_BATCH - 1 for p in positions]
    return tuple(first + last)


def _limit_between_k1_and_k2(marked, data, common) -> int:
    """A SimulatedMemory limit under which the engine runs some batch of the run as 2 micro-batches, not whole.

    Measured on the same module with the engine itself at A=3: inside a window it keeps the earlier batches'
    gradients beside the new ones, so plain Lightning's peaks (``limit_forcing_split``) would be too low."""
    peaks = []
    for k in (1, 2):
        oom = OOMRecovery(verbose=False, grow_back=False)  # grow back resets the peak at each batch
        oom.load_state_dict({"k": k})
        peaks.append(train(SkipsMarked(marked), data, [oom], limit=None, **common).memory.peak)
    whole, half = peaks
    assert half < whole, (half, whole)
    return (whole + half) // 2


@pytest.mark.parametrize("k", [1, 2, 3, "oom"], ids=["k1", "k2", "k3", "oom-retry"])
@pytest.mark.parametrize(
    "positions", [(0,), (1,), (2,), (0, 2)], ids=["first", "middle", "last", "first+last"]
)
def test_none_inside_an_accumulation_window_as_in_plain_lightning(positions, k):
    """A=3: the skipped batch's gradients are dropped, the window's others kept, the optimizer step taken or
    skipped as plain Lightning takes it; the batch_idx / global_step sequence and the parameters equal plain
    Lightning's (64-true), whether the batch runs whole, as 2 or 3 micro-batches, or is retried after an OOM."""
    marked = _marked(positions)
    data = Points(n=2 * WINDOW_A * WINDOW_BATCH)
    common = dict(precision="64-true", steps=2, batch_size=WINDOW_BATCH, accumulate_grad_batches=WINDOW_A)
    ref_seen = BatchSequence()
    ref = train(SkipsMarked(marked), data, [ref_seen], simulate=False, **common)
    oom, seen = OOMRecovery(verbose=False), BatchSequence()
    if k == "oom":  # a batch of the run runs out of memory whole and is retried as 2 micro-batches
        limit = _limit_between_k1_and_k2(marked, data, common)
        run = train(SkipsMarked(marked), data, [oom, seen], limit=limit, **common)
        assert oom.k == 2 and len(oom.failures) >= 1
    else:
        oom.load_state_dict({"k": k})
        run = train(SkipsMarked(marked), data, [oom, seen], simulate=False, **common)
        assert oom.k == k and oom.failures == []
    assert seen.seen == ref_seen.seen
    if k != "oom":  # no micro-batch runs after the one that returned None (the first window's: its first)
        for p in positions:
            first = [i for i in run.model.seen if p * WINDOW_BATCH <= i < (p + 1) * WINDOW_BATCH]
            assert first == list(range(p * WINDOW_BATCH, p * WINDOW_BATCH + math.ceil(WINDOW_BATCH / k))), p
    assert len(ref_seen.seen) == 2 * WINDOW_A and ref.trainer.global_step == 2
    assert _lr(run) == _lr(ref)
    assert training_distance(ref.theta0, run.theta, ref.theta) <= 1e-9
    for name, value in ref.theta.items():
        torch.testing.assert_close(run.theta[name], value, rtol=1e-9, atol=1e-12, msg=name)
