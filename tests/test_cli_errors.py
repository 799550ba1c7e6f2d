"""Mistakes on the gpuopt command line: one line on stderr, exit status 2, no usage dump, no traceback;
``--debug`` shows the traceback. The help lists every subcommand. docs/cli.md, "Mistakes"."""

from __future__ import annotations

import re
import sys
import warnings

import pytest

from lightning_gpuopt._cli_errors import join_negative_values, split_debug
from lightning_gpuopt.cli import CommandLineError, main
from lightning_gpuopt.memory.units import ByteSize, parse_bytes
from tests.helpers import REPO

DEFAULT_CONFIG = str(REPO / "examples" / "configs" / "default.yaml")
BORING = [
    "--model",
    "lightning.pytorch.demos.boring_classes.DemoModel",
    "--data",
    "lightning.pytorch.demos.boring_classes.BoringDataModule",
    "--trainer.logger",
    "false",
]

pytestmark = pytest.mark.usefixtures("cli_argv")


def _one_line_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``gpuopt ARGS``: it must exit with 2 and say one line on stderr; return the line."""
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["fit", *BORING, "--trainer.max_stepz", "5"], "did you mean '--trainer.max_steps'?"),
        (
            ["fit", "--config", DEFAULT_CONFIG, "--data.batchsize", "3"],
            "--data.batchsize: lightning_gpuopt.demos.SyntheticImageDataModule takes no argument 'batchsize': "
            "did you mean 'batch_size'?",
        ),
        (
            ["fit", *BORING, "--model", "lightning.pytorch.demos.boring_classes.DemoModle"],
            "has no class 'DemoModle': did you mean 'DemoModel'?",
        ),
        (["fitt", *BORING], "unknown subcommand 'fitt': did you mean 'fit'?"),
        (["fit", *BORING, "--trainer.max_steps", "abc"], "--trainer.max_steps: expected int, got 'abc'"),
        (
            ["fit", "--config", DEFAULT_CONFIG, "--data.batch_size", "0", "--trainer.logger", "false"],
            "gpuopt fit: SyntheticImageDataModule: `batch_size` must be a positive int, got 0",
        ),
        (["fit", *BORING, "--gpuopt.device_memory", "80G"], "write 80GB (80·10^9 bytes) or 80GiB (80·2^30"),
        (["fit", *BORING, "--gpuopt.device_memory", "-5GB"], "must be positive, got '-5GB'"),
        (["fit", *BORING, "--gpuopt.device_memory", "1e30"], "must be at most 1 PiB"),
        (["fit", *BORING, "--gpuopt.device_memory", "0"], "must be at least 1 byte"),
        (["plan", *BORING, "--trainer.devicez", "2"], "gpuopt plan: unknown option --trainer.devicez"),
        # a prefix of an option is not that option (argparse would take it silently; max_steps: a quick failure)
        (
            ["fit", *BORING, "--trainer.max_steps", "1", "--trainer.max_epoch", "2"],
            "gpuopt fit: unknown option --trainer.max_epoch: did you mean '--trainer.max_epochs'?",
        ),
        (
            ["fit", *BORING, "--trainer.max_steps", "1", "--gpuopt.noise", "true"],
            "gpuopt fit: unknown option --gpuopt.noise: did you mean '--gpuopt.noise_scale'?",
        ),
        (
            ["fit", *BORING, "--trainer.max_steps", "1", "--gpuopt.resum=false"],
            "gpuopt fit: unknown option --gpuopt.resum: did you mean '--gpuopt.resume'?",
        ),
        (
            ["plan", *BORING, "--trainer.device", "2"],
            "gpuopt plan: unknown option --trainer.device: did you mean '--trainer.devices'?",
        ),
        ([], "give a subcommand: fit, validate, test, predict, plan, report"),
    ],
    ids=[
        "unknown-option",
        "unknown-init-argument",
        "unknown-class",
        "unknown-subcommand",
        "bad-value",
        "pack-validation",
        "bare-G",
        "negative-size",
        "absurd-size",
        "zero-size",
        "plan-unknown-option",
        "prefix-trainer-option",
        "prefix-gpuopt-option",
        "prefix-with-equals",
        "plan-prefix",
        "no-subcommand",
    ],
)
def test_a_mistake_is_one_line_and_exit_status_2(args, expected, capsys):
    assert expected in _one_line_exit_2(args, capsys)


def test_a_module_that_does_not_import_is_named_with_the_current_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = _one_line_exit_2(["fit", *BORING, "--model", "mymodel.Net"], capsys)
    assert (
        f"--model mymodel.Net: no module named 'mymodel' (the current directory {tmp_path} is on sys.path)"
        in (missing)
    )
    (tmp_path / "brokenmod.py").write_text("import not_installed_pkg_xyz\n")
    broken = _one_line_exit_2(["fit", *BORING, "--model", "brokenmod.Net"], capsys)
    assert "importing brokenmod failed: it imports 'not_installed_pkg_xyz', which is not installed" in broken


def test_gpuopt_finds_a_model_in_the_current_directory_and_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    (tmp_path / "mymodel_here.py").write_text(
        "from lightning.pytorch.demos.boring_classes import DemoModel\n\nclass Net(DemoModel):\n    pass\n"
    )
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    main(
        [
            "fit",
            *BORING,
            "--model",
            "mymodel_here.Net",
            "--trainer.max_steps",
            "1",
            *quiet,
            "--gpuopt.report",
            "false",
        ]
    )
    assert sys.path == before


def test_debug_anywhere_shows_the_traceback_instead(capsys):
    with pytest.raises(CommandLineError, match=re.escape("did you mean '--trainer.max_steps'")):
        main(["fit", "--debug", *BORING, "--trainer.max_stepz", "5"])


def test_help_lists_every_subcommand_with_plan_and_report(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    listed = out.split("subcommands:")[1]
    for name in ("fit", "validate", "test", "predict", "plan", "report"):
        assert f"\n    {name} " in listed, out
    assert "--debug" in out


def test_the_command_line_is_read_from_sys_argv_without_lightnings_args_warning(tmp_path, monkeypatch):
    args = ["fit", *BORING, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path)]
    args += ["--trainer.enable_progress_bar", "false", "--gpuopt.report", "false"]
    monkeypatch.setattr(sys, "argv", ["gpuopt", *args])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main()
    assert not [w for w in caught if "args parameter is intended" in str(w.message)]
    assert sys.argv == ["gpuopt", *args]


def test_debug_and_negative_values_are_read_before_jsonargparse():
    assert split_debug(["--debug", "fit", "--debug"]) == (["fit"], True)
    assert join_negative_values(["--gpuopt.device_memory", "-5GB"]) == ["--gpuopt.device_memory=-5GB"]
    assert join_negative_values(["--trainer.max_steps", "-1", "--x=-2"]) == [
        "--trainer.max_steps=-1",
        "--x=-2",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80gb", 80 * 10**9),
        ("80 GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80Gi", 80 * 2**30),
    ],
)
def test_memory_sizes_say_their_power(text, expected):
    assert parse_bytes(text) == expected == ByteSize(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("80G", "ambiguous: write 80GB (80·10^9 bytes) or 80GiB (80·2^30 bytes)"),
        ("80g", "ambiguous: write 80GB"),
        ("1.5T", "write 1.5TB (1.5·10^12 bytes) or 1.5TiB"),
        ("-5GB", "must be positive"),
        (-1, "must be positive"),
        ("0", "at least 1 byte"),
        ("1e30", "at most 1 PiB"),
        (1e30, "at most 1 PiB"),
        ("2PiB", "at most 1 PiB"),
    ],
)
def test_a_bad_memory_size_is_one_clear_line(text, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        parse_bytes(text)
    assert "\n" not in str(info.value)
