"""The rules `gpuopt fit` resumes by, one at a time, without a fit: when a run is finished, how a run is named,
how a refusal lists what differs, what a checkpoint the safe load cannot read gets. The fits that use them are
in test_cli_resume.py and test_cli_same_command.py."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint, Timer

from lightning_gpuopt._cli_resume import (
    FINGERPRINT_KEY,
    ResumeRefused,
    _finished,
    declared_defaults,
    fingerprint_differences,
    last_checkpoint,
    plan_resume,
    run_identity,
)


def _trainer(max_steps: int = -1, max_epochs: int | None = None, callbacks=()) -> SimpleNamespace:
    """What plan_resume reads of a Trainer (Lightning's own would have set max_epochs already)."""
    return SimpleNamespace(
        max_steps=max_steps, max_epochs=max_epochs, callbacks=list(callbacks), is_global_zero=True
    )


def _at(step: int, epochs: int = 0) -> dict:
    return {
        "global_step": step,
        "epoch": epochs,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": epochs}}}},
    }


@pytest.mark.parametrize(
    ("max_steps", "step", "finished"),
    [(0, 0, True), (5, 4, False), (5, 5, True), (5, 6, True), (-1, 10**6, False)],
)
def test_max_steps_finishes_a_run_at_that_step_and_minus_one_never(max_steps, step, finished):
    why = _finished(_at(step), _trainer(max_steps=max_steps, max_epochs=-1))
    assert (why == f"max_steps={max_steps} reached") if finished else why is None


@pytest.mark.parametrize(
    ("max_steps", "timed", "epochs", "finished"),
    [
        (-1, False, 999, None),
        (-1, False, 1000, "max_epochs=1000 reached"),  # Lightning's default without any limit
        (-1, True, 5000, None),  # a Timer: no epoch limit
        (50, False, 5000, None),  # max_steps set: no epoch limit
    ],
)
def test_without_max_epochs_lightnings_own_default_applies(max_steps, timed, epochs, finished):
    callbacks = [Timer(duration="00:01:00:00")] if timed else []
    assert _finished(_at(10, epochs), _trainer(max_steps=max_steps, callbacks=callbacks)) == finished


def test_a_run_is_named_run_and_eight_hex_digits():
    names = {run_identity({"model": "m.A", "seed": seed}) for seed in range(50)}
    assert len(names) == 50 and all(re.fullmatch(r"run-[0-9a-f]{8}", name) for name in names)


def _fingerprint(**changes) -> dict:
    base = {"format": 1, "model": "m.A", "data": "d.D", "parameters": [], "seed": 0, "model_args": {}}
    return {**base, **changes}


@pytest.mark.parametrize(("changed", "listed", "more"), [(3, 3, ""), (4, 3, "; 1 more"), (5, 3, "; 2 more")])
def test_a_refusal_lists_three_differences_and_counts_the_rest(tmp_path, changed, listed, more):
    fields = {"model": "m.B", "data": "d.E", "seed": 1, "model_args": {"lr": 0.2}, "data_args": {"size": 2}}
    saved = _fingerprint(model_args={"lr": 0.1}, data_args={"size": 1})
    current = {**saved, **dict(list(fields.items())[:changed])}
    path = tmp_path / "last.ckpt"
    torch.save({**_at(4), FINGERPRINT_KEY: saved}, path)
    with pytest.raises(ResumeRefused) as refused:
        plan_resume(_trainer(max_steps=10), str(path), current)
    what = re.search(r"another run's checkpoint \((.*)\):", str(refused.value)).group(1)
    assert what.count(";") == listed - 1 + bool(more) and what.endswith(more or what[-1:])


def test_an_unfinished_checkpoint_without_an_epoch_resumes_at_epoch_0(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 4, FINGERPRINT_KEY: _fingerprint()}, path)
    plan = plan_resume(_trainer(max_steps=10), str(path), _fingerprint())
    assert plan.path == str(path) and "at step 4, epoch 0," in plan.message


class Opaque:
    """An object torch's safe load refuses (not on its allow-list)."""


def test_a_checkpoint_the_safe_load_cannot_read_is_left_to_lightning_unopened(tmp_path):
    """Lightning loads with weights_only=True (torch's default): so does the check, and a checkpoint it cannot read
    safely is neither opened unsafely nor refused; Lightning's own load says what is wrong with it."""
    path = tmp_path / "last.ckpt"
    torch.save({**_at(4), FINGERPRINT_KEY: _fingerprint(model="m.Other"), "extra": Opaque()}, path)
    plan = plan_resume(_trainer(max_steps=10), str(path), _fingerprint())
    assert plan.path == str(path) and plan.message is None and not plan.finished
    with pytest.raises(ResumeRefused):  # read unsafely, as asked: another run's
        plan_resume(_trainer(max_steps=10), str(path), _fingerprint(), weights_only=False)


def test_paths_lightning_names_itself_are_passed_on(tmp_path):
    for name in ("best", "hpc", "registry", "registry:model:v1", str(Path(tmp_path) / "missing.ckpt")):
        assert plan_resume(_trainer(), name, _fingerprint()).path == name


def test_a_checkpoint_without_lightnings_counters_resumes_at_zero_and_is_not_finished(tmp_path):
    """A checkpoint that lacks the step, the epoch and the loops' counters (a hand-made or stripped one) counts as
    step 0, epoch 0, nothing seen: it is not taken for a finished run even at limits of one step or one epoch."""
    path = tmp_path / "last.ckpt"
    torch.save({FINGERPRINT_KEY: _fingerprint()}, path)
    plan = plan_resume(_trainer(max_steps=1, max_epochs=1), str(path), _fingerprint())
    assert not plan.finished
    assert (
        plan.message
        == f"gpuopt fit: resuming from {path} at step 0, epoch 0, 0 batches of the epoch already seen."
    )


def test_max_epochs_0_finishes_a_run_at_once():
    assert _finished(_at(0, 0), _trainer(max_epochs=0)) == "max_epochs=0 reached"
    assert _finished(_at(0, 0), _trainer(max_epochs=1)) is None


@pytest.mark.parametrize(
    ("state", "why"),
    [
        (
            {"stopping_reason": 1, "stopping_reason_message": "val_loss did not improve"},
            "val_loss did not improve",
        ),
        ({"stopping_reason": 1}, "its monitored metric stopped improving"),
    ],
)
def test_a_run_early_stopping_ended_says_why(state, why):
    checkpoint = {**_at(3, 1), "callbacks": {"EarlyStopping{'monitor': 'val_loss'}": state}}
    assert _finished(checkpoint, _trainer(max_epochs=10)) == f"EarlyStopping stopped it: {why}"


class _Data:
    """A datamodule whose checkpoint state holds the loader's position (as GPUOptDataModule's does)."""


@pytest.mark.parametrize(
    ("loader", "epoch", "seen"),
    [
        ({"batches": 3, "batch_size": 4}, 1, "12 samples"),  # no epoch or world size: this epoch, one rank
        ({"batches": 3, "batch_size": 4, "world_size": 2, "epoch": 1}, 1, "24 samples"),
        ({"batches": 3, "batch_size": 4, "epoch": 0}, 1, "0 samples"),  # a position from an earlier epoch
        ({"batches": 2, "batch_size": 4, "epoch": 0}, None, "8 samples"),  # no epoch saved: epoch 0
        (
            {"batches": 3, "max_tokens": 4096, "world_size": 2, "epoch": 1},
            1,
            "6 batches",
        ),  # batches by tokens
        ({"batches": 3, "max_tokens": 4096, "epoch": 0}, 1, "0 batches"),
        ({"epoch": 1}, 1, "5 batches"),  # no position: Lightning's own batch count
        (None, 1, "5 batches"),
    ],
)
def test_the_resume_line_counts_what_the_epoch_has_seen(tmp_path, loader, epoch, seen):
    path = tmp_path / "last.ckpt"
    progress = {"epoch_loop.batch_progress": {"current": {"completed": 5}}}
    checkpoint = {"global_step": 9, FINGERPRINT_KEY: _fingerprint(), "loops": {"fit_loop": progress}}
    if loader is not None:
        checkpoint[_Data.__qualname__] = {"train_loader": loader}
    if epoch is not None:
        checkpoint["epoch"] = epoch
    torch.save(checkpoint, path)
    plan = plan_resume(_trainer(max_steps=100), str(path), _fingerprint(), datamodule=_Data())
    assert plan.message.endswith(f", {seen} of the epoch already seen.")


def test_a_sharded_checkpoint_folder_is_read_from_its_metadata_file(tmp_path):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save({**_at(7, 1), FINGERPRINT_KEY: _fingerprint()}, folder / "meta.pt")
    plan = plan_resume(_trainer(max_steps=100), str(folder), _fingerprint())
    assert "at step 7, epoch 1," in plan.message
    with pytest.raises(ResumeRefused):
        plan_resume(_trainer(max_steps=100), str(folder), _fingerprint(model="m.Other"))


def test_last_is_the_newest_last_file_and_never_another_checkpoint(tmp_path):
    fingerprint = _fingerprint()
    files = {
        "last.ckpt": 100,
        "last-v1.ckpt": 300,
        "last-v2.ckpt": 200,
        "epoch=1-step=9.ckpt": 400,
        "last.txt": 500,
    }
    for name, when in files.items():
        torch.save({**_at(when), FINGERPRINT_KEY: fingerprint}, tmp_path / name)
        os.utime(tmp_path / name, (when, when))
    trainer = _trainer(max_steps=10**6, callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    assert last_checkpoint(trainer) == str(tmp_path / "last-v1.ckpt")
    assert "at step 300," in plan_resume(trainer, "last", fingerprint).message


def test_a_last_checkpoint_on_a_remote_filesystem_is_read_through_it():
    """OnExceptionCheckpoint's file is a candidate for "last" wherever it is (as in Lightning): one on an fsspec
    filesystem is read through that filesystem."""
    folder = f"memory://gpuopt-rules-{os.getpid()}"
    fs = fsspec.filesystem("memory")
    with fs.open(f"{folder}/on_exception.ckpt", "wb") as f:
        torch.save({**_at(4), FINGERPRINT_KEY: _fingerprint()}, f)
    try:
        trainer = _trainer(max_steps=10, callbacks=[OnExceptionCheckpoint(dirpath=folder)])
        plan = plan_resume(trainer, "last", _fingerprint())
        assert plan.path == f"{folder}/on_exception.ckpt" and "at step 4, epoch 0," in plan.message
    finally:
        fs.rm(folder, recursive=True)


def test_the_identity_does_not_depend_on_the_order_of_the_config():
    a = {"model": "m.A", "model_args": {"lr": 0.1, "width": 8}, "seed": 1}
    b = {"seed": 1, "model_args": {"width": 8, "lr": 0.1}, "model": "m.A"}
    assert run_identity(a) == run_identity(b)


def test_declared_defaults_are_the_arguments_that_have_one():
    class Model:
        def __init__(self, width, depth=2, act="relu"):
            pass

    assert declared_defaults(Model) == {"depth": 2, "act": "relu"}


@pytest.mark.parametrize("length", [1, 38, 39, 80])
def test_a_long_value_in_a_refusal_is_cut_to_40_characters_with_an_ellipsis(length):
    value = "x" * length  # its repr has two quotes more
    (line,) = fingerprint_differences(
        _fingerprint(model_args={"p": value}), _fingerprint(model_args={"p": 1})
    )
    shown = line.removeprefix("model.p ").removesuffix(" -> 1")
    assert (
        shown == repr(value) if length + 2 <= 40 else (len(shown) == 40 and shown == repr(value)[:37] + "...")
    )
