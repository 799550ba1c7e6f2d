"""Trial steps under FSDP2: the protocol that keeps the ranks' trial steps in step, in one process.

The other rank's votes are given; the real two-process run is tests/callbacks/test_batch_size_fsdp2.py.
"""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import Precision
from torch.nn import functional as F

from lightning_gpuopt.batch_size.trial import TrialSteps
from lightning_gpuopt.microbatch.exchange import PeerFailure
from lightning_gpuopt.testing import SimulatedMemory
from lightning_gpuopt.votes import Status, Vote

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
