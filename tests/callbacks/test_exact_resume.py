"""Fault injection: a training subprocess is killed (SIGKILL) or signalled (SIGTERM), resumed from its last
checkpoint, and compared with the run that was never interrupted (tests/resume_child.py)."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt import ExactResume, GPUOptDataModule
from lightning_gpuopt.callbacks.exact_resume import StepBoundaryCheckpoint, at_optimizer_step_boundary
from tests import resume_child
from tests.helpers import (
    TRAINER_QUIET,
    IndexedData40,
    IndexedRegression,
    MetricsLogger,
    RecordingRegressor,
    assert_same_training,
    parameters_of,
)

CHILD = Path(resume_child.__file__)

BATCHES = resume_child.LENGTH // resume_child.BATCH  # per epoch, one process


def _run(root: Path, *args: str, expect: int = 0, subprocess_: bool = True) -> None:
    """One training run of resume_child.py: a subprocess (to be killed, or DDP), or in this process (cheaper)."""
    root.mkdir(parents=True, exist_ok=True)
    if not subprocess_:
        resume_child.main([str(root), *args])
        return
    done = subprocess.run(
        [sys.executable, str(CHILD), str(root), *args], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert done.returncode == expect, done.stdout[-3000:] + done.stderr[-3000:]


def _ids(path: Path) -> dict[tuple[int, int], list[int]]:
    """``(epoch, batch_idx) -> sample ids`` of each training batch a rank ran."""
    lines = path.read_text().split()
    return {
        (int(e), int(b)): [int(i) for i in ids.split(",")]
        for e, b, ids in zip(lines[::3], lines[1::3], lines[2::3])
    }


def _theta0(hidden: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    return parameters_of(resume_child.DropoutRegressor(hidden))


def _params(root: Path) -> dict[str, torch.Tensor]:
    return {n: p.to(torch.float64) for n, p in torch.load(root / "params.pt").items()}


def _interrupted_runs(
    tmp_path: Path,
    args: tuple[str, ...],
    faults: list[tuple[str, ...]],
    ranks: int = 1,
    in_process: bool = True,
) -> Path:
    """The uninterrupted run, then the same run interrupted by each fault in turn and resumed from ``last``.

    Checks that, on every rank, the batches kept by each interrupted run (those before the next run's first
    batch) and the last run's batches are the uninterrupted run's, that every sample is seen once, and that
    the parameters are equal. Returns the interrupted run's folder.
    """
    ref, run = tmp_path / "ref", tmp_path / "run"
    _run(ref, *args, subprocess_=not in_process)
    logs = []
    for n, fault in enumerate([*faults, ()]):
        resume = ("--resume",) if n else ()
        killed = "--kill-batch" in fault
        _run(run, *args, *fault, *resume, expect=-9 if killed else 0, subprocess_=killed or not in_process)
        for rank in range(ranks):  # keep each run's logs apart
            (run / f"ids_rank{rank}.txt").rename(run / f"run{n}_rank{rank}.txt")
            if (run / f"decisions_rank{rank}.json").exists():
                (run / f"decisions_rank{rank}.json").rename(run / f"run{n}_decisions_rank{rank}.json")
        logs.append(n)
    seen = []
    for rank in range(ranks):
        merged: list[list[int]] = []
        runs = [_ids(run / f"run{n}_rank{rank}.txt") for n in logs]
        for this, following in zip(runs, [*runs[1:], None]):
            cut = min(following) if following else (1 << 30, 0)
            merged += [this[k] for k in sorted(this) if k < cut]
        reference = [ids for _, ids in sorted(_ids(ref / f"ids_rank{rank}.txt").items())]
        assert merged == reference, (
            f"rank {rank}: the resumed run's samples differ from the uninterrupted run's"
        )
        seen += [i for ids in merged for i in ids]
    assert collections.Counter(seen) == collections.Counter(range(resume_child.LENGTH))  # each sample once
    # 64-true: the floor (k = 2, exact weighting) of this case is 0; equal to rounding, elementwise.
    hidden = int(args[args.index("--hidden") + 1]) if "--hidden" in args else 32
    assert_same_training(_theta0(hidden), _params(run), _params(ref), floor=0.0, elementwise=True)
    return run


@pytest.mark.slow
def test_sigkill_inside_an_accumulation_window_resumes_exactly(tmp_path):
    # A seeded random batch that opens a window (even batch_idx with A = 2): its gradients die with the
    # process and the resume starts from the optimizer-step boundary before it.
    kill = 2 * random.Random(17).randrange(1, BATCHES // 2 - 1)
    _interrupted_runs(tmp_path, ("--accumulate", "2", "--workers", "2"), [("--kill-batch", str(kill))])


def test_at_optimizer_step_boundary():
    assert [at_optimizer_step_boundary(i, 3, is_last_batch=i == 6) for i in range(7)] == [
        False,
        False,
        True,
        False,
        False,
        True,
        True,
    ]


def test_signal_names_are_checked():
    with pytest.raises(ValueError, match="SIGTERM"):
        ExactResume(signals=("SIGNOPE",))
    assert json.dumps(ExactResume(signals=()).signals) == "[]"


@pytest.mark.slow
def test_sigkill_right_after_an_oom_recovery_changed_k_resumes_exactly(tmp_path):
    # Measure forward-and-backward memory once, then limit it from batch 1 on so that k goes 1 -> 2 there.
    shape = ("--hidden", "512", "--batch-size", "16")
    _run(tmp_path / "measure", *shape, "--oom-limit", "0", subprocess_=False)
    peak = int((tmp_path / "measure" / "peak.txt").read_text())
    static = 4 * sum(
        p.numel() * 8 for p in resume_child.DropoutRegressor(512).parameters()
    )  # θ, grads, AdamW
    args = (*shape, "--oom-limit", str(int(static + 0.7 * (peak - static))), "--oom-from", "1")
    run = _interrupted_runs(tmp_path, args, [("--kill-batch", "2")])
    reference = json.loads((tmp_path / "ref" / "decisions_rank0.json").read_text())
    assert [(d["step"], d["kind"]) for d in reference] == [
        (1, "oom"),
        (1, "micro-batches"),
        (1, "loss weighting"),
    ]
    # The resumed run starts at step 2 with k = 2 from the checkpoint: no new OOM, search, precision switch
    # or loss-weighting check (the weighting is restored with the rest).
    resumed = json.loads((run / "run1_decisions_rank0.json").read_text())
    kinds = ("oom", "micro-batches", "batch size", "precision", "loss weighting")
    changes = [d for d in resumed if d["kind"] in kinds]
    k = next(d for d in reference if d["kind"] == "micro-batches")["data"]["k_after"]
    assert [d["message"] for d in changes] == [f"restored from checkpoint: k 1 -> {k}"]


def test_sigterm_stops_at_the_next_optimizer_step_boundary_and_resumes_exactly(tmp_path):
    # SIGTERM arrives at the start of batch 3, inside the window of batches 2-3 (A = 2): the stop waits for
    # that window's optimizer step, writes last.ckpt there, and fit returns normally.
    args = ("--accumulate", "2")
    run = _interrupted_runs(tmp_path, args, [("--term-batch", "2")])
    stopped = json.loads((run / "run0_decisions_rank0.json").read_text())
    assert [(d["step"], d["kind"], d["data"]["signal"]) for d in stopped] == [(2, "stop", "SIGTERM")]


@pytest.mark.slow
def test_ddp_sigterm_to_rank_1_then_to_every_rank_then_sigkill_resumes_exactly(tmp_path):
    # Two CPU ranks over gloo, dropout on each, a OneCycle schedule reading `estimated_stepping_batches`: rank 1 alone gets SIGTERM at batch 1 (every rank must stop at
    # the same step, no hang, exit 0), the resumed run gets SIGTERM on every rank at batch 3, the next one is
    # SIGKILLed at a seeded random batch; the last resume runs to the end. Each rank's shard is seen once.
    kill = random.Random(17).randrange(4, BATCHES // 2 - 1)
    faults = [
        ("--term-batch", "1", "--term-ranks", "1"),
        ("--term-batch", "3", "--term-ranks", "all"),
        ("--kill-batch", str(kill)),
    ]
    run = _interrupted_runs(tmp_path, ("--devices", "2", "--onecycle"), faults, ranks=2, in_process=False)
    for n, (step, signal_) in enumerate([(2, "SIGTERM"), (4, "SIGTERM")]):
        for rank in range(2):
            stops = json.loads((run / f"run{n}_decisions_rank{rank}.json").read_text())
            expected = signal_ if rank == 1 or n == 1 else "another rank's signal"
            assert [(d["step"], d["kind"], d["data"]["signal"]) for d in stops] == [(step, "stop", expected)]


class _Crash(Exception):
    pass


class _CrashAt(pl.Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.batch:
            raise _Crash


def _small_fit(root: Path, callbacks, ckpt_path=None, accumulate: int = 1):
    pl.seed_everything(0, verbose=False)
    model = RecordingRegressor()
    quiet = {**TRAINER_QUIET, "enable_checkpointing": True}
    trainer = pl.Trainer(
        max_epochs=1, accumulate_grad_batches=accumulate, callbacks=callbacks, default_root_dir=root, **quiet
    )
    trainer.fit(model, IndexedData40(batch_size=4, num_workers=0), ckpt_path=ckpt_path)
    return model, trainer


def test_a_checkpoint_written_after_an_exception_is_never_resumed_from(tmp_path):
    boundary = StepBoundaryCheckpoint(
        dirpath=tmp_path / "ours", every_n_train_steps=1, save_top_k=0, save_last=True
    )
    theirs = ModelCheckpoint(
        dirpath=tmp_path / "theirs", save_on_exception=True, save_top_k=0, save_last=True
    )
    with pytest.raises(_Crash):
        _small_fit(tmp_path, [ExactResume(), boundary, theirs, _CrashAt(4)])
    ours = torch.load(tmp_path / "ours" / "last.ckpt", weights_only=False)
    assert (
        ours["global_step"] == 4
    )  # the boundary checkpoint before the crash; nothing written on the exception
    with pytest.raises(ValueError, match="written mid-step"):
        _small_fit(tmp_path, [ExactResume()], ckpt_path=tmp_path / "theirs" / "last.ckpt")
    model, _ = _small_fit(tmp_path, [ExactResume()], ckpt_path=tmp_path / "ours" / "last.ckpt")
    assert len(model.train_ids) == 10 - 4  # the 6 batches after step 4 (batch 4 died with the crash)


def test_the_report_of_a_resumed_run_covers_the_whole_run_and_marks_the_resume(tmp_path):
    from lightning_gpuopt import GPUOptReport

    boundary = StepBoundaryCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=0, save_last=True
    )
    first = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False)
    with pytest.raises(_Crash):
        _small_fit(tmp_path, [ExactResume(), first, boundary, _CrashAt(5)])
    report = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False)
    _small_fit(tmp_path, [ExactResume(), report], ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert [s["step"] for s in report.report["steps"]] == list(range(10))
    assert report.report["resumes"] == [
        {
            "step": 5,
            "steps_before": 5,
            "world_size_before": 1,
            "world_size": 1,
            "k": 1,
            "policies": {
                "model and optimizer": "the checkpoint's (every rank held the same)",
                "rng": "restored, each rank's",
                "data": "exact: epoch 0 past the 20 sample(s) of its order consumed on 1 rank(s), dealt over 1",
            },
        }
    ]
    assert [(d["step"], d["kind"]) for d in report.report["decisions"]] == [(5, "resume")]


def test_sigkill_in_the_middle_of_a_batch_size_change_resumes_exactly(tmp_path):
    # AdaptiveBatchSize grows the batch 8 -> 16 at step 2 and 16 -> 32 at step 3 (accumulation 2 -> 4 -> 8); the
    # kill falls inside the first window of the new accumulation (batches 8..15), after the checkpoint holding it.
    run = _interrupted_runs(tmp_path, ("--adaptive", "--accumulate", "2"), [("--kill-batch", "10")])
    straight = json.loads((tmp_path / "ref" / "decisions_rank0.json").read_text())
    assert [d["data"]["after"] for d in straight if d["kind"] == "batch size"] == [16, 32]
    resumed = json.loads((run / "run1_decisions_rank0.json").read_text())
    assert not [
        d for d in resumed if d["kind"] == "batch size"
    ]  # resumed with the change made, not made again


# --- A stop is quick: no validation of its own; one that was due at the stop runs first in the resumed leg.


class _ValData(GPUOptDataModule):
    def __init__(self, val_size: int = 12, **kwargs) -> None:
        super().__init__(**kwargs)
        self.val_size = val_size

    def train_dataset(self):
        return IndexedRegression(40)

    def val_dataset(self):
        return IndexedRegression(self.val_size, seed=1)


class _ValidatedRegressor(RecordingRegressor):
    """RecordingRegressor with dropout (the random state matters) that logs its validation loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net.insert(2, torch.nn.Dropout(0.2))

    def training_step(self, batch, batch_idx):
        self.log("train_loss", loss := super().training_step(batch, batch_idx))
        return loss


def _validated_fit(root: Path, term: int | None, resume: bool, accumulate: int, val_every: int | None):
    pl.seed_everything(0, verbose=False)
    model, logger = _ValidatedRegressor(), MetricsLogger()
    checkpoint = StepBoundaryCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=0, save_last=True)
    quiet = {**TRAINER_QUIET, "logger": logger, "enable_checkpointing": True}
    trainer = pl.Trainer(
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        val_check_interval=val_every,
        log_every_n_steps=1,
        callbacks=[ExactResume(), resume_child.Fault(term_batch=term), checkpoint],
        **quiet,
    )
    trainer.fit(model, _ValData(batch_size=4, num_workers=0), ckpt_path="last" if resume else None)
    rows = [(step, m["epoch"], m["val_loss"]) for step, m in logger.rows if "val_loss" in m]
    return rows, model.val_ids, parameters_of(model)


_REFERENCES: dict[tuple[int, int | None], tuple] = {}


@pytest.mark.parametrize(
    ("term", "accumulate", "val_every"),
    [(3, 1, None), (9, 1, None), (19, 1, None), (4, 1, 5), (4, 2, 6)],
    ids=["none-due", "due-at-epoch-end", "due-at-the-runs-end", "due-mid-epoch", "due-after-a-window"],
)
def test_a_signal_stop_adds_no_validation_and_the_resumed_run_validates_as_the_uninterrupted_one(
    tmp_path, term, accumulate, val_every
):
    # 40 samples, batch 4: 10 batches an epoch, 2 epochs; validation each epoch, or every `val_every` batches.
    # SIGTERM at the start of batch `term`: the stop comes at that window's end (A = 2: batch 5).
    key = (accumulate, val_every)
    if key not in _REFERENCES:
        _REFERENCES[key] = _validated_fit(tmp_path / "ref", None, False, accumulate, val_every)
    ref_rows, ref_ids, ref_theta = _REFERENCES[key]
    stopped_rows, stopped_ids, _ = _validated_fit(tmp_path / "run", term, False, accumulate, val_every)
    assert stopped_ids == [ids for ids in ref_ids[: len(stopped_ids)]]  # no validation batch of its own
    assert stopped_rows == ref_rows[: len(stopped_rows)]
    resumed_rows, _, theta = _validated_fit(tmp_path / "run", None, True, accumulate, val_every)
    assert stopped_rows + resumed_rows == ref_rows  # none missing, none extra, the same values
    assert all(torch.equal(theta[name], ref_theta[name]) for name in ref_theta)


def test_a_signal_stop_returns_within_2_s_of_its_checkpoint_with_a_60k_sample_validation_set(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gpuopt import GPUOptReport

    pl.seed_everything(0, verbose=False)
    model = _ValidatedRegressor()
    checkpoint = StepBoundaryCheckpoint(dirpath=tmp_path, save_top_k=0, save_last=True)
    report = GPUOptReport(dirpath=str(tmp_path))  # its defaults: on a signal stop the JSON only
    quiet = {**TRAINER_QUIET, "logger": CSVLogger(tmp_path), "enable_checkpointing": True}
    trainer = pl.Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[ExactResume(), resume_child.Fault(term_batch=3), checkpoint, report],
        **quiet,
    )
    trainer.fit(model, _ValData(val_size=60_000, batch_size=4, num_workers=0))
    returned = time.time()
    written = os.stat(tmp_path / "last.ckpt").st_mtime
    assert model.val_ids == []  # the stop's validation (15,000 batches here) is skipped
    assert (tmp_path / "gpuopt_report.json").stat().st_mtime >= written
    assert not (tmp_path / "gpuopt_report.png").exists()  # drawn by the next leg, or `gpuopt report`
    assert returned - written <= 2.0, f"fit returned {returned - written:.2f} s after the stop's checkpoint"
