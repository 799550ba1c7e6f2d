"""benchmarks/gpu_check.sh all: the one budgeted GPU call, proven end to end on the CPU by its dry run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO as ROOT

sys.path.append(str(ROOT / "benchmarks" / "gpu"))

import check
import device


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The whole dry run, as the GPU machine's image would run it: jsonargparse and torchdata not importable.

    The budget is generous so that a loaded CI machine does not push a section past its slice: the
    point here is that every code path runs, not how fast (the H200 slices are in check.SECTIONS).
    """
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "tools" / "without_packages.py"),
            "jsonargparse,torchdata",
            str(ROOT / "benchmarks" / "gpu" / "check.py"),
            str(out),
            "--dry-run",
            "--budget",
            "1500",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done, out


def test_dry_run_runs_every_section_on_cpu_without_jsonargparse_or_torchdata(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["dry_run"] and results["every_section_ran"]
    status = {s["section"]: s for s in results["sections"]}
    assert list(status) == list(check.SECTIONS)
    assert status["cuda_tests"]["status"] == "skipped" and "CUDA" in status["cuda_tests"]["reason"]
    for name, s in status.items():
        if check.SECTIONS[name].cuda_only:  # skipped with its reason, never faked
            assert s["status"] == "skipped" and s["reason"] == check.SECTIONS[name].cuda_only
        else:
            assert s["status"] == "ran", (name, s.get("error"))
            assert s["figures"] and s["memory_cap_bytes"] == device.SECTION_CAP_BYTES
    # OOM recovery ran for real under SimulatedMemory: the OOM at its batch, the same training, memory back.
    oom = status["oom"]["details"]["transformer"]["checks"]
    assert oom["real_oom_of_the_device"] and oom["limit_forced_the_oom_at_its_batch"] and oom["completed"]
    assert oom["parameters_match_reference"] and oom["memory_returns_to_pre_oom"]
    assert status["batchsize"]["details"]["lm"]["true_max"] > 0
    assert "tf32" in status["precision"]["skipped"] and "device prefetch" in status["data"]["skipped"]
    mfu = status["mfu"]["details"]
    assert (
        mfu["flops_per_batch"] > 0 and mfu["peak_flops_source"] == "peak_flops="
    )  # the MFU path, nominal peak
    # torch.compile: every compiled form recovered from a real OOM with dynamo compiling, or is skipped with its reason.
    compiled = status["compile"]
    forms = compiled["details"]["forms"]
    assert any(f["status"] == "ran" for f in forms.values()), forms
    for f in forms.values():
        if f["status"] == "ran":
            assert f["split_happened"] and min(f["first_compile_s"]["frames"]) >= 1
        else:
            assert f["status"] in ("refused", "left out") and f["reason"]
    assert len(compiled["skipped"]) == sum(f["status"] != "ran" for f in forms.values())
    table = (out / "gpu_check.md").read_text()
    assert "| section | figure | value | target | met |" in table and "DRY RUN" in table
    assert f"torch {results['torch']}" in table and f"Lightning {results['lightning']}" in table


def _looping(sizes):
    while True:
        device.check()
        time.sleep(0.01)


def _stuck(sizes):
    time.sleep(60)  # never reaches a boundary: only the watchdog can stop it


def _broken(sizes):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("run", "grace", "status"),
    [(_looping, 30.0, "over_slice"), (_stuck, 0.5, "over_slice"), (_broken, 30.0, "error")],
    ids=["deadline", "watchdog", "error"],
)
def test_a_section_past_its_slice_is_stopped_and_recorded(tmp_path, monkeypatch, run, grace, status):
    monkeypatch.setattr(check, "GRACE_S", grace)
    section = check.Section("late", "a section that overruns", 1, run, dry_sizes={})
    record = check.run_section(section, 0.3, dry_run=True, out=tmp_path)
    assert record["status"] == status and record["wall_s"] < 30
    assert record["slice_s"] == 0.3 and record["figures"] == []


def test_budget_scales_the_slices_and_only_picks_sections():
    args = check.parse_args(["out", "--budget", "150", "--only", "oom,mfu"])
    assert args.sections == ["oom", "mfu"] and args.budget == 150
    assert sum(s.slice_s for s in check.SECTIONS.values()) <= check.DEFAULT_BUDGET_S
    with pytest.raises(SystemExit):
        check.parse_args(["out", "--only", "nope"])
