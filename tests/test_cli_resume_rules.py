"""The rules `gpuopt fit` resumes by, one at a time, without a fit: when a run is finished, how a run is named,
how a refusal lists what differs, what a checkpoint the safe load cannot read gets. The fits that use them are
in test_cli_resume.py and test_cli_same_command.py."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Timer

from lightning_gpuopt._cli_resume import FINGERPRINT_KEY, ResumeRefused, _finished, plan_resume, run_identity


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
