"""MemoryAwareBatchSize under FSDP2 (FSDP2Strategy, an unchanged transformer): two CPU processes over gloo.

The acceptance run is a script (``fsdp2_batch_size_run.py``: Lightning's launcher starts rank 1 by
running it again); it finds each rank's true maximum by real steps, searches under per-rank limits,
and trains on. The protocol that keeps the ranks' trial steps in step is checked in one process, with
the ranks' votes given, in tests/batch_size/test_trial.py and test_search.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_gpuopt.support import Feature, StrategyKind, supports
from tests.helpers import run_ranks

SCRIPT = Path(__file__).with_name("fsdp2_batch_size_run.py")
_FSDP2 = supports(Feature.BATCH_SIZE_SEARCH, StrategyKind.FSDP2)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp2_batch_size")
    return run_ranks(SCRIPT, out, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not _FSDP2.supported, reason=f"MemoryAwareBatchSize under FSDP2: {_FSDP2.reason}")
def test_two_fsdp2_ranks_under_different_limits_agree_on_90_percent_of_the_smaller_true_maximum(fsdp2_run):
    """The true maximum of each rank: the largest micro-batch whose real FSDP2 step (gathered units and
    reduce-scatter buffers included) peaks within that rank's limit, by bisection of real steps without a limit."""
    zero, one = fsdp2_run
    assert zero["limits"] == one["limits"] and zero["truth"] == one["truth"]
    (high, low), (truth_high, truth_low) = zero["limits"], zero["truth"]
    assert low < high and truth_low < truth_high < 64  # rank 1 has less memory; both need micro-batches
    searched = [zero["search"], one["search"]]
    assert all(r["units"] >= 4 for r in searched)  # 3 encoder layers as units, and the other children
    # Every trial step ran on both ranks at the same size; rank 1's limit led (its trials ran out of memory).
    assert zero["search"]["measured"] == one["search"]["measured"], searched
    assert one["search"]["ooms_in_search"] >= 1 and zero["search"]["ooms_in_search"] == 0, searched
    agreed = {r["micro_batch_size"] for r in searched}
    assert len(agreed) == 1 and len({r["k"] for r in searched}) == 1, searched
    (size,) = agreed
    assert 0.9 * truth_low <= size <= truth_low, (size, truth_low, searched)
    assert all(1 <= r["trials"] <= 4 for r in searched)
    for r in searched:  # training went on at the agreed micro-batch, without an OOM after the search
        assert r["steps"] == 4 and r["ooms"] == r["ooms_in_search"], r
        assert r["history"] == [(0, 1, -(-64 // size), "memory")], r["history"]


@pytest.mark.slow
@pytest.mark.skipif(not _FSDP2.supported, reason=f"MemoryAwareBatchSize under FSDP2: {_FSDP2.reason}")
def test_fsdp2_max_mode_sets_one_batch_size_on_both_ranks_and_trains_on(fsdp2_run):
    zero, one = (r["max"] for r in fsdp2_run)
    assert zero["batch_size"] == one["batch_size"] > 8 and zero["trials"] == one["trials"] <= 4, (zero, one)
    assert all(r["steps"] == 2 and r["ooms"] == r["ooms_in_search"] for r in (zero, one)), (zero, one)


@pytest.mark.slow
@pytest.mark.skipif(not _FSDP2.supported, reason=f"MemoryAwareBatchSize under FSDP2: {_FSDP2.reason}")
def test_fsdp2_trial_steps_leave_no_trace(fsdp2_run):
    """The same fit with the answer restored (no search) ends with the same sharded parameters, bit for bit."""
    for rank in fsdp2_run:
        twin, searched = rank["twin"], rank["search"]
        assert not twin["searched"] and twin["k"] == searched["k"] and twin["ooms"] == 0
        assert twin["params"].keys() == searched["params"].keys()
        for name, value in searched["params"].items():
            assert torch.equal(twin["params"][name], value), name
    zero, one = (r["search"]["params"] for r in fsdp2_run)
    assert all(torch.equal(zero[n], one[n]) for n in zero)  # the ranks hold one model
