"""OOMRecovery under FSDP2 (FSDP2Strategy, an unchanged module): two CPU processes over gloo, OOM on rank 1 only.

FSDP2 all-gathers each unit's parameters in the forward and the backward and reduce-scatters its
gradients: a rank that stops mid-step would leave the other waiting in the next collective. The
ranks vote before each one; these runs check that nothing hangs, every rank takes the same decisions,
and the result is the unlimited run's. Each run is a script (`fsdp2_oom_run.py`): Lightning's launcher
starts rank 1 by running it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_gpuopt.microbatch import unsupported_strategy
from lightning_gpuopt.strategy import FSDP2Strategy
from lightning_gpuopt.support import Feature
from tests.helpers import run_ranks

SCRIPT = Path(__file__).with_name("fsdp2_oom_run.py")

pytestmark = pytest.mark.skipif(
    unsupported_strategy(FSDP2Strategy(), Feature.OOM_RECOVERY) is not None,
    reason=f"this torch cannot recover under FSDP2: {unsupported_strategy(FSDP2Strategy(), Feature.OOM_RECOVERY)}",
)


def fsdp2_fit(
    out: Path, rule: str, callback: bool = True, expect_failure: bool = False, units: str = "linear"
) -> list[dict]:
    return run_ranks(
        SCRIPT, out, rule, "1" if callback else "0", units, timeout=300, expect_failure=expect_failure
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """FSDP2 without the callback and without a limit."""
    return fsdp2_fit(tmp_path_factory.mktemp("fsdp2") / "plain", "none", callback=False)


def _assert_params(run: list[dict], reference: list[dict]) -> None:
    zero, one = run
    for name, want in reference[0]["params"].items():
        assert torch.equal(zero["params"][name], one["params"][name]), name  # the ranks hold the same model
        # fp32, and the recovered step ran as micro-batches: rounding differs from the whole batch's
        # (observed about 4e-8 on parameters of magnitude 0.02-0.35).
        torch.testing.assert_close(one["params"][name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rule", "units"),
    [("forward", "linear"), ("backward", "linear"), ("backward", "whole")],
    ids=["forward", "backward", "backward-inside-one-multi-layer-unit"],
)
def test_oom_on_one_rank_makes_both_retry_and_keeps_the_plain_fsdp2_result(tmp_path, reference, rule, units):
    """``whole``: the three layers are one root unit, so the interrupted backward had put gradients into the
    gathered parameters before FSDP reduce-scattered them; the retry must not add to them."""
    zero, one = fsdp2_fit(tmp_path / rule, rule, units=units)
    train = [[h for h in r["history"] if h[4] == "train"] for r in (zero, one)]
    assert one["failures"] >= 1 and zero["failures"] == 0, "only rank 1 ran out of memory"
    assert train[0] and train[0] == train[1] and all(h[0] == 2 and h[3] == "oom" for h in train[1])
    assert zero["history"] == one["history"]  # the same decisions, also for validation under the limit
    assert zero["steps"] == one["steps"] == 6 and zero["error"] is None and one["error"] is None
    if rule == "forward":  # rank 0 was still inside the step: stopped at the vote before a collective
        assert zero["peer_stops"] >= 1
    _assert_params((zero, one), reference)


@pytest.mark.slow
def test_validation_oom_on_one_rank_splits_both_ranks_batches_and_keeps_every_loss(tmp_path, reference):
    zero, one = fsdp2_fit(tmp_path / "validation", "validation")
    assert one["failures"] >= 1 and zero["history"] == one["history"]
    assert {h[4] for h in one["history"]} == {"validation"}
    for got, want in zip((zero, one), reference):
        assert [i for i, _ in got["val_losses"]] == [
            i for i, _ in want["val_losses"]
        ]  # each sample once, in order
        torch.testing.assert_close(
            [v for _, v in got["val_losses"]], [v for _, v in want["val_losses"]], rtol=1e-5, atol=1e-6
        )
    _assert_params((zero, one), reference)


@pytest.mark.slow
def test_nothing_left_to_split_on_one_rank_stops_both_without_hanging(tmp_path):
    zero, one = fsdp2_fit(tmp_path / "tiny", "tiny", expect_failure=True)
    assert (
        one["error"][0] == "MicroBatchOOMError"
        and "no smaller micro-batch can fit" in one["error"][1]  # the quick, honest end: no futile tries
    )
    assert zero["error"][0] == "RankOutOfMemoryError" and "Rank(s) 1 ran out of memory" in zero["error"][1]


def test_ranks_that_would_run_different_numbers_of_micro_batches_stop_alike_with_the_reason():
    """Each micro-batch all-gathers and reduce-scatters: different counts would pair mismatched collectives."""
    from lightning_gpuopt.microbatch.exchange import FSDP2Exchange
    from lightning_gpuopt.votes import Vote

    exchange = FSDP2Exchange.__new__(FSDP2Exchange)  # the check alone: one process, the ranks' counts given
    exchange.prepare = exchange.install = lambda: None
    exchange.vote = lambda status, k: [Vote(0, 2), Vote(0, 3)]
    with pytest.raises(
        RuntimeError, match=r"same number of micro-batches .* would run \[2, 3\].*batches of the same size"
    ):
        exchange.begin(2)
    exchange.vote = lambda status, k: [Vote(0, 2), Vote(0, 2)]
    exchange.begin(2)
    assert exchange.k == 2
