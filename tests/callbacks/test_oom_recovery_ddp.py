"""OOMRecovery under DDP: two CPU processes over gloo, out of memory on rank 1 only.

Each rank runs under its own SimulatedMemory. Rank 1's limit is set from its own measurement after
two unlimited steps (the full batch then cannot finish its forward, or its backward), so the OOM is
real, happens on one rank only, and mid-run. The run must neither hang nor abort, every rank must
retry with the same k, and the result must be the plain DDP run's. With both ranks out of memory at the same
step, each asking for another split, every rank takes the larger one (``ddp_two_recoveries_run.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_gpuopt import MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.microbatch import MicroBatchEngine, OptimizerStepOOMError, RankOutOfMemoryError
from lightning_gpuopt.microbatch.errors import Refused
from lightning_gpuopt.microbatch.setup_checks import check_strategy
from tests.callbacks.oom_models import Waves, WideRegressor, fit
from tests.helpers import RankRecorder, parameters_of, run_ranks, training_distance

LIMITED_RANK = 1
LIMIT_AFTER = 2  # batches 0 and 1 run without a limit on every rank


class RankMemory(RankRecorder):
    """Rank r trains under its own SimulatedMemory; rank 1 gets a limit after LIMIT_AFTER batches.

    ``rule``: ``"forward"`` (the full batch cannot finish its forward), ``"backward"`` (its forward fits,
    its backward does not), ``"tiny"`` (not even one sample fits) or ``None``. Writes what the rank ended with to
    ``out_dir/rank{r}.pt``, also when the fit raises.
    """

    lingering_ranks = (0, 1)

    def __init__(self, out_dir: str, rule: str | None) -> None:
        super().__init__(out_dir)
        self.rule = rule

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.rule is None or trainer.global_rank != LIMITED_RANK or trainer.global_step != LIMIT_AFTER:
            return
        _, start, kept, peak = pl_module.marks[-1]  # the last full-batch step, measured on this rank
        self.mem.limit_bytes = {
            "forward": start + int(0.7 * (peak - start)),
            "backward": peak + int(0.25 * kept),
            # Room for the next batch (10 KiB) and Lightning's own small tensors, not for the 16 KiB
            # activation of even one sample: an OOM outside the training step would be no test of this pack.
            "tiny": self.mem.allocated_bytes + 24 * 1024,
        }[self.rule]

    def result(self, trainer, pl_module, error):
        engine = MicroBatchEngine.get(trainer)
        oom = next((c for c in trainer.callbacks if isinstance(c, OOMRecovery)), None)
        return {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in pl_module.named_buffers()},
            "history": [(c.step, c.k_before, c.k_after, c.source) for c in engine.history] if engine else [],
            "failures": len(oom.failures) if oom else 0,
            "steps": trainer.global_step,
            "pid": os.getpid(),
        }


class NormRegressor(WideRegressor):
    """WideRegressor with BatchNorm after the wide layer: running statistics that ranks must agree on."""

    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__(optimizer)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 2048), nn.BatchNorm1d(2048), nn.Tanh(), nn.Linear(2048, 1))


def ddp_fit(tmp_path, name, model, callbacks, rule=None, steps=8, accumulate=1, **ddp_kwargs) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=DDPStrategy(start_method="spawn", **ddp_kwargs),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        precision="64-true",
        accumulate_grad_batches=accumulate,
        callbacks=[RankMemory(str(out), rule), *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(
            model, DataLoader(Waves(length=128 * 2 * steps * accumulate), batch_size=128, shuffle=False)
        )
    finally:
        results = [
            torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").exists() else None
            for r in (0, 1)
        ]
    return results


def _assert_same(a: dict, b: dict, exact: bool) -> None:
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain DDP, no callback, no limit."""
    return ddp_fit(tmp_path_factory.mktemp("reference"), "plain", WideRegressor("adam"), [])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rule", "ddp_kwargs"),
    [("forward", {}), ("backward", {"gradient_as_bucket_view": True})],
    ids=["forward", "mid-backward-bucket-view"],
)
def test_oom_on_one_rank_makes_every_rank_retry_and_keeps_the_plain_ddp_result(
    tmp_path, reference, rule, ddp_kwargs
):
    ranks = ddp_fit(tmp_path, rule, WideRegressor("adam"), [OOMRecovery()], rule=rule, **ddp_kwargs)
    zero, one = ranks
    assert one["failures"] >= 1 and zero["failures"] == 0, "only rank 1 ran out of memory"
    assert one["history"] and [h[:3] for h in zero["history"]] == [h[:3] for h in one["history"]]
    assert all(source == "oom" and step == LIMIT_AFTER for step, _, _, source in one["history"])
    assert zero["steps"] == one["steps"] == 8 and zero["pid"] != one["pid"]
    _assert_same(zero["params"], one["params"], exact=True)
    _assert_same(one["params"], reference[0]["params"], exact=False)


@pytest.mark.slow
def test_a_compiled_lightning_module_recovers_under_ddp(tmp_path, reference):
    """``trainer.fit(torch.compile(model))`` with ``strategy="ddp"``: rank 1 runs out of memory, both split alike."""
    zero, one = run_ranks(Path(__file__).with_name("ddp_compiled_run.py"), tmp_path)
    assert one["failures"] >= 1 and zero["failures"] == 0
    assert one["history"] and [h[:3] for h in zero["history"]] == [h[:3] for h in one["history"]]
    assert zero["steps"] == one["steps"] == 8 and zero["error"] is None and one["error"] is None
    _assert_same(zero["params"], one["params"], exact=True)
    _assert_same(one["params"], reference[0]["params"], exact=False)
    # Compiled it was, on both ranks, and both ranks' split recompiled once, alike.
    compiled = [json.loads((tmp_path / f"rank{r}_compile.json").read_text()) for r in (0, 1)]
    assert all(c["frames"] >= 1 for c in compiled), compiled
    assert compiled[0]["recompilations"] == compiled[1]["recompilations"] != [], compiled
    assert compiled[0]["recompilations"][0].startswith("recompiled after split 128 → 64")


@pytest.mark.slow
def test_batchnorm_statistics_stay_identical_across_ranks_after_recovery(tmp_path):
    zero, one = ddp_fit(
        tmp_path, "norm", NormRegressor("adam"), [OOMRecovery()], rule="forward", accumulate=2
    )
    assert one["failures"] >= 1 and zero["history"] == one["history"]
    _assert_same(zero["params"], one["params"], exact=True)
    _assert_same(zero["buffers"], one["buffers"], exact=True)
    assert (
        int(one["buffers"]["net.1.num_batches_tracked"]) > 8
    )  # the statistics did move, micro-batch by micro-batch


@pytest.mark.slow
def test_nothing_left_to_split_on_one_rank_stops_every_rank_without_hanging(tmp_path):
    with pytest.raises(Exception, match=r"ran out of memory|Out of memory"):
        ddp_fit(tmp_path, "fatal", WideRegressor("adam"), [OOMRecovery()], rule="tiny")
    zero, one = (torch.load(tmp_path / "fatal" / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert (
        one["error"][0] == MicroBatchOOMError.__name__
        and "with micro-batches of 1 sample(s)" in one["error"][1]
        and "no smaller micro-batch can fit" in one["error"][1]
    )
    assert (
        zero["error"][0] == RankOutOfMemoryError.__name__
        and "Rank(s) 1 ran out of memory" in zero["error"][1]
    )


# ---------------------------------------------------------------------------- what is refused (no processes)


def _ddp_strategy(model_attrs: dict, **kwargs) -> DDPStrategy:
    strategy = DDPStrategy(**kwargs)
    strategy.model = SimpleNamespace(**{"_comm_hooks": [], "static_graph": False, **model_attrs})
    return strategy


@pytest.mark.parametrize(
    ("module", "strategy", "message"),
    [
        (nn.SyncBatchNorm(4), _ddp_strategy({}), r"cannot run SyncBatchNorm.*Use plain BatchNorm"),
        (
            nn.Linear(2, 2),
            _ddp_strategy({"_comm_hooks": [("hook", None)]}),
            r"communication hook .* would never run",
        ),
        (
            nn.Linear(2, 2),
            _ddp_strategy({}, ddp_comm_hook=lambda *a: None),
            r"communication hook .* would never run",
        ),
        (nn.Linear(2, 2), _ddp_strategy({"static_graph": True}), r"static_graph=True"),
    ],
    ids=["sync-batchnorm", "registered-hook", "strategy-hook", "static-graph"],
)
def test_ddp_settings_that_break_the_step_are_refused(module, strategy, message):
    with pytest.raises(Refused, match=message):
        check_strategy(strategy, module)


# ---------------------------------------------------------------------------- a remote OOM, in one process


class RemoteOOM(pl.Callback):
    """Makes the engine's vote report an OOM from a second rank at one step: this rank's good attempt is dropped."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_fit_start(self, trainer, pl_module):
        from lightning_gpuopt.microbatch.exchange import LocalExchange
        from lightning_gpuopt.votes import STATUS_OOM, Vote

        callback = self

        class TwoRanks(LocalExchange):
            world_size = 2

            def vote(self, status, k):
                if trainer.global_step == callback.step and not callback.done:
                    callback.done = True
                    return [Vote(status, k), Vote(STATUS_OOM, 4)]
                return [Vote(status, k), Vote(0, k)]

        # The engine's own exchange (a LocalExchange on one device) hears a second rank's votes from now on.
        MicroBatchEngine.get(trainer).exchange.__class__ = TwoRanks


class EpochLogged(WideRegressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        return loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_good_attempt_dropped_for_another_rank_leaves_no_trace(accumulate):
    from tests.callbacks.oom_models import fit, optimizer_step_ids

    ref = fit(
        EpochLogged("adam"),
        [],
        steps=6,
        accumulate=accumulate,
        limit_train_batches=6 * accumulate,
        max_epochs=1,
    )
    cb, remote = OOMRecovery(), RemoteOOM(step=2)
    run = fit(
        EpochLogged("adam"),
        [cb, remote],
        steps=6,
        accumulate=accumulate,
        limit_train_batches=6 * accumulate,
        max_epochs=1,
    )
    assert remote.done and not cb.failures and cb.k == 4  # retried with the other rank's k, no OOM here
    for got, want in zip(run.params(), ref.params()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert optimizer_step_ids(run.model, accumulate) == optimizer_step_ids(
        ref.model, accumulate
    )  # metric: once
    logged, expected = run.trainer.callback_metrics["epoch_loss"], ref.trainer.callback_metrics["epoch_loss"]
    torch.testing.assert_close(logged, expected, rtol=1e-9, atol=0)  # the dropped attempt logged nothing


class StepLimit(pl.Callback):
    """Rank 1 runs out of memory inside the optimizer step of step 2 (Adam's state exists by then)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == LIMITED_RANK and trainer.global_step == LIMIT_AFTER:
            probe = get_probe()
            probe.limit_bytes = probe.allocated_bytes + 24 * 1024  # the vote's small tensors fit


def test_an_oom_in_the_optimizer_step_on_one_rank_ends_every_rank_with_the_same_error(tmp_path):
    with pytest.raises(Exception, match="optimizer step"):
        ddp_fit(tmp_path, "step", WideRegressor("adam"), [OOMRecovery(), StepLimit()])
    zero, one = (torch.load(tmp_path / "step" / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert one["error"][0] == zero["error"][0] == OptimizerStepOOMError.__name__, (
        zero["error"],
        one["error"],
    )
    assert "could not be retried" in one["error"][1] and "optimizer state" in one["error"][1]
    assert "Rank(s) 1 ran out of memory in the optimizer step" in zero["error"][1]
    assert zero["steps"] == one["steps"] == LIMIT_AFTER


# ---------------------------------------------------------------------------- two ranks, two recoveries


@pytest.mark.slow
def test_two_ranks_out_of_memory_at_once_agree_on_the_larger_split(tmp_path):
    """Both ranks run out of memory at step 2 under their own limits: rank 0 alone would split in 2, rank 1 asks
    for more. Every rank takes the larger k (votes.agree: the most cautious split wins), the ranks stay in
    step, and the parameters equal an unsplit run on the same samples (64-true)."""
    from tests.callbacks import ddp_two_recoveries_run as script

    # Of each rank's own full-batch step peak: rank 0 fits at k 2 (56 %), rank 1 needs k >= 4.
    zero, one = run_ranks(Path(script.__file__), tmp_path, 0.78, 0.25)
    assert zero["error"] is None and one["error"] is None and zero["pid"] != one["pid"]
    (step0, failed0, asked0), *_ = zero["proposals"]
    (step1, failed1, asked1), *_ = one["proposals"]
    assert (step0, failed0, step1, failed1) == (script.LIMIT_AFTER, 1, script.LIMIT_AFTER, 1)
    assert asked0 == 2 and asked1 > asked0, (zero["proposals"], one["proposals"])
    assert zero["history"] == one["history"]
    assert zero["history"][0] == (script.LIMIT_AFTER, 1, asked1, "oom")  # the larger proposal, on every rank
    assert len(zero["proposals"]) == 1  # rank 0 fit at rank 1's split; only rank 1 may have needed more
    assert all(step == script.LIMIT_AFTER and source == "oom" for step, _, _, source in one["history"])
    assert zero["batches"] == one["batches"] == [(i, i + 1) for i in range(script.STEPS)]
    _assert_same(zero["params"], one["params"], exact=True)
    # The unsplit run on the same samples: batch b is both ranks' batch b (their averaged gradient is its mean
    # loss's), in one process.
    order = [i for b in range(script.STEPS) for i in zero["ids"][b] + one["ids"][b]]
    assert sorted(order) == list(range(script.BATCH * 2 * script.STEPS))  # every sample once
    dataset = Subset(Waves(length=len(order)), order)
    ref = fit(WideRegressor("adam"), steps=script.STEPS, batch_size=2 * script.BATCH, dataset=dataset)
    theta = {n: p.double() for n, p in one["params"].items()}
    assert training_distance(parameters_of(WideRegressor("adam")), theta, parameters_of(ref.model)) <= 1e-9
    _assert_same(one["params"], dict(ref.model.named_parameters()), exact=False)
