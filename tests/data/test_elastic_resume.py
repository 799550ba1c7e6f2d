"""Elastic resume of map-style data (issue 37): a run resumed on another number of ranks goes on past the samples
the interrupted epoch consumed, instead of starting the epoch again, and keeps the optimizer batch.

ResumableSampler deals one order per epoch round-robin, so the ranks' b-th batches together are one window of it
on any number of ranks: the checkpoint's consumed samples are the first C of the order, and the resumed epoch deals
the rest over the new ranks. Swept with Hypothesis (dataset sizes, ranks before and after, batch sizes, the batch
of the interruption, shuffle). Real runs (tests/resume_child.py, DDP over gloo), map-style and stream: stopped by
SIGTERM on 2 ranks, resumed on 1, stopped again and resumed on 3, against the uninterrupted 2-rank run; and a
resume that keeps the per-rank batch size, whose resumed epoch is shorter than a whole one. A module's own loader
keeps the optimizer batch through accumulate_grad_batches.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gpuopt.data.resume import ResumableSampler
from tests import resume_child
from tests.helpers import assert_same_training, parameters_of, run_ranks


def _dealt(n: int, world: int, shuffle: bool, skip: int = 0) -> list[list[int]]:
    samplers = [
        ResumableSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=7) for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(3)
        s.skip(3, skip)
    return [[i for _, i in s] for s in samplers]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    batch=st.integers(1, 5),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_a_resume_on_another_number_of_ranks_sees_every_sample_of_the_epoch(
    n, before, after, batch, shuffle, data
):
    old = _dealt(n, before, shuffle)
    per_rank_batches = -(-len(old[0]) // batch)
    done = data.draw(st.integers(0, per_rank_batches - 1), label="batches consumed")
    consumed = [i for rank in old for i in rank[: done * batch]]
    skip = done * batch * before  # what the checkpoint counts: batches x batch_size x ranks
    new = _dealt(n, after, shuffle, skip)
    assert len({len(rank) for rank in new}) == 1  # every new rank as many samples: as many batches
    if before == after:  # on the same ranks: what the uninterrupted epoch dealt past those batches
        assert new == [rank[done * batch :] for rank in old]
    seen = collections.Counter(consumed + [i for rank in new for i in rank])
    assert set(seen) == set(range(n))  # nothing lost
    # Repeats: only the padding to a multiple of the ranks, of what was consumed (past the dataset's end, on the
    # ranks before) and of what was left (on the ranks after).
    padding = max(0, skip - n) + (-max(0, n - skip)) % after
    assert sum(seen.values()) - n == padding
    # Lightning restores its batch count and ends the epoch at len(loader): the resumed loader's length is that
    # count plus the batches left, so no batch is cut and the epoch-end check falls on the last.
    new_batch = data.draw(st.integers(1, 6), label="batch size after")
    for rank in range(after):
        sampler = ResumableSampler(range(n), num_replicas=after, rank=rank, shuffle=shuffle, seed=7)
        sampler.set_epoch(3)
        sampler.skip(3, skip, counted=done * new_batch)
        loader = torch.utils.data.DataLoader(sampler, batch_size=new_batch)
        assert len(loader) == done + -(-len(new[rank]) // new_batch)


def _ids(root: Path) -> list[int]:
    """Every sample id any rank of any leg trained on (tests/resume_child.py's ``ids_rank*.txt``)."""
    seen = []
    for path in sorted(root.glob("ids_rank*.txt")):
        for line in path.read_text().splitlines():
            epoch, _, ids = line.split()
            if ids != "-":
                seen += [(int(epoch), int(i)) for i in ids.split(",")]
    return seen


def _params(root: Path) -> dict[str, torch.Tensor]:
    return {n: p.to(torch.float64) for n, p in torch.load(root / "params.pt").items()}


ELASTIC = ("--no-dropout", "--report", "--hidden", "16")


def _leg(root: Path, ranks: int, *args: object) -> None:
    run_ranks(
        Path(resume_child.__file__), root, *ELASTIC, "--devices", ranks, *args, ranks=1, result="params.pt"
    )


def _leg_here(root: Path, *args: object) -> None:
    """One rank, in this process (no process to start)."""
    resume_child.main([str(root), *map(str, ELASTIC), *map(str, args)])


@pytest.mark.slow
@pytest.mark.parametrize("data", ["map-style", "stream"])
def test_stopped_on_2_ranks_resumed_on_1_then_on_3_trains_like_the_uninterrupted_2_rank_run(tmp_path, data):
    """Optimizer batch 24 (2 ranks x 12), 24 x 60 samples (map-style, or a ShardedStream of 6 shards of 240 with a
    shuffle window of 64), a per-sample-mean loss, no dropout, 64-true: SIGTERM at step 25, resumed on 1 rank (batch
    24), SIGTERM at step 50, resumed on 3 ranks (batch 8). Every sample once, the optimizer batch constant, the
    parameters those of the uninterrupted run (the suite's measure, floor 1e-9), and the report lists both
    resumes."""
    common = ("--batch-size", 12, "--length", 24 * 60)
    if data == "stream":
        common += ("--stream", 6, "--shuffle-buffer", 64)
    _leg(tmp_path / "straight", 2, *common)
    legs = tmp_path / "legs"
    _leg(legs, 2, *common, "--term-batch", 25)
    _leg_here(legs, *common, "--term-batch", 50, "--resume")
    _leg(legs, 3, *common, "--resume")
    seen = collections.Counter(i for _, i in _ids(legs))
    assert sorted(seen) == list(range(24 * 60)) and set(seen.values()) == {1}, seen.most_common(3)
    pl.seed_everything(0, verbose=False)
    theta0 = parameters_of(resume_child.DropoutRegressor(16, dropout=0.0))
    assert_same_training(theta0, _params(legs), _params(tmp_path / "straight"), floor=1e-9, elementwise=True)
    resumes = json.loads((legs / "gpuopt_report.json").read_text())["resumes"]
    assert [(r["world_size_before"], r["world_size"], r["step"]) for r in resumes] == [(2, 1, 26), (1, 3, 51)]
    assert resumes[0]["policies"]["batch_size"] == "12 -> 24 per rank: the optimizer batch kept"
    assert resumes[1]["policies"]["batch_size"] == "24 -> 8 per rank: the optimizer batch kept"
    assert resumes[1]["policies"]["rng"].startswith("re-derived from (seed, step, rank)")
    assert resumes[1]["policies"]["data"].startswith("exact: epoch 0 past the 1224 sample(s)")


@pytest.mark.slow
def test_keeping_the_per_rank_batch_the_resumed_epoch_is_shorter_and_the_next_one_whole(tmp_path):
    """2 ranks x batch 4 stopped after 6 batches (48 of 64 samples), resumed on 1 rank keeping batch 4, with 2
    loader workers: the resumed epoch runs 4 more batches (10 counted), the next epoch all 16, every sample once in
    each. The workers have drawn every index of the resumed epoch before its first batch is trained (the loader
    was once rebuilt then, and the epoch started over)."""
    _leg(tmp_path, 2, "--epochs", 2, "--term-batch", 5, "--elastic", "keep_per_rank")
    _leg_here(tmp_path, "--epochs", 2, "--elastic", "keep_per_rank", "--workers", 2, "--resume")
    seen = collections.Counter(_ids(tmp_path))
    for epoch in (0, 1):
        assert sorted(i for e, i in seen if e == epoch) == list(range(resume_child.LENGTH))
    assert set(seen.values()) == {1}
    rank0 = (tmp_path / "ids_rank0.txt").read_text().splitlines()
    assert [line.split()[1] for line in rank0 if line.startswith("1 ")] == [str(b) for b in range(16)]
    assert [line.split()[1] for line in rank0 if line.startswith("0 ")][-5:] == ["5", "6", "7", "8", "9"]


@pytest.mark.slow
def test_token_batches_on_another_number_of_ranks_restart_the_epoch_whole(tmp_path):
    """Token batches are formed for a number of ranks: resumed on 1 rank after 3 batches on 2, the epoch starts
    again, and the loader runs all of its batches (Lightning counts the 3 restored ones too): no sample is cut."""
    _leg(tmp_path, 2, "--max-tokens", 24, "--term-batch", 2)
    first = _ids(tmp_path)
    for path in tmp_path.glob("ids_rank*.txt"):
        path.unlink()
    _leg_here(tmp_path, "--max-tokens", 24, "--resume")
    again = _ids(tmp_path)
    assert first and sorted(i for _, i in again) == list(range(resume_child.LENGTH))


def _resumed(
    batch_size: int, world: int, checkpoint_world: int = 2, elastic: str | None = None
) -> resume_child.Data:
    """A datamodule of ``batch_size`` loading the state a 2-rank run of batch_size 12 saved, on ``world`` ranks."""
    data = resume_child.Data(batch_size=batch_size, num_workers=0)
    if elastic is not None:
        data.elastic = elastic
    data.trainer = SimpleNamespace(world_size=world, global_rank=0)
    state = {"epoch": 0, "batches": 3, "batch_size": 12, "samples": 72, "configured_batch_size": 12}
    data.load_state_dict({"train_loader": {**state, "seed": 0, "world_size": checkpoint_world}})
    return data


def test_an_optimizer_batch_that_does_not_divide_by_the_new_ranks_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        _resumed(12, world=5)
    message = str(refused.value)
    assert "\n" not in message
    assert "2 rank(s) x batch_size 12 = 24 sample(s)" in message
    assert "resume on 1, 2, 3, 4, 6, 8, 12, 24 rank(s)" in message and "keep_per_rank" in message


def test_the_policy_and_an_explicit_batch_size_decide_the_per_rank_batch(caplog):
    with caplog.at_level(logging.INFO):
        assert _resumed(12, world=3).batch_size == 8  # the optimizer batch 24 kept
        assert _resumed(12, world=3, elastic="keep_per_rank").batch_size == 12
        given = _resumed(6, world=3)  # the resumed leg's own batch_size wins
    assert (
        given.batch_size == 6 and given.resume_notes["batch_size"] == "12 -> 6 per rank, given for this run"
    )
    said = caplog.text
    assert "batch_size 12 -> 8 per rank, keeping the optimizer batch of 24 sample(s)" in said
    assert "optimizer batch is 36 sample(s) x accumulate_grad_batches (was 24 x it)" in said
    assert "batch_size=6 given for this run is kept: the optimizer batch is 18 sample(s)" in said
    assert _resumed(12, world=2).batch_size == 12  # the same number of ranks: nothing changes


def test_token_batches_keep_the_optimizer_batch_in_tokens(caplog):
    def resumed(max_tokens: int, world: int):
        data = resume_child.Data(max_tokens=max_tokens, num_workers=0)
        data.trainer = SimpleNamespace(world_size=world, global_rank=0)
        state = {
            "epoch": 0,
            "batches": 3,
            "max_tokens": 24,
            "configured_max_tokens": 24,
            "seed": 0,
            "world_size": 2,
        }
        data.load_state_dict({"train_loader": state})
        return data

    with caplog.at_level(logging.INFO):
        assert resumed(24, world=1).max_tokens == 48
        assert resumed(24, world=4).max_tokens == 12
        assert resumed(30, world=1).max_tokens == 30  # given for this leg: kept
    assert "max_tokens 24 -> 48 per rank, keeping the optimizer batch of 48 token(s)" in caplog.text
    with pytest.raises(ValueError, match=r"2 rank\(s\) x max_tokens 24 = 48 token\(s\)"):
        resumed(24, world=5)


class _OwnLoader(pl.LightningModule):
    """A module with a loader of its own (not a GPUOptDataModule): 12 batches of 4."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(48, 2), batch_size=4)


class _TermAt(pl.Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def _own_loader_resumed(root: Path, saved: dict, first_steps: int = -1, **kwargs) -> pl.Trainer:
    """A one-rank run (12 batches an epoch) stopped after an epoch (or ``first_steps``), its checkpoint made to say
    what ``saved`` says (``world_size``, ``accumulate_grad_batches``, ...), resumed for a second epoch; returns the
    resumed Trainer."""
    from lightning_gpuopt import ExactResume

    def trainer(
        epochs: int, accumulate: int = 1, elastic: str = "keep_optimizer_batch", **more
    ) -> pl.Trainer:
        return pl.Trainer(
            max_epochs=epochs,
            accumulate_grad_batches=accumulate,
            callbacks=[ExactResume(elastic=elastic)],
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **more,
        )

    first = trainer(1)
    path = root / "first.ckpt"
    if first_steps > 0:  # stopped as a preemption stops it: SIGTERM, ExactResume writes checkpoints/last.ckpt
        first.callbacks.append(_TermAt(first_steps - 1))
        first.fit(_OwnLoader())
        os.replace(root / "checkpoints" / "last.ckpt", path)
    else:
        first.fit(_OwnLoader())
        first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("ExactResume")]
    checkpoint["callbacks"][key]["rng"] *= saved["world_size"]
    checkpoint["callbacks"][key].update(saved)
    torch.save(checkpoint, path)
    resumed = trainer(2, **kwargs)
    resumed.fit(_OwnLoader(), ckpt_path=path)
    return resumed


def test_with_a_loader_of_its_own_the_optimizer_batch_is_kept_by_accumulation(tmp_path, caplog):
    """A checkpoint of 2 ranks x 1 batch per step resumed on 1 rank: 2 batches per step (6 steps in the epoch of 12
    batches, as on 2 ranks); an accumulate_grad_batches given for the leg wins; keep_per_rank keeps 1. A checkpoint
    of a leg whose accumulation a resume had changed (2 ranks x 2, configured 1: first written by 4 ranks) resumed
    with the configuration's 1: 4 batches per step, not "given". Resumed after 5 of the epoch's 12 batches, the
    first step's partial accumulation is said."""
    two = {"world_size": 2, "accumulate_grad_batches": 1, "configured_accumulate_grad_batches": 1}
    with caplog.at_level(logging.INFO):
        kept = _own_loader_resumed(tmp_path, two)
    assert kept.accumulate_grad_batches == 2 and kept.global_step == 12 + 6
    assert (
        "accumulate_grad_batches 1 -> 2 per rank, keeping the optimizer batch of 2 batch(es) x the loader's"
        in caplog.text
    )
    given = _own_loader_resumed(tmp_path, two, accumulate=3)
    assert given.accumulate_grad_batches == 3 and given.global_step == 12 + 4
    assert _own_loader_resumed(tmp_path, two, elastic="keep_per_rank").global_step == 12 + 12
    third_leg = {**two, "accumulate_grad_batches": 2}
    assert _own_loader_resumed(tmp_path, third_leg).accumulate_grad_batches == 4
    caplog.clear()
    with caplog.at_level(logging.INFO):
        mid_epoch = _own_loader_resumed(tmp_path, two, first_steps=5)
    assert mid_epoch.global_step == 5 + 4 + 6  # steps at batches 6, 8, 10, 12: the first of one batch; then 6
    assert "the first optimizer step after this resume accumulates 1 batch(es), not 2" in caplog.text


def test_with_a_loader_of_its_own_an_optimizer_batch_that_does_not_divide_is_refused_and_a_scheduler_keeps_its_own(
    caplog,
):
    """3 ranks x 1 batch per step resumed on 2 (one process cannot have 2 ranks: ExactResume's rule, called with
    them): refused in one line. With GradientAccumulationScheduler, which sets the accumulation, one line says so."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_gpuopt import ExactResume

    def trainer(*callbacks):
        strategy = SimpleNamespace(handles_gradient_accumulation=False)
        return SimpleNamespace(
            world_size=2, accumulate_grad_batches=1, callbacks=list(callbacks), strategy=strategy
        )

    saved = {"accumulate_grad_batches": 1, "configured_accumulate_grad_batches": 1}
    with pytest.raises(ValueError) as refused:
        ExactResume()._keep_optimizer_batch(trainer(), 3, saved)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        "ExactResume: the checkpoint's optimizer batch, 3 rank(s) x"
    )
    assert "resume on 1, 3 rank(s), set accumulate_grad_batches for this run, or pass" in message
    scheduled = trainer(GradientAccumulationScheduler({0: 2}))
    with caplog.at_level(logging.INFO):
        ExactResume()._keep_optimizer_batch(scheduled, 4, saved)
    assert scheduled.accumulate_grad_batches == 1
    assert (
        "GradientAccumulationScheduler sets the accumulation, so the optimizer batch is not kept"
        in caplog.text
    )
    assert "scale its scheduling by 4/2 to keep it" in caplog.text


@pytest.mark.parametrize(
    ("strategy", "said"),
    [
        ("ddp", "the checkpoint's (every rank held the same)"),
        ("fsdp2", "resharded over 1 rank(s) by torch.distributed.checkpoint"),
        ("fsdp2-full", "the checkpoint's whole state, sharded over 1 rank(s) as it loads"),
    ],
)
def test_the_report_says_how_the_model_state_is_resumed_by_the_strategy_and_its_checkpoint(strategy, said):
    from lightning_gpuopt import FSDP2Strategy
    from lightning_gpuopt.callbacks.report import _standing_policies

    chosen = {
        "ddp": "ddp",
        "fsdp2": FSDP2Strategy(),
        "fsdp2-full": FSDP2Strategy(save_distributed_checkpoint=False),
    }
    trainer = pl.Trainer(strategy=chosen[strategy], accelerator="cpu", devices=1, logger=False)
    assert _standing_policies(trainer)["model and optimizer"] == said
