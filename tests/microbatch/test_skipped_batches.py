"""``training_step`` returning ``None`` under OOMRecovery keeps plain Lightning's meaning (issue 26).

On one device a ``None`` skips the batch at every k: no backward, the optimizer step without gradients,
``global_step`` and step-wise LR schedules advancing as in plain Lightning. Under a split, a micro-batch's
``None`` skips the whole batch (its other micro-batches' gradients dropped), recorded once as a decision. Each
module is compared with plain Lightning (no callback) in 64-true: the global step, the learning rate and
‖Δθ − Δθ_ref‖/‖Δθ_ref‖ ≤ 1e-9.
"""

from __future__ import annotations

import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_gpuopt import OOMRecovery
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
    if case == "non-finite":  # poisoned in a later micro-batch: the earlier one's gradients were dropped
        assert decision.data["micro_batch"] > 1


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
