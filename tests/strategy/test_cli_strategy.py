"""The CLI and the strategy: `gpuopt plan`, `gpuopt fit --trainer.devices 2` with the selected strategy, torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_gpuopt.cli import main
from lightning_gpuopt.report import load_report, summary_rows
from tests.helpers import run_as_two_nodes, subprocess_env
from tests.strategy import strategy_probe

BORING = [
    "--model",
    "lightning.pytorch.demos.boring_classes.BoringModel",
    "--data",
    "lightning.pytorch.demos.boring_classes.BoringDataModule",
]
CPU2 = [
    "--trainer.accelerator",
    "cpu",
    "--trainer.devices",
    "2",
    "--trainer.max_steps",
    "3",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.logger",
    "false",
    "--trainer.enable_checkpointing",
    "false",
]


pytestmark = pytest.mark.usefixtures("cli_argv")


def test_gpuopt_plan_prints_the_table_the_pick_and_the_reason(capsys):
    main(
        [
            "plan",
            *BORING,
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--gpuopt.device_memory",
            "500",
        ]
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("candidate"))
    assert lines[header].split() == [
        "candidate",
        "parameters",
        "gradients",
        "optimizer",
        "gathered",
        "activations",
        "total",
        "host",
        "per",
        "rank",
        "fits",
    ]
    rows = lines[header + 2 : header + 9]
    assert [r.split("  ")[0] for r in rows] == [
        "ddp",
        "deepspeed zero-1",
        "fsdp: shard grads+optimizer",
        "deepspeed zero-2",
        "fsdp: full shard",
        "deepspeed zero-3",
        "fsdp: full shard + cpu offload",
    ]
    assert "<- pick" in rows[2] and rows[0].split()[-1] == "no"
    assert "pick: fsdp: shard grads+optimizer: ddp would need 792 B per device, over the budget" in out
    assert "2 device(s), 500 B each (budget 450 B), precision 32-true, optimizer SGD" in out


def test_gpuopt_plan_when_nothing_fits_prints_the_table_and_exits_1(capsys):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "plan",
                *BORING,
                "--trainer.accelerator",
                "cpu",
                "--trainer.devices",
                "2",
                "--gpuopt.device_memory",
                "100",
            ]
        )
    assert info.value.code == 1
    out = capsys.readouterr().out
    assert "No way of training this model fits 2 device(s) of 100 B" in out and "pick: none" in out


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize(
    ("memory", "pick", "strategy"),
    [(None, "ddp", "DDPStrategy"), ("500", "fsdp: shard grads+optimizer", "FSDP2Strategy")],
    ids=["ddp", "fsdp2-unchanged-module"],
)
def test_fit_on_two_processes_uses_the_selected_strategy(tmp_path, memory, pick, strategy):
    extra = ["--gpuopt.device_memory", memory] if memory else []
    probe = "--trainer.callbacks+=lightning.pytorch.callbacks.LambdaCallback"
    report = "--trainer.callbacks.on_train_end=tests.strategy.strategy_probe.report"
    proc = _run(
        [sys.executable, "-m", "lightning_gpuopt", "fit", *BORING, *CPU2, *extra, probe, report], tmp_path
    )
    out = proc.stdout + proc.stderr
    assert f"pick: {pick}:" in out
    assert strategy_probe.lines(tmp_path) == [
        f"strategy-probe: rank {r} of 2, {strategy}, step 3" for r in (0, 1)
    ], out[-3000:]
    # The run ends with a report of the plan, each rank's peak, the micro-batch, the precision, the decisions.
    (found,) = list(tmp_path.rglob("gpuopt_report.json"))
    report = load_report(found)
    assert [r["rank"] for r in report["run"]["rank_peaks"]] == [0, 1]
    assert all(r["peak_bytes"] > 0 for r in report["run"]["rank_peaks"])
    planned = [d for d in report["decisions"] if d["kind"] == "strategy"]
    assert [d["data"]["pick"] for d in planned] == [pick] and f"pick: {pick}:" in planned[0]["data"]["table"]
    rows = dict(summary_rows(report))
    assert rows["strategy"].startswith(f"{strategy} on 2 rank(s); planned: {pick}: ")
    assert rows["peak memory per rank"].startswith("0: ") and ", 1: " in rows["peak memory per rank"]
    assert "micro-batch" in rows["micro-batches k"] and rows["precision"] == "32-true"
    assert "peak memory per rank" in out  # the table printed at the end
    if strategy == "FSDP2Strategy":  # OOMRecovery and MemoryAwareBatchSize both run under FSDP2
        assert "OOMRecovery not added" not in out and "MemoryAwareBatchSize not added" not in out
        assert (
            "MemoryAwareBatchSize: training on CPU without SimulatedMemory" in out
        )  # added, and said why it waits


@pytest.mark.slow
def test_torchrun_launches_the_cli(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"torchrun is not installed next to {sys.executable}")
    proc = _run(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "lightning_gpuopt",
            "fit",
            *BORING,
            *CPU2,
            "--trainer.callbacks+=lightning.pytorch.callbacks.LambdaCallback",
            "--trainer.callbacks.on_train_end=tests.strategy.strategy_probe.report",
        ],
        tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert strategy_probe.lines(tmp_path) == [
        f"strategy-probe: rank {r} of 2, DDPStrategy, step 3" for r in (0, 1)
    ], out[-3000:]


def test_with_cuda_the_sharded_plan_is_fsdp2_and_keeps_oom_recovery(monkeypatch, caplog):
    import logging

    import torch

    import lightning_gpuopt.cli as cli_module
    from lightning_gpuopt import FSDP2Strategy, OOMRecovery
    from lightning_gpuopt.cli import GPUOptCLI

    # CUDA as the CLI sees it (the trainer itself runs on CPU processes, which FSDP2Strategy supports too).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cli_module, "_on_cuda", lambda config: True)
    with caplog.at_level(logging.INFO):
        cli = GPUOptCLI(args=[*BORING, *CPU2, "--gpuopt.device_memory", "500"], run=False)
    assert cli.plan.pick.startswith("fsdp") and isinstance(cli.trainer.strategy, FSDP2Strategy)
    assert any(isinstance(cb, OOMRecovery) for cb in cli.trainer.callbacks)
    assert "OOMRecovery not added" not in caplog.text


@pytest.mark.slow
def test_fit_on_two_nodes_ends_with_a_report_of_the_plan_and_every_rank(tmp_path):
    """`gpuopt fit --trainer.devices 1 --trainer.num_nodes 2`: two launchers as two nodes on 127.0.0.1."""
    args = [*CPU2[:2], "--trainer.devices", "1", "--trainer.num_nodes", "2", *CPU2[4:]]
    logs = run_as_two_nodes([sys.executable, "-m", "lightning_gpuopt", "fit", *BORING, *args], tmp_path)
    (found,) = list(tmp_path.rglob("gpuopt_report.json"))  # rank 0 writes it
    report = load_report(found)
    assert report["run"]["num_nodes"] == 2 and report["run"]["world_size"] == 2
    assert [r["rank"] for r in report["run"]["rank_peaks"]] == [0, 1]
    (planned,) = [d for d in report["decisions"] if d["kind"] == "strategy"]
    assert planned["data"]["num_nodes"] == 2 and planned["data"]["pick"] == "ddp"
    rows = dict(summary_rows(report))
    assert rows["strategy"].startswith("DDPStrategy on 2 rank(s), 2 nodes; planned: ddp: ")
    assert "1: " in rows["peak memory per rank"] and rows["precision"] == "32-true"
    assert "peak memory per rank" in logs[0] and "pick: ddp:" in logs[0]
