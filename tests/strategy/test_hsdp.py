"""HSDP (FSDP2Strategy(hsdp=True)): its mesh and arguments, and OOM recovery and checkpoints on 2 "nodes" x 2.

The multi-process case starts ``hsdp_run.py`` twice, as two nodes (``NODE_RANK`` 0 and 1 on 127.0.0.1);
Lightning's launcher starts each node's second process. Two runs (40-75 s together on the shared 2-core
machine): one epoch with three OOMs on rank 3 and a checkpoint, then a second epoch resumed from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from lightning_gpuopt.cli import main
from lightning_gpuopt.memory import ParallelLayout, predict_peak
from lightning_gpuopt.microbatch import unsupported_strategy
from lightning_gpuopt.strategy import FSDP2Strategy, hsdp_shape, select_strategy
from lightning_gpuopt.support import Feature
from tests.callbacks.oom_models import Waves
from tests.helpers import run_as_two_nodes
from tests.strategy.fsdp2_oom_run import Deep
from tests.strategy.hsdp_run import BATCH, LIMITED_RANK, STEPS_PER_EPOCH, WORLD
from tests.strategy.strategy_models import Block

SCRIPT = Path(__file__).with_name("hsdp_run.py")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicate_size": 2}, r"`replicate_size` \(2\) sets the replicas of HSDP: pass `hsdp=True`"),
        ({"hsdp": True, "replicate_size": 0}, r"`replicate_size` must be a positive int .* got 0"),
        ({"hsdp": "yes"}, r"`hsdp` must be True or False, got 'yes'"),
    ],
    ids=["replicas-without-hsdp", "zero-replicas", "hsdp-not-bool"],
)
def test_bad_hsdp_arguments_fail_at_construction_with_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDP2Strategy(**kwargs)


def test_hsdp_shape_shards_within_groups_and_refuses_sizes_that_do_not_divide():
    assert hsdp_shape(16, 2) == (2, 8)  # 2 nodes of 8 devices
    assert hsdp_shape(16, 4) == (4, 4)
    with pytest.raises(
        ValueError, match=r"3 replicas of 16 ranks leave groups of unequal size.*divides devices x"
    ):
        hsdp_shape(16, 3)
    with pytest.raises(
        ValueError, match=r"leaves 1 rank per shard group: nothing is sharded. Use strategy='ddp'"
    ):
        hsdp_shape(4, 4)


def test_a_bad_replicate_size_fails_before_the_processes_meet():
    """Checked in setup_environment before the process group is made: no rank waits for another."""
    strategy = FSDP2Strategy(hsdp=True, replicate_size=3)
    strategy.num_nodes, strategy.parallel_devices = 2, [torch.device("cpu")] * 2  # as the Trainer sets them
    with pytest.raises(ValueError, match=r"3 replicas of 4 ranks"):
        strategy.setup_environment()
    assert not torch.distributed.is_initialized()


def test_recovery_refuses_an_hsdp_mesh_whose_shard_groups_hold_one_rank():
    """FSDP skips the reduce-scatter of a one-rank shard group, so nothing would stand before the replicas'
    all-reduce to vote: refused with the reason (one process, a (1, 1) mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_gpuopt.microbatch.exchange import FSDP2Exchange

    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        with pytest.raises(
            ValueError, match=r"HSDP mesh of 1 replica\(s\) x 1 shard\(s\) .* at least 2 ranks"
        ):
            FSDP2Exchange(model)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the plan with several nodes

GiB = 2**30


def _model(width: int = 2048, depth: int = 8) -> nn.Module:
    with torch.device("meta"):  # 268.5 M parameters, no memory
        return nn.Sequential(*(Block(width) for _ in range(depth)), nn.Linear(width, 1))


def _plan(memory_mib: int, num_nodes: int = 2, devices: int = 4, **kwargs):
    return select_strategy(
        _model(),
        devices=devices,
        num_nodes=num_nodes,
        device_memory=memory_mib * 2**20,
        device="cpu",
        **kwargs,
    )


# 268.5 M parameters, fp32, Adam, 2 nodes x 4 devices, per device: DDP 20 B/parameter (5.00 GiB); HSDP, full
# sharding over a node's 4: 4 B + two gathered blocks (1.25 GiB); sharding gradients and optimizer state over
# all 8: 5.5 B (1.38 GiB); full sharding over all 8: 2 B + the blocks (0.75 GiB). The budget is 90 %.
@pytest.mark.parametrize(
    ("memory_mib", "expected"),
    [
        (80 * 1024, "ddp"),
        (1638, "hsdp: full shard in node"),  # budget 1.44 GiB: HSDP fits, and so would sharding over all 8
        (1200, "fsdp: full shard"),  # budget 1.05 GiB: a node's 4 shards do not fit, all 8 do
    ],
    ids=["ddp-fits", "hsdp-fits", "hsdp-does-not-fit"],
)
def test_with_two_nodes_hsdp_is_picked_whenever_sharding_within_a_node_fits(memory_mib, expected):
    plan = _plan(memory_mib)
    rows = {r.name: r for r in plan.rows}
    hsdp = rows["hsdp: full shard in node"]
    assert plan.pick == expected
    assert hsdp.fits is (memory_mib >= 1638)
    assert rows["fsdp: shard grads+optimizer"].fits is (memory_mib >= 1638)  # fits, yet HSDP is preferred
    assert hsdp.estimate.total == pytest.approx(1.25 * GiB, rel=0.01)
    assert rows["fsdp: full shard"].estimate.total == pytest.approx(0.75 * GiB, rel=0.01)
    if expected == "hsdp: full shard in node":
        strategy = plan.strategy
        assert isinstance(strategy, FSDP2Strategy) and strategy.hsdp and strategy.replicate_size is None
        assert (
            strategy.reshard_after_forward and not strategy.cpu_offload and strategy.shard_modules == [Block]
        )
    elif expected == "fsdp: full shard":
        assert not plan.strategy.hsdp
        assert "(sharding within a node, hsdp: full shard in node, would need 1.25 GiB)" in plan.reason
    assert "hsdp: full shard in node" in plan.table()


def test_hsdp_memory_is_full_sharding_over_one_nodes_devices():
    """Per device, HSDP on 2 nodes x 4 holds what full sharding on one node of 4 holds."""
    two_nodes = {r.name: r.estimate for r in _plan(80 * 1024).rows}
    one_node = {r.name: r.estimate for r in _plan(80 * 1024, num_nodes=1).rows}
    assert "hsdp: full shard in node" not in one_node  # one node: nothing to replicate across
    hsdp, node = two_nodes["hsdp: full shard in node"], one_node["fsdp: full shard"]
    assert (hsdp.parameters, hsdp.gradients, hsdp.optimizer, hsdp.gathered) == (
        node.parameters,
        node.gradients,
        node.optimizer,
        node.gathered,
    )


@pytest.mark.usefixtures("cli_argv")
def test_gpuopt_plan_with_two_nodes_prints_the_hsdp_row_and_why_it_was_not_picked(capsys):
    main(
        [
            "plan",
            "--model",
            "lightning.pytorch.demos.boring_classes.BoringModel",
            "--data",
            "lightning.pytorch.demos.boring_classes.BoringDataModule",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--trainer.num_nodes",
            "2",
            "--gpuopt.device_memory",
            "556",
        ]
    )
    out = capsys.readouterr().out
    # BoringModel is one unit: gathered whole (528 B), HSDP's shards of 2 save less than that
    assert "gpuopt plan: 4 device(s) (2 nodes x 2), 556 B each (budget 500 B)" in out
    hsdp = next(line for line in out.splitlines() if line.startswith("hsdp: full shard in node"))
    # parameters, gradients, optimizer, gathered, activations, total; no host memory (no offload)
    assert hsdp.split()[5:] == ["132", "B", "132", "B", "0", "B", "528", "B", "0", "B", "792", "B", "-", "no"]
    assert "pick: fsdp: shard grads+optimizer: hsdp: full shard in node would need 792 B per device" in out


def test_one_device_per_node_plans_no_hsdp():
    plan = _plan(1200, devices=1, num_nodes=4)  # a shard group of one device shards nothing
    assert all(not r.estimate.candidate.hybrid for r in plan.rows)


class _Squared(nn.Module):
    """``net``'s output squared and averaged: a loss from a plain call."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).square().mean()


def test_the_traced_peak_of_hsdp_is_full_sharding_over_the_shard_group():
    """The prediction (a sample batch given) shards over a node's devices, not over every rank."""
    with torch.device("meta"):
        model = _Squared(nn.Sequential(*(Block(256) for _ in range(4)), nn.Linear(256, 1)))
    batch = torch.empty(8, 256, device="meta")
    units = tuple(f"net.{i}" for i in range(4))
    layouts = {
        "hsdp 2x4": ParallelLayout("fsdp", 8, replicate_size=2, units=units),
        "fsdp 4": ParallelLayout("fsdp", 4, units=units),
        "fsdp 8": ParallelLayout("fsdp", 8, units=units),
    }
    peak = {
        name: predict_peak(model, batch, torch.optim.Adam, layout=layout, device="cpu").peak_bytes
        for name, layout in layouts.items()
    }
    assert peak["hsdp 2x4"] == peak["fsdp 4"] > peak["fsdp 8"]
    plan = select_strategy(
        model, devices=4, num_nodes=2, optimizer="adam", sample_batch=batch, device_memory=GiB, device="cpu"
    )
    hsdp = next(r for r in plan.rows if r.name == "hsdp: full shard in node")
    assert hsdp.predicted_bytes is not None and hsdp.prediction.method.value == "traced"


def test_a_layout_with_replicas_that_do_not_divide_the_ranks_is_refused():
    with pytest.raises(
        ValueError, match=r"`replicate_size` must be a positive int dividing `world_size` \(8\), got 3"
    ):
        ParallelLayout("fsdp", 8, replicate_size=3)
    with pytest.raises(ValueError, match=r"\(HSDP\) needs kind='fsdp', got kind='ddp'"):
        ParallelLayout("ddp", 8, replicate_size=2)


# ---------------------------------------------------------------- 4 processes as 2 nodes x 2


def _run_nodes(out: Path, mode: str) -> list[dict]:
    """Both nodes' launchers at once; every rank's result."""
    run_as_two_nodes([sys.executable, str(SCRIPT), str(out), mode], out)
    return [torch.load(out / f"{mode}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _unsharded_reference(epochs: int) -> dict[str, torch.Tensor]:
    """The same model on one process, each step on the 4 ranks' batches together.

    Each rank's batches come from the DistributedSampler Lightning gives a training loader (shuffled, seed 0).
    """
    model = Deep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = Waves(length=BATCH * WORLD * STEPS_PER_EPOCH)
    samplers = [
        DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=True, seed=0) for r in range(WORLD)
    ]
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        order = [list(sampler) for sampler in samplers]
        for step in range(STEPS_PER_EPOCH):
            rows = torch.tensor([i for ids in order for i in ids[step * BATCH : (step + 1) * BATCH]])
            optimizer.zero_grad()
            F.mse_loss(model.net(data.x[rows]), data.y[rows]).backward()
            optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_params(ranks: list[dict], reference: dict[str, torch.Tensor]) -> None:
    for name, want in reference.items():
        for r in ranks:
            assert torch.equal(r["params"][name], ranks[0]["params"][name]), (
                name
            )  # every rank, the same model
        # fp32, recovered steps ran as micro-batches: rounding differs from the whole batch's
        torch.testing.assert_close(ranks[0]["params"][name], want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("hsdp")
    return {mode: _run_nodes(out, mode) for mode in ("oom", "resume")}


_UNSUPPORTED = unsupported_strategy(FSDP2Strategy(hsdp=True), Feature.OOM_RECOVERY)


@pytest.mark.slow
@pytest.mark.skipif(_UNSUPPORTED is not None, reason=f"this torch cannot recover under FSDP2: {_UNSUPPORTED}")
def test_ooms_in_forward_backward_and_before_the_replica_all_reduce_are_recovered_on_all_four_ranks(
    hsdp_runs,
):
    ranks = hsdp_runs["oom"]
    assert all(r["mesh"].startswith("DeviceMesh((replicate=2, shard=2)") for r in ranks)
    assert all(r["error"] is None and r["steps"] == STEPS_PER_EPOCH for r in ranks)
    history = ranks[0]["history"]
    assert all(r["history"] == history for r in ranks)  # the same k on all four ranks, decided together
    assert {h[0] for h in history} == {1, 2, 3} and all(h[3] == "oom" and h[2] > h[1] for h in history)
    assert [r["k"] for r in ranks] == [ranks[0]["k"]] * WORLD
    assert ranks[LIMITED_RANK]["failures"] >= 3
    assert all(r["failures"] == 0 for i, r in enumerate(ranks) if i != LIMITED_RANK)
    # Step 3: rank 3 failed after its reduce-scatter; every other rank stopped at the vote before the
    # replicas' all-reduce (its replica, rank 1, would otherwise wait there for rank 3).
    for i, r in enumerate(ranks):
        if i != LIMITED_RANK:
            assert r["peer_stops"][3] > r["peer_stops"][2], i
    _assert_params(ranks, _unsharded_reference(epochs=1))


@pytest.mark.slow
@pytest.mark.skipif(_UNSUPPORTED is not None, reason=f"this torch cannot recover under FSDP2: {_UNSUPPORTED}")
def test_a_checkpoint_saved_under_hsdp_loads_and_resumes_with_its_micro_batches(hsdp_runs):
    saved, resumed = hsdp_runs["oom"], hsdp_runs["resume"]
    assert all(r["error"] is None and r["steps"] == 2 * STEPS_PER_EPOCH for r in resumed)
    assert (
        resumed[0]["k"][STEPS_PER_EPOCH] == saved[0]["k"][STEPS_PER_EPOCH - 1] > 1
    )  # the decision came back
    # restored once, before the first batch, on every rank (ModelParallelStrategy restores after on_fit_start)
    assert all(
        r["history"] == [(STEPS_PER_EPOCH, 1, saved[0]["history"][-1][2], "resume", "train")] for r in resumed
    )
    # parameters and the SGD momentum both came back: the second epoch lands on the reference's
    _assert_params(resumed, _unsharded_reference(epochs=2))
