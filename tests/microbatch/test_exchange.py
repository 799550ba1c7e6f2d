"""exchange.py without processes: LocalExchange's vote, and the DDP and FSDP2 exchanges driven in one process with
a stand-in for ``torch.distributed`` that plays a second rank (its votes, its gradients: zeros), so that the vote's
order, the used-parameter mask, the averaging through small buckets, rank 0's buffers and the FSDP2 vote before a
collective are checked without a process group. The multi-process fits (tests/callbacks/test_oom_recovery_ddp.py,
tests/microbatch/test_skipped_batches_ddp.py) check them with real ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_gpuopt.microbatch import exchange
from lightning_gpuopt.microbatch.exchange import (
    DDPExchange,
    FSDP2Exchange,
    LocalExchange,
    PeerFailure,
    broadcast_from_rank_zero,
    first_rank_where,
    make_exchange,
)
from lightning_gpuopt.votes import Status, Vote


class TwoRanks:
    """``torch.distributed`` as this process sees it with one more rank: ``all_reduce`` adds what the other rank
    sends (its vote in its slots, zeros elsewhere: no gradient, no buffer)."""

    def __init__(self, rank: int, peer_vote: tuple[int, int] = (0, 1), peer_uses: list[bool] | None = None):
        self.rank, self.peer_vote, self.peer_uses = rank, peer_vote, peer_uses
        self.reduced: list[int] = []  # the number of values of each all-reduce of gradients and buffers

    def get_world_size(self, group=None):
        return 2

    def get_rank(self, group=None):
        return self.rank

    def all_reduce(self, tensor, group=None):
        if tensor.dtype == torch.int64 and tensor.numel() >= 4:  # the vote: two slots per rank (and the mask)
            peer = 1 - self.rank
            tensor[2 * peer], tensor[2 * peer + 1] = self.peer_vote
            if self.peer_uses is not None:
                tensor[4:] += torch.tensor(self.peer_uses, dtype=torch.int64)
        else:
            self.reduced.append(tensor.numel())


@pytest.fixture(autouse=True)
def _no_exit_grace(monkeypatch):
    monkeypatch.setattr(exchange, "_exit_grace_registered", True)


def _ddp(model: nn.Module, broadcast_buffers: bool = True) -> SimpleNamespace:
    return SimpleNamespace(module=model, process_group=None, broadcast_buffers=broadcast_buffers)


def test_local_exchange_votes_alone_and_has_nothing_to_reduce():
    local = make_exchange(object())  # a single-device strategy
    assert isinstance(local, LocalExchange)
    assert (local.world_size, local.rank, local.votes_inside_step) == (1, 0, False)
    local.prepare()
    local.begin(4)
    local.recover()
    local.reduce()
    assert local.vote(int(Status.OOM), 4) == [Vote(int(Status.OOM), 4)]


def test_without_a_process_group_the_collectives_of_values_are_this_processs_own():
    assert broadcast_from_rank_zero({"k": 3}) == {"k": 3}
    assert first_rank_where(True) == 0 and first_rank_where(False) is None


def test_ddp_votes_come_back_in_rank_order_and_teach_which_parameters_any_rank_used(monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    monkeypatch.setattr(
        exchange, "dist", TwoRanks(rank=1, peer_vote=(int(Status.OOM), 4), peer_uses=[0] * 4 + [1, 1])
    )
    ddp = DDPExchange(_ddp(model))
    assert (ddp.world_size, ddp.rank) == (2, 1)
    for p in model[0].parameters():  # this rank used the first layer, the other rank the last one
        p.grad = torch.ones_like(p)
    assert ddp.vote(0, 2) == [Vote(int(Status.OOM), 4), Vote(0, 2)]
    ddp.reduce()
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model[0].parameters())  # averaged over 2
    assert all(
        torch.equal(p.grad, torch.zeros_like(p)) for p in model[2].parameters()
    )  # used elsewhere: zeros
    assert all(p.grad is None for p in model[1].parameters())  # used nowhere: stays None, as DDP leaves it


def test_ddp_reduce_goes_through_buckets_and_gives_every_rank_rank_zeros_buffers(monkeypatch):
    def model():
        net = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
        net.register_buffer("count", torch.full((7,), 2.0))
        for p in net.parameters():
            p.grad = torch.randn(p.shape[::-1]).t() if p.ndim == 2 else torch.randn_like(p)  # not contiguous
        return net

    ranks = {}
    for rank in (0, 1):
        net, fake = model(), TwoRanks(rank)
        monkeypatch.setattr(exchange, "dist", fake)
        grads = [p.grad.clone() for p in net.parameters()]
        ddp = DDPExchange(_ddp(net), bucket_bytes=6 * 4)  # 6 float32 values per all-reduce
        ddp.reduce()
        for p, before in zip(net.parameters(), grads):
            torch.testing.assert_close(p.grad, before / 2)  # averaged (the other rank sent zeros)
        ranks[rank] = (net.count.clone(), fake.reduced)
    assert torch.equal(ranks[0][0], torch.full((7,), 2.0))  # rank 0 keeps its buffers
    assert torch.equal(ranks[1][0], torch.zeros(7))  # the others take rank 0's (here: the fake's zeros)
    params, buffers = (
        15 + 5 + 5 + 5,
        5 + 5 + 7 + 1,
    )  # weights, biases; running stats, count, num_batches_tracked
    sizes = ranks[0][1]
    assert (
        max(sizes) <= 6 and sum(sizes) == params + buffers
    )  # each value once, at most a bucket per all-reduce


def _fsdp2(fake_dist, monkeypatch, k: int = 2) -> FSDP2Exchange:
    """An FSDP2Exchange past its constructor (which needs a sharded module): the vote before each collective."""
    monkeypatch.setattr(exchange, "dist", fake_dist)
    fsdp = FSDP2Exchange.__new__(FSDP2Exchange)
    fsdp.groups, fsdp._originals, fsdp._votes = [], [], None
    fsdp.group, fsdp.world_size, fsdp.rank, fsdp.device = None, 2, fake_dist.rank, torch.device("cpu")
    fsdp.k, fsdp.peer_stops, fsdp.hybrid = k, 0, False
    return fsdp


def test_fsdp2_a_rank_meets_another_ranks_failure_at_its_next_collective(monkeypatch):
    fine = _fsdp2(TwoRanks(rank=0, peer_vote=(0, 2)), monkeypatch)
    fine.check()  # every rank fine: the collective runs
    failed = _fsdp2(TwoRanks(rank=0, peer_vote=(int(Status.OOM), 2)), monkeypatch)
    with pytest.raises(PeerFailure, match=r"rank\(s\) 1 ran out of memory during this attempt") as caught:
        failed.check()
    assert caught.value.votes == [Vote(0, 2), Vote(int(Status.OOM), 2)] and failed.peer_stops == 1


def test_fsdp2_every_rank_must_run_a_batch_as_as_many_micro_batches(monkeypatch):
    alike = _fsdp2(TwoRanks(rank=0, peer_vote=(0, 4)), monkeypatch)
    alike.begin(4)
    assert alike.k == 4
    differ = _fsdp2(TwoRanks(rank=0, peer_vote=(0, 2)), monkeypatch)
    with pytest.raises(RuntimeError, match=r"the ranks would run \[4, 2\]"):
        differ.begin(4)
