from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_gpuopt.cli import GPUOptCLI, main, run
from tests.helpers import REPO, subprocess_env

DEFAULT_CONFIG = REPO / "examples" / "configs" / "default.yaml"
BORING = [
    "--model",
    "lightning.pytorch.demos.boring_classes.DemoModel",
    "--data",
    "lightning.pytorch.demos.boring_classes.BoringDataModule",
]


def _quiet(tmp_path: Path) -> list[str]:
    return [
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]


def _summary_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpuopt summary:")]


def test_fit_any_module_and_datamodule_by_class_path(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        cli = run(["fit", *BORING, "--trainer.max_steps", "5", *_quiet(tmp_path)])
    assert type(cli.model).__name__ == "DemoModel"
    assert cli.trainer.global_step == 5
    (line,) = _summary_lines(caplog)
    assert "samples/s" in line and "peak" in line and "5 steps" in line
    assert cli.summary.values["global_step"] == 5
    assert cli.summary.values["samples_per_s"] > 0
    assert cli.summary.values["peak_memory_bytes"] > 0


def test_fit_adds_oom_recovery_on_a_single_device(tmp_path):
    from lightning_gpuopt import OOMRecovery

    cli = run(["fit", *BORING, "--trainer.max_steps", "2", *_quiet(tmp_path)])
    assert sum(isinstance(cb, OOMRecovery) for cb in cli.trainer.callbacks) == 1
    off = run(
        ["fit", *BORING, "--trainer.max_steps", "2", "--gpuopt.oom_recovery", "false", *_quiet(tmp_path)]
    )
    assert not any(isinstance(cb, OOMRecovery) for cb in off.trainer.callbacks)
    own = run(
        [
            "fit",
            *BORING,
            "--trainer.max_steps",
            "2",
            "--trainer.callbacks+=lightning_gpuopt.OOMRecovery",
            "--trainer.callbacks.max_micro_batches=4",
            *_quiet(tmp_path),
        ]
    )
    (cb,) = [cb for cb in own.trainer.callbacks if isinstance(cb, OOMRecovery)]
    assert cb.max_micro_batches == 4


@pytest.mark.parametrize(
    ("strategy", "added"),
    [("ddp", True), ("ddp_spawn", True), ("fsdp2", True), ("tensor_parallel", False)],
    ids=["ddp", "ddp-spawn", "fsdp2", "tensor-parallel"],
)
def test_oom_recovery_is_added_under_ddp_and_fsdp2_but_not_under_tensor_parallelism(strategy, added, caplog):
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_gpuopt import FSDP2Strategy, OOMRecovery

    chosen = {"fsdp2": FSDP2Strategy(), "tensor_parallel": ModelParallelStrategy(tensor_parallel_size=2)}.get(
        strategy, strategy
    )
    trainer = Trainer(accelerator="cpu", devices=2, strategy=chosen, logger=False)
    with caplog.at_level(logging.INFO):
        GPUOptCLI._add_oom_recovery(trainer)
    assert any(isinstance(cb, OOMRecovery) for cb in trainer.callbacks) is added
    if not added:
        assert (
            "OOMRecovery not added: micro-batching under ModelParallelStrategy supports FSDP2 data parallelism only"
            in caplog.text
        )


def test_fit_adds_memory_aware_batch_size_unless_turned_off(tmp_path):
    from lightning_gpuopt import MemoryAwareBatchSize

    cli = run(["fit", *BORING, "--trainer.max_steps", "2", *_quiet(tmp_path)])
    assert sum(isinstance(cb, MemoryAwareBatchSize) for cb in cli.trainer.callbacks) == 1
    off = run(
        ["fit", *BORING, "--trainer.max_steps", "2", "--gpuopt.batch_size_search", "false", *_quiet(tmp_path)]
    )
    assert not any(isinstance(cb, MemoryAwareBatchSize) for cb in off.trainer.callbacks)


def test_fit_adds_the_report_unless_turned_off(tmp_path):
    from lightning_gpuopt import GPUOptReport

    cli = run(["fit", *BORING, "--trainer.max_steps", "2", *_quiet(tmp_path)])
    (report,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, GPUOptReport)]
    assert report.paths["json"] == str(tmp_path / "gpuopt_report.json") and len(report.report["steps"]) == 2
    off = run(["fit", *BORING, "--trainer.max_steps", "2", "--gpuopt.report", "false", *_quiet(tmp_path)])
    assert not any(isinstance(cb, GPUOptReport) for cb in off.trainer.callbacks)


def test_noise_scale_and_adaptive_batch_flags(tmp_path):
    from lightning_gpuopt import AdaptiveBatchSize, GradientNoiseScale

    base = ["fit", *BORING, "--trainer.max_steps", "2", "--gpuopt.report", "false"]
    off = run([*base, *_quiet(tmp_path)])
    assert not any(isinstance(cb, (GradientNoiseScale, AdaptiveBatchSize)) for cb in off.trainer.callbacks)
    noise = run([*base, *_quiet(tmp_path), "--gpuopt.noise_scale", "true"])
    assert [type(cb) for cb in noise.trainer.callbacks].count(GradientNoiseScale) == 1
    assert not any(isinstance(cb, AdaptiveBatchSize) for cb in noise.trainer.callbacks)
    # another optimization, so another run: its own folder (the first one's checkpoint would be refused)
    grow = run([*base, *_quiet(tmp_path / "grow"), "--gpuopt.adaptive_batch", "true"])
    kinds = [type(cb) for cb in grow.trainer.callbacks]
    assert kinds.count(GradientNoiseScale) == 1 and kinds.count(AdaptiveBatchSize) == 1


def test_fit_adds_precision_switch_auto_or_keep(tmp_path):
    from lightning_gpuopt import PrecisionSwitch

    def switches(cli):
        return [cb for cb in cli.trainer.callbacks if isinstance(cb, PrecisionSwitch)]

    auto = run(["fit", *BORING, "--trainer.max_steps", "2", *_quiet(tmp_path)])
    (cb,) = switches(auto)
    assert cb.initial == "auto" and auto.trainer.precision == "32-true"  # a CPU: bf16 is opt-in
    kept = run(
        [
            "fit",
            *BORING,
            "--trainer.max_steps",
            "2",
            "--trainer.precision",
            "bf16-mixed",
            *_quiet(tmp_path / "kept"),
        ]
    )
    (cb,) = switches(kept)
    assert cb.initial == "keep" and kept.trainer.precision == "bf16-mixed"
    off = run(
        ["fit", *BORING, "--trainer.max_steps", "2", "--gpuopt.precision_switch", "false", *_quiet(tmp_path)]
    )
    assert switches(off) == []
    own = run(
        [
            "fit",
            *BORING,
            "--trainer.max_steps",
            "2",
            "--trainer.callbacks+=lightning_gpuopt.PrecisionSwitch",
            "--trainer.callbacks.patience=5",
            *_quiet(tmp_path),
        ]
    )
    (cb,) = switches(own)
    assert cb.patience == 5


def test_summary_can_be_turned_off(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        cli = run(
            ["fit", *BORING, "--trainer.max_steps", "2", "--gpuopt.summary", "false", *_quiet(tmp_path)]
        )
    assert cli.summary is None
    assert _summary_lines(caplog) == []


def test_validate_runs_without_summary(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        cli = run(
            [
                "validate",
                "--model",
                "lightning.pytorch.demos.boring_classes.BoringModel",
                "--data",
                "lightning.pytorch.demos.boring_classes.BoringDataModule",
                "--trainer.limit_val_batches",
                "2",
                *_quiet(tmp_path),
            ]
        )
    assert cli.summary is None
    assert _summary_lines(caplog) == []


def test_help_lists_subcommands_and_pack_options(capsys):
    with pytest.raises(SystemExit) as top:
        main(["--help"])
    assert top.value.code == 0
    text = capsys.readouterr().out
    assert "gpuopt: train any LightningModule" in text
    words = " ".join(text.split())  # argparse wraps the description
    for sub in ("fit", "validate", "test", "predict", "gpuopt report RUN_DIR", "gpuopt plan --config"):
        assert sub in words
    with pytest.raises(SystemExit) as fit:
        main(["fit", "--help"])
    assert fit.value.code == 0
    text = capsys.readouterr().out
    assert (
        "--gpuopt.summary" in text
        and "--gpuopt.oom_recovery" in text
        and "--model" in text
        and "--data" in text
    )
    assert "--gpuopt.report" in text and "--gpuopt.precision_switch" in text


def test_bad_config_key_is_jsonargparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", *BORING, "--trainer.max_stepz", "5", *_quiet(tmp_path)])
    assert info.value.code != 0
    assert "max_stepz" in capsys.readouterr().err


def test_default_config_names_the_pack_demo_parts():
    cli = GPUOptCLI(run=False, args=["--config", str(DEFAULT_CONFIG), "--trainer.logger", "false"])
    assert type(cli.model).__name__ == "ImageClassifier"
    assert type(cli.datamodule).__name__ == "SyntheticImageDataModule"
    assert cli.datamodule.batch_size == 64


def _run(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_python_dash_m_runs_the_default_config_for_one_epoch(tmp_path):
    proc = _run(
        [
            sys.executable,
            "-m",
            "lightning_gpuopt",
            "fit",
            "--config",
            str(DEFAULT_CONFIG),
            "--trainer.max_epochs",
            "1",
            "--data.train_size",
            "256",
            "--data.val_size",
            "64",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "gpuopt summary: val_acc" in out and "4 steps" in out


def test_console_script_help():
    script = Path(sys.executable).with_name("gpuopt")
    if not script.exists():
        pytest.skip(
            f"the package is not installed in this environment ({script} missing); `make test` installs it"
        )
    proc = _run([str(script), "fit", "--help"], cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--gpuopt.summary" in proc.stdout


def test_console_script_exits_zero_after_fit_and_prints_nothing_extra(tmp_path):
    script = Path(sys.executable).with_name("gpuopt")
    if not script.exists():
        pytest.skip(
            f"the package is not installed in this environment ({script} missing); `make test` installs it"
        )
    proc = _run(
        [str(script), "fit", *BORING, "--trainer.max_steps", "2", *_quiet(tmp_path)],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GPUOptCLI object" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_default_job_reaches_its_accuracy(tmp_path):
    """The README's main job, as it runs: ResNet-18 on the synthetic images to val_acc >= 0.80."""
    proc = _run(
        [
            sys.executable,
            "-m",
            "lightning_gpuopt",
            "fit",
            "--config",
            str(DEFAULT_CONFIG),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(li for li in (proc.stdout + proc.stderr).splitlines() if "gpuopt summary:" in li)
    acc = float(line.split("val_acc ")[1].split()[0])
    assert acc >= 0.80, line
    # The default job includes GPUOptReport: its table, JSON and picture in the run's log directory.
    (report,) = tmp_path.glob("default/run-*/gpuopt_report.json")  # the folder named from the config
    assert (report.parent / "gpuopt_report.png").is_file() and "peak memory" in proc.stdout + proc.stderr


pytestmark = pytest.mark.usefixtures("cli_argv")


def test_fit_keeps_last_checkpoint_and_resumes_from_it_by_default(tmp_path):
    from lightning_gpuopt import ExactResume
    from lightning_gpuopt.callbacks.exact_resume import StepBoundaryCheckpoint

    args = ["fit", *BORING, *_quiet(tmp_path), "--gpuopt.report", "false", "--gpuopt.summary", "false"]
    first = run([*args, "--trainer.max_steps", "3"])
    assert sum(isinstance(cb, ExactResume) for cb in first.trainer.callbacks) == 1
    (boundary,) = [cb for cb in first.trainer.callbacks if isinstance(cb, StepBoundaryCheckpoint)]
    assert boundary.save_last and boundary._train_time_interval.total_seconds() == 15 * 60
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    again = run([*args, "--trainer.max_steps", "5"])  # the same folder: it goes on from step 3
    assert again.trainer.ckpt_path == str(tmp_path / "checkpoints" / "last.ckpt")
    assert again.trainer.global_step == 5
    fresh = run(
        [
            *args,
            "--trainer.max_steps",
            "2",
            "--gpuopt.resume",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "other"),
        ]
    )
    assert fresh.trainer.ckpt_path is None
    assert not any(isinstance(cb, ExactResume) for cb in fresh.trainer.callbacks)


@pytest.mark.slow
def test_gpuopt_fit_stops_on_sigterm_at_the_next_step_with_a_checkpoint_and_exits_zero(tmp_path):
    # The child sends itself SIGTERM at the start of batch 3 (tests/resume_child.py's Fault callback).
    env = subprocess_env()
    args = [*BORING, *_quiet(tmp_path), "--trainer.max_steps", "50", "--gpuopt.report", "false"]
    fault = ["--trainer.callbacks+=tests.resume_child.Fault", "--trainer.callbacks.term_batch=3"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_gpuopt", "fit", *args, *fault],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4  # the step batch 3 completed: within one optimizer step
    assert "SIGTERM" in done.stdout + done.stderr


def test_the_summary_line_and_the_report_table_give_the_same_throughput_and_peak(tmp_path, caplog):
    from lightning_gpuopt import GPUOptReport
    from lightning_gpuopt.report import run_peak_bytes, run_samples_per_s, summary_rows

    with caplog.at_level(logging.INFO):
        cli = run(["fit", *BORING, "--trainer.max_steps", "6", *_quiet(tmp_path)])
    (report,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, GPUOptReport)]
    rows = dict(summary_rows(report.report))
    values = cli.summary.values
    assert values["samples_per_s"] == run_samples_per_s(report.report["steps"])
    assert values["peak_memory_bytes"] == run_peak_bytes(report.report["steps"])
    (line,) = _summary_lines(caplog)
    assert rows["throughput"].split()[0] in line.split(" | ")[0]  # the same figure, printed alike
    # without a report the summary times the steps itself, by the same clock
    alone = run(
        ["fit", *BORING, "--trainer.max_steps", "6", "--gpuopt.report", "false", *_quiet(tmp_path / "b")]
    )
    assert alone.summary.values["samples_per_s"] > 0 and alone.summary.values["peak_memory_bytes"] > 0
