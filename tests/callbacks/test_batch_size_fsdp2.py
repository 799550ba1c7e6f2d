"""MemoryAwareBatchSize under FSDP2 (FSDP2Strategy, an unchanged transformer): two CPU processes over gloo.

The acceptance run is a script (``fsdp2_batch_size_run.py``: Lightning's launcher starts rank 1 by
running it again); it finds each rank's true maximum by real steps, searches under per-rank limits,
and trains on. The protocol that keeps the ranks' trial steps in step is checked here in one process,
with the ranks' votes given.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import Precision
from torch.nn import functional as F

from lightning_gpuopt._exchange import PeerFailure
from lightning_gpuopt.batch_size.peak_model import SizeSearch, StepMeasurement
from lightning_gpuopt.batch_size.trial import TrialSteps
from lightning_gpuopt.callbacks.batch_size import run_trials
from lightning_gpuopt.oom_policy import Status, Vote
from lightning_gpuopt.support import Feature, StrategyKind, supports
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import subprocess_env

SCRIPT = Path(__file__).with_name("fsdp2_batch_size_run.py")
_FSDP2 = supports(Feature.BATCH_SIZE_SEARCH, StrategyKind.FSDP2)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp2_batch_size")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=out,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


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
        assert "FSDP2" in r["note"]


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


# --- the protocol that keeps the ranks' trial steps in step (one process, the other rank's votes given) ---


class _Exchange:
    """An FSDP2 exchange stand-in: this rank is rank 0 of 2; ``peer`` is rank 1's vote at each vote, in order."""

    world_size, rank, k = 2, 0, 1

    def __init__(self, peer: list[Vote]) -> None:
        self.peer = list(peer)
        self.sent: list[tuple[int, int]] = []
        self.recovered = 0

    def prepare(self) -> None:
        pass

    def install(self) -> None:
        pass

    def vote(self, status: int, k: int) -> list[Vote]:
        self.sent.append((int(status), k))
        return [Vote(status, k), self.peer.pop(0)]

    def recover(self) -> None:
        self.recovered += 1


class _Step(pl.LightningModule):
    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.fail = fail

    def training_step(self, batch):
        if self.fail is not None:
            raise self.fail
        return F.mse_loss(self.net(batch), torch.zeros(len(batch), 1))


def _trials(module: _Step, exchange: _Exchange, memory: SimulatedMemory) -> TrialSteps:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer = types.SimpleNamespace(
        optimizers=[optimizer], lr_scheduler_configs=[], precision_plugin=Precision()
    )
    return TrialSteps(trainer, module, memory, exchange=exchange)


def _measure(module: _Step, exchange: _Exchange):
    with SimulatedMemory() as memory, _trials(module, exchange, memory) as trials:
        return trials.measure(torch.ones(8, 4), 8)


def test_a_step_another_rank_ran_out_of_memory_in_is_not_measured_and_every_rank_resets_fsdp():
    exchange = _Exchange(peer=[])
    votes = [Vote(0, 1), Vote(Status.OOM, 1)]  # rank 1's failure met rank 0 at the vote before a collective
    assert _measure(_Step(PeerFailure(votes)), exchange) is None
    assert exchange.sent == [] and exchange.recovered == 1  # that vote was the verdict: no second one


def test_a_step_that_completed_here_is_measured_and_voted_on_once():
    exchange = _Exchange(peer=[Vote(Status.OOM, 1)])  # rank 1 ran out of memory after its last collective
    measured = _measure(_Step(), exchange)
    assert measured is not None and not measured.out_of_memory and measured.forward_backward_bytes > 0
    assert exchange.sent == [(0, 1)] and exchange.recovered == 1


def test_an_error_on_either_rank_stops_both_and_names_the_rank():
    exchange = _Exchange(peer=[Vote(Status.NONE, 1)])
    with pytest.raises(ValueError, match="user error"):  # this rank's own error, raised after its vote
        _measure(_Step(ValueError("user error")), exchange)
    assert exchange.sent == [(int(Status.FATAL), 1)]
    with pytest.raises(RuntimeError, match=r"a trial step failed on rank\(s\) 1 .*every rank stops"):
        _measure(_Step(), _Exchange(peer=[Vote(Status.FATAL, 1)]))


def test_every_rank_runs_the_smallest_size_any_rank_asks_for_while_any_asks():
    with SimulatedMemory() as memory:
        trials = _trials(_Step(), _Exchange(peer=[Vote(0, 12), Vote(0, 30), Vote(0, 0), Vote(0, 0)]), memory)
        assert trials.agree_size(20) == 12  # rank 1 asks for less: both run 12
        assert trials.agree_size(20) == 20
        assert trials.agree_size(None) is None  # no rank asks: the search is over everywhere
        assert trials.agree_size(7) == 7  # this rank's search goes on: rank 1 steps along


class _Ranks:
    """Two ranks' trial steps as :func:`run_trials` sees them on each rank, run round by round in one process.

    A step at ``n`` samples adds 10 B per sample over a held 1000 B on every rank; a rank runs out of
    memory above its ``limit`` (in samples), and the other rank's step then stops at its next collective.
    """

    def __init__(self, limits: tuple[int, int]) -> None:
        self.limits = limits
        self.rounds: list[int] = []

    def run(self, searches: tuple[SizeSearch, SizeSearch]) -> None:
        while True:
            asked = [s.next_size() for s in searches]
            sizes = [n for n in asked if n is not None]
            if not sizes:
                return
            size = min(sizes)
            self.rounds.append(size)
            failed = [size > limit for limit in self.limits]
            for rank, search in enumerate(searches):
                rank_trials = _OneRank(size, failed[rank], any(failed), asked[rank])
                run_trials_once(search, rank_trials)


class _OneRank:
    """One rank's view of one round: :meth:`agree_size` answers the agreed size once, then ``None``."""

    def __init__(self, size: int, oom: bool, peer_failed: bool, asked: int | None) -> None:
        self.size, self.oom, self.peer_failed, self.asked = size, oom, peer_failed, asked
        self.held_bytes = 1000
        self.done = False

    def agree_size(self, asked: int | None) -> int | None:
        if self.done:  # the next round's vote: this round is over
            return None
        assert asked == self.asked  # the search asked for what the round was agreed from
        self.done = True
        return self.size

    def measure(self, batch, size, nbytes, whole):
        if self.oom:
            return StepMeasurement(size, None)
        if self.peer_failed:
            return None  # stopped by the other rank's OOM before its step ended
        return StepMeasurement(size, 10 * size, 0)


def run_trials_once(search: SizeSearch, trials: _OneRank) -> None:
    run_trials(search, trials, lambda n: (None, n, 0, False), extra=0)


def _search(limit: int) -> SizeSearch:
    """The search of a rank whose memory holds ``limit`` samples (the budget is all of it)."""
    return SizeSearch(budget_bytes=1000 + 10 * limit, base_bytes=1000, smallest=1, largest=4096)


def test_ranks_run_the_same_sizes_at_most_four_steps_and_the_smaller_one_leads():
    """Rank 1 holds 300 samples, rank 0 2000: both run the same sizes, at most 4, and the smaller of their
    answers is what rank 1 finds alone (where rank 1's OOM stopped rank 0's step, rank 0 counts it as a bound)."""
    ranks = _Ranks(limits=(2000, 300))
    searches = (_search(2000), _search(300))
    ranks.run(searches)
    assert len(ranks.rounds) <= 4 and all(len(s.measurements) == len(ranks.rounds) for s in searches)
    alone = _search(300)
    _Ranks(limits=(300,)).run((alone,))
    answers = [s.result.size for s in searches]
    assert min(answers) == answers[1] == alone.result.size, (answers, alone.result.size, ranks.rounds)
    assert 0.9 * 300 <= answers[1] <= 300
