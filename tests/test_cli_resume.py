"""`gpuopt fit` resumes only its own run (docs/resume.md, "Which checkpoint `gpuopt fit` resumes"):
another run's checkpoint in the same folder is refused in one line, before anything is loaded or written;
a finished run has nothing to do; a longer run continues; a SIGTERM stop resumes with one line.

Runs whose output and exit status are what a user sees (the refusal, the SIGTERM stop) are subprocesses,
each with a timeout that kills its whole process group; the others call `main` in this process.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lightning_gpuopt import GPUOptWarning
from lightning_gpuopt._cli_resume import FINGERPRINT_KEY, fingerprint_differences, run_fingerprint
from lightning_gpuopt.cli import main
from tests.helpers import IndexedData40, RecordingRegressor, subprocess_env

pytestmark = pytest.mark.usefixtures("cli_argv")

QUIET = (
    "--seed_everything 1 --trainer.logger false --trainer.enable_progress_bar false "
    "--trainer.enable_model_summary false"
).split()
# Model A: a small regressor on 40 samples, batch 4 (10 steps an epoch); no loader workers.
MODEL_A = ["--model", "tests.helpers.RecordingRegressor", "--data", "tests.helpers.IndexedData40"]
DATA_A = ["--data.batch_size", "4", "--data.num_workers", "0"]
# Model B: Lightning's demo model and data, nothing in common with A.
MODEL_B = [
    "--model",
    "lightning.pytorch.demos.boring_classes.DemoModel",
    "--data",
    "lightning.pytorch.demos.boring_classes.BoringDataModule",
]


def _args(root: Path, *extra: str) -> list[str]:
    return ["fit", *QUIET, "--trainer.default_root_dir", str(root), *extra]


def _files(root: Path) -> dict[str, bytes]:
    """The run's record: config, report and checkpoint, byte for byte."""
    names = ("config.yaml", "gpuopt_report.json", "checkpoints/last.ckpt")
    return {name: (root / name).read_bytes() for name in names}


def _gpuopt(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m lightning_gpuopt ARGS` in its own session; on a timeout its whole process group is killed."""
    command = [sys.executable, "-m", "lightning_gpuopt", *args]
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture
def run_a(tmp_path: Path) -> Path:
    """Model A trained to its max_steps=3 in tmp_path/a (finished)."""
    root = tmp_path / "a"
    main(_args(root, *MODEL_A, *DATA_A, "--trainer.max_steps", "3"))
    assert (root / "checkpoints" / "last.ckpt").is_file() and (root / "gpuopt_report.json").is_file()
    return root


def test_an_unrelated_run_in_the_same_folder_is_refused_in_one_line_and_touches_nothing(run_a, tmp_path):
    before = _files(run_a)
    done = _gpuopt(_args(run_a, *MODEL_B, "--trainer.max_steps", "3"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    # one line of the pack's (Lightning's banner lines come from building the Trainer: docs/cli.md)
    (line,) = [line for line in _lines(done.stdout + done.stderr) if line.startswith("gpuopt")]
    assert line.startswith(f"gpuopt fit: {run_a / 'checkpoints' / 'last.ckpt'} is another run's checkpoint (")
    assert (
        "model class tests.helpers.RecordingRegressor -> lightning.pytorch.demos.boring_classes.DemoModel"
        in line
    )
    assert "--ckpt_path null" in line and "--trainer.default_root_dir" in line
    assert "Traceback" not in done.stdout + done.stderr
    assert _files(run_a) == before


def test_a_run_whose_parameters_fit_but_differ_is_refused_too(run_a, capsys):
    with pytest.raises(SystemExit) as info:
        main(_args(run_a, *MODEL_A, *DATA_A, "--model.hidden", "32", "--trainer.max_steps", "6"))
    assert info.value.code == 2
    (line,) = _lines(capsys.readouterr().err)
    assert "parameters (4 tensors -> 4; first: 'net.0.weight' [16, 8] float32 -> [32, 8] float32)" in line
    assert "model.hidden 16 -> 32" in line


def test_a_finished_run_restarted_has_nothing_to_do_and_leaves_its_record(run_a, caplog):
    before = _files(run_a)
    with caplog.at_level(logging.INFO):
        main(_args(run_a, *MODEL_A, *DATA_A, "--trainer.max_steps", "3"))  # returns: exit status 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpuopt fit:")]
    assert said == [
        f"gpuopt fit: {run_a / 'checkpoints' / 'last.ckpt'} finished at step 3 (max_steps=3 reached): nothing to "
        "do. To train on, raise --trainer.max_steps or --trainer.max_epochs; to start afresh, --ckpt_path null."
    ]
    assert _files(run_a) == before


def test_a_finished_run_with_a_larger_max_steps_continues(run_a, caplog):
    with caplog.at_level(logging.INFO):
        main(_args(run_a, *MODEL_A, *DATA_A, "--data.num_workers", "2", "--trainer.max_steps", "5"))
    (line,) = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    # Lightning ends the epoch at a max_steps stop and counts it done: the run goes on with epoch 1
    path = run_a / "checkpoints" / "last.ckpt"
    assert (
        line == f"gpuopt fit: resuming from {path} at step 3, epoch 1, 0 samples of the epoch already seen."
    )
    checkpoint = torch.load(run_a / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    assert checkpoint["global_step"] == 5
    # the worker count is not part of the run (num_workers 0 -> 2): the run is the same
    assert checkpoint[FINGERPRINT_KEY]["data_args"]["batch_size"] == 4


def test_ckpt_path_null_starts_afresh_in_the_same_folder(run_a, caplog):
    with caplog.at_level(logging.INFO):
        main(_args(run_a, *MODEL_B, "--trainer.max_steps", "2", "--ckpt_path", "null"))
    assert not [r for r in caplog.records if r.getMessage().startswith("gpuopt fit:")]  # nothing to say
    # Lightning keeps A's last.ckpt and versions B's: the newest last*.ckpt is B's from now on
    checkpoint = torch.load(run_a / "checkpoints" / "last-v1.ckpt", weights_only=True, mmap=True)
    assert checkpoint[FINGERPRINT_KEY]["model"] == "lightning.pytorch.demos.boring_classes.DemoModel"


def test_another_runs_checkpoint_named_by_the_user_is_loaded_with_a_warning(run_a, tmp_path):
    other = tmp_path / "other"
    path = run_a / "checkpoints" / "last.ckpt"
    args = _args(other, *MODEL_A, *DATA_A, "--model.lr", "0.01", "--trainer.max_steps", "4")
    with pytest.warns(
        GPUOptWarning, match=r"--ckpt_path .* is another run's checkpoint \(model.lr 0.05 -> 0.01\)"
    ):
        main([*args, "--ckpt_path", str(path)])
    assert torch.load(other / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)["global_step"] == 4


def _plain_lightning_checkpoint(root: Path) -> Path:
    """A 2-step fit by plain Lightning (no run fingerprint, as gpuopt fit wrote before): its last.ckpt."""
    trainer = pl.Trainer(
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(save_last=True, save_top_k=0)],
    )
    trainer.fit(RecordingRegressor(), IndexedData40(batch_size=4, num_workers=0))
    return root / "checkpoints" / "last.ckpt"


def test_a_checkpoint_without_a_fingerprint_loads_with_a_one_line_warning(tmp_path):
    _plain_lightning_checkpoint(tmp_path)
    with pytest.warns(GPUOptWarning, match=r"has no run fingerprint") as caught:
        main(_args(tmp_path, *MODEL_A, *DATA_A, "--trainer.max_steps", "3"))
    (warning,) = [w for w in caught if w.category is GPUOptWarning]
    assert "\n" not in str(warning.message)


def test_a_sigterm_stop_resumes_with_one_line_and_no_warning_of_the_pack(tmp_path, caplog):
    root = tmp_path / "run"
    args = _args(root, *MODEL_A, *DATA_A, "--trainer.max_epochs", "1")
    fault = ["--trainer.callbacks+=tests.resume_child.Fault", "--trainer.callbacks.term_batch=3"]
    stopped = _gpuopt([*args, *fault], cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    said = stopped.stdout + stopped.stderr
    assert (
        "ExactResume: stopped by SIGTERM at step 4" in said
        and "stopped by SIGTERM" in said.split("gpuopt summary:")[1]
    )
    assert "max_epochs=1` reached" not in said  # not why it stopped
    assert "GPUOptWarning" not in said and "Traceback" not in said
    with caplog.at_level(logging.INFO):
        main(args)  # a GPUOptWarning would fail this test (pyproject: error::GPUOptWarning)
    resumed = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert resumed == [
        f"gpuopt fit: resuming from {root / 'checkpoints' / 'last.ckpt'} at step 4, epoch 0, 16 samples of the "
        "epoch already seen."
    ]
    report = (root / "gpuopt_report.json").read_text()
    assert '"kind": "stop"' in report and '"kind": "resume"' in report  # the stop is in the final report


class DrawnVersionLogger(Logger):
    """A logger that names its folder itself, afresh at each start, as a tracking service's run id does."""

    name = "service"

    def __init__(self, save_dir: str = ".") -> None:
        super().__init__()
        import uuid

        self._save_dir, self._version = save_dir, uuid.uuid4().hex[:8]

    @property
    def version(self) -> str:
        return self._version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        pass


@pytest.mark.parametrize(
    ("logger", "same_command"),
    [
        (["--trainer.logger", "false"], True),
        (["--trainer.logger", "tests.test_cli_resume.DrawnVersionLogger"], False),
    ],
    ids=["folder-found-again", "logger-names-its-folder"],
)
def test_the_stop_line_says_how_to_resume_and_it_is_true(tmp_path, caplog, logger, same_command):
    root = tmp_path / "run"
    args = ["fit", *QUIET[:2], *MODEL_A, *DATA_A, *QUIET[4:], "--trainer.max_epochs", "1", *logger]
    args += (
        ["--trainer.default_root_dir", str(root)]
        if same_command
        else ["--trainer.logger.save_dir", str(root)]
    )
    fault = ["--trainer.callbacks+=tests.resume_child.Fault", "--trainer.callbacks.term_batch=3"]
    with caplog.at_level(logging.INFO):
        main([*args, *fault])
    said = [r.getMessage() for r in caplog.records]
    (stop,) = [line for line in said if line.startswith("ExactResume: stopped by SIGTERM at step 4: wrote ")]
    path = stop.split(": wrote ")[1].split(";")[0]
    (summary,) = [line for line in said if line.startswith("gpuopt summary:")]
    if same_command:
        assert stop.endswith("; the same command resumes.")
        assert summary.endswith("stopped by SIGTERM: the same command resumes")
    else:  # the next start draws another folder: the line names the checkpoint
        assert stop.endswith(f"; resume with ckpt_path={path!r}.")
        assert summary.endswith(f"stopped by SIGTERM: resume with --ckpt_path {path}")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        main(args if same_command else [*args, "--ckpt_path", path])  # as the line says
    resumed = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert resumed == [
        f"gpuopt fit: resuming from {path} at step 4, epoch 0, 16 samples of the epoch already seen."
    ]


def test_a_run_with_a_drawn_seed_resumes_in_its_folder_too(tmp_path, caplog, monkeypatch):
    # LightningCLI's default `seed_everything: true` draws another seed at each start: the run's identity says
    # "random", and the resume restores the first leg's random state and loader seed.
    monkeypatch.chdir(tmp_path)
    args = ["fit", *MODEL_A, *DATA_A, *QUIET[4:], "--trainer.max_epochs", "1"]  # Lightning's default logger
    main([*args, "--trainer.callbacks+=tests.resume_child.Fault", "--trainer.callbacks.term_batch=3"])
    with caplog.at_level(logging.INFO):
        main(args)
    (folder,) = [p.parent.parent for p in tmp_path.glob("lightning_logs/*/checkpoints/last.ckpt")]
    resumed = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert resumed == [
        f"gpuopt fit: resuming from {folder / 'checkpoints' / 'last.ckpt'} at step 4, epoch 0, 16 samples of the "
        "epoch already seen."
    ]
    assert (
        torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)[FINGERPRINT_KEY]["seed"]
        == "random"
    )


def test_the_fingerprint_leaves_out_what_may_change_within_a_run():
    model = RecordingRegressor()
    data = {
        "class_path": "tests.helpers.IndexedData40",
        "init_args": {"batch_size": 4, "num_workers": 0, "pin_memory": "auto", "data_dir": "/a"},
    }
    first = run_fingerprint(model, IndexedData40(), {"class_path": "x", "init_args": {"lr": 0.05}}, data)
    moved = {
        **data,
        "init_args": {**data["init_args"], "num_workers": 8, "pin_memory": True, "data_dir": "/b"},
    }
    second = run_fingerprint(model, IndexedData40(), {"class_path": "x", "init_args": {"lr": 0.05}}, moved)
    assert fingerprint_differences(first, second) == []
    assert first["data_args"] == {"batch_size": 4}
    bigger = {**data, "init_args": {**data["init_args"], "batch_size": 8}}
    third = run_fingerprint(model, IndexedData40(), {"class_path": "x", "init_args": {"lr": 0.05}}, bigger)
    assert fingerprint_differences(first, third) == ["data.batch_size 4 -> 8"]


@pytest.mark.parametrize(
    ("limits", "progress", "early_stopping", "finished"),
    [
        ({"max_steps": 8}, (8, 0), 0, "max_steps=8 reached"),
        ({"max_steps": 9}, (8, 0), 0, None),
        ({"max_epochs": 2}, (20, 2), 0, "max_epochs=2 reached"),
        ({"max_epochs": 3}, (20, 2), 0, None),
        ({"max_epochs": 3}, (20, 2), 3, "EarlyStopping stopped it"),
        ({"max_epochs": 1}, (4, 0), 0, None),  # a signal stop in the middle of the last epoch: not finished
    ],
    ids=["max-steps", "more-steps", "max-epochs", "more-epochs", "early-stopping", "signal-stop"],
)
def test_finished_means_a_limit_reached_or_early_stopping_never_a_signal_stop(
    tmp_path, limits, progress, early_stopping, finished
):
    from lightning_gpuopt._cli_resume import plan_resume

    step, epochs = progress
    fingerprint = run_fingerprint(RecordingRegressor(), None)
    checkpoint = {
        "global_step": step,
        "epoch": epochs,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": epochs}}}},
        "callbacks": {"EarlyStopping{'monitor': 'val_loss'}": {"stopping_reason": early_stopping}},
        FINGERPRINT_KEY: fingerprint,
    }
    path = tmp_path / "last.ckpt"
    torch.save(checkpoint, path)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **limits)
    plan = plan_resume(trainer, str(path), fingerprint)
    assert plan.finished is (finished is not None) and plan.path == str(path)
    if finished:
        assert f"finished at step {step} ({finished}" in plan.message
    else:
        assert plan.message.startswith(f"gpuopt fit: resuming from {path} at step {step}")


# --- Each field of the run fingerprint, changed alone, makes another run: refused, and another folder.

MODEL_CONFIG = {
    "class_path": "tests.helpers.RecordingRegressor",
    "init_args": {"dim": 8, "hidden": 16, "lr": 0.05},
}
DATA_CONFIG = {
    "class_path": "tests.helpers.IndexedData40",
    "init_args": {"batch_size": 4, "num_workers": 0, "pin_memory": "auto", "data_dir": "/a"},
}
CONFIG = {
    "seed_everything": 1,
    "trainer": {"max_steps": 10, "precision": None, "accumulate_grad_batches": 1, "devices": 1},
    "gpuopt": {"adaptive_batch": False, "report": True},
    "optimizer": None,
}


class _OtherRegressor(RecordingRegressor):
    pass


def _renamed(model: RecordingRegressor) -> RecordingRegressor:
    model.body = model.net  # the same layers under another name
    del model.net
    return model


def _reordered(model: RecordingRegressor) -> RecordingRegressor:
    from collections import OrderedDict

    layers = OrderedDict(reversed(list(model.net.named_children())))  # the same tensors, in another order
    model.net = torch.nn.Sequential(layers)
    return model


def _fingerprint(model=None, data=None, model_config=None, data_config=None, config=None):
    from lightning_gpuopt._cli_resume import run_options

    config = config or CONFIG
    return run_fingerprint(
        model or RecordingRegressor(),
        data or IndexedData40(),
        model_config or MODEL_CONFIG,
        data_config or DATA_CONFIG,
        seed=config["seed_everything"],
        options=run_options(config),
    )


def _with(section: dict, **init_args) -> dict:
    return {**section, "init_args": {**section["init_args"], **init_args}}


def _config(**changes) -> dict:
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in CONFIG.items()}
    for dotted, value in changes.items():
        head, _, name = dotted.partition("__")
        if name:
            out[head][name] = value
        else:
            out[head] = value
    return out


# (field changed, the current run's fingerprint, what the refusal names)
REFUSED = [
    (
        "model-class",
        lambda: _fingerprint(model=_OtherRegressor()),
        "model class tests.helpers.RecordingRegressor -> ",
    ),
    (
        "data-class",
        lambda: _fingerprint(data=RecordingRegressor()),
        "datamodule class tests.helpers.IndexedData40 -> tests.helpers.RecordingRegressor",
    ),
    (
        "parameter-name",
        lambda: _fingerprint(model=_renamed(RecordingRegressor())),
        "first: 'body.0.weight' absent",
    ),
    (
        "parameter-shape",
        lambda: _fingerprint(model=RecordingRegressor(hidden=32)),
        "first: 'net.0.weight' [16, 8] float32 -> [32, 8] float32",
    ),
    (
        "parameter-dtype",
        lambda: _fingerprint(model=RecordingRegressor().double()),
        "first: 'net.0.weight' [16, 8] float32 -> [16, 8] float64",
    ),
    (
        "parameter-order",
        lambda: _fingerprint(model=_reordered(RecordingRegressor())),
        "parameters (their order",
    ),
    ("model-arg", lambda: _fingerprint(model_config=_with(MODEL_CONFIG, lr=0.01)), "model.lr 0.05 -> 0.01"),
    (
        "data-arg",
        lambda: _fingerprint(data_config=_with(DATA_CONFIG, batch_size=8)),
        "data.batch_size 4 -> 8",
    ),
    ("seed", lambda: _fingerprint(config=_config(seed_everything=2)), "seed_everything 1 -> 2"),
    (
        "random-seed",
        lambda: _fingerprint(config=_config(seed_everything="random")),
        "seed_everything 1 -> 'random'",
    ),
    (
        "trainer-option",
        lambda: _fingerprint(config=_config(trainer__precision="bf16-mixed")),
        "trainer.precision None -> 'bf16-mixed'",
    ),
    (
        "accumulation",
        lambda: _fingerprint(config=_config(trainer__accumulate_grad_batches=2)),
        "trainer.accumulate_grad_batches 1 -> 2",
    ),
    (
        "optimizer",
        lambda: _fingerprint(
            config=_config(optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}})
        ),
        "optimizer",
    ),
    (
        "adaptive-batch",
        lambda: _fingerprint(config=_config(gpuopt__adaptive_batch=True)),
        "gpuopt.adaptive_batch False -> True",
    ),
]
# What may change between the legs of one run: the same run, the same folder.
SAME_RUN = [
    ("num-workers", lambda: _fingerprint(data_config=_with(DATA_CONFIG, num_workers=8))),
    ("pin-memory", lambda: _fingerprint(data_config=_with(DATA_CONFIG, pin_memory=True))),
    ("persistent-workers", lambda: _fingerprint(data_config=_with(DATA_CONFIG, persistent_workers=False))),
    ("prefetch-factor", lambda: _fingerprint(data_config=_with(DATA_CONFIG, prefetch_factor=4))),
    ("device-prefetch", lambda: _fingerprint(data_config=_with(DATA_CONFIG, device_prefetch=True))),
    ("data-dir", lambda: _fingerprint(data_config=_with(DATA_CONFIG, data_dir="/b"))),
    ("max-steps", lambda: _fingerprint(config=_config(trainer__max_steps=20))),
    ("devices", lambda: _fingerprint(config=_config(trainer__devices=8))),
    ("report", lambda: _fingerprint(config=_config(gpuopt__report=False))),
]


def _saved_run(tmp_path: Path) -> Path:
    path = tmp_path / "last.ckpt"
    checkpoint = {"global_step": 2, "epoch": 0, FINGERPRINT_KEY: _fingerprint()}
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize(("field", "current", "named"), REFUSED, ids=[r[0] for r in REFUSED])
def test_each_field_of_the_fingerprint_changed_alone_is_another_run(tmp_path, field, current, named):
    from lightning_gpuopt._cli_resume import ResumeRefused, plan_resume, run_identity

    path = _saved_run(tmp_path)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=10)
    fingerprint = current()
    with pytest.raises(ResumeRefused) as refused:
        plan_resume(trainer, str(path), fingerprint)
    (line,) = str(refused.value).splitlines()
    assert line.startswith(f"{path} is another run's checkpoint (") and named in line
    (difference,) = fingerprint_differences(_fingerprint(), fingerprint)  # one field changed, one named
    assert named in difference
    assert run_identity(fingerprint) != run_identity(_fingerprint())  # and its own folder


@pytest.mark.parametrize(("field", "current"), SAME_RUN, ids=[r[0] for r in SAME_RUN])
def test_what_may_change_between_legs_is_the_same_run(tmp_path, field, current):
    from lightning_gpuopt._cli_resume import plan_resume, run_identity

    path = _saved_run(tmp_path)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=10)
    fingerprint = current()
    plan = plan_resume(trainer, str(path), fingerprint)
    assert plan.path == str(path) and plan.message.startswith(f"gpuopt fit: resuming from {path} at step 2")
    assert run_identity(fingerprint) == run_identity(_fingerprint())


class RankRecord(pl.Callback):
    """Writes where each rank's run lives and which steps it trained to ``out_dir/rank{r}.json``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.start = out_dir, None

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        import json

        record = {
            "log_dir": trainer.log_dir,
            "ckpt_path": trainer.ckpt_path,
            "steps": [self.start, trainer.global_step],
        }
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_a_checkpoint_without_a_fingerprint_resumes_under_ddp_in_one_folder_for_every_rank(tmp_path):
    import json

    plain = tmp_path / "plain"
    path = _plain_lightning_checkpoint(plain)
    # two CPU ranks over gloo, on Lightning's default logger (no `trainer.logger`): the ranks must name one folder
    args = [
        "fit",
        *MODEL_A,
        *DATA_A,
        "--seed_everything",
        "1",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.max_steps",
        "4",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--gpuopt.report",
        "false",
        "--ckpt_path",
        str(path),
        "--trainer.callbacks+=tests.test_cli_resume.RankRecord",
        f"--trainer.callbacks.out_dir={tmp_path}",
    ]
    done = _gpuopt(args, cwd=tmp_path, timeout=240)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert said.count("has no run fingerprint") == 1 and "AttributeError" not in said  # rank 0 warns, once
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["steps"] for r in records] == [[2, 4], [2, 4]]
    assert [r["ckpt_path"] for r in records] == [str(path)] * 2
    (folder,) = {r["log_dir"] for r in records}
    assert Path(folder).name.startswith("run-") and Path(folder).parent == tmp_path / "lightning_logs"
