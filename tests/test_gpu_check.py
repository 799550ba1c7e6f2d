"""benchmarks/gpu_check.sh all: the one budgeted GPU call, proven end to end on the CPU by its dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest

from lightning_gpuopt.microbatch import MicroBatchEngine, MicroBatchUser
from lightning_gpuopt.votes import Proposal, Status
from tests.helpers import REPO as ROOT

sys.path.append(str(ROOT / "benchmarks"))  # the benchmarks' import root, as gpu_check.sh sets it

from gpu import check, device, oom

#: The interpreter gpu_check.sh runs (``$PYTHON``): this one, with jsonargparse and torchdata hidden (the GPU
#: machine's image has neither), running ``-m gpu.check ARGS`` as python would.
HIDING_PYTHON = f"""#!/bin/sh
[ "$1" = -m ] || exit 64
module=$2
shift 2
exec "{sys.executable}" "{ROOT}/tests/tools/without_packages.py" jsonargparse,torchdata -c \
  "import runpy, sys; sys.argv[:2] = ['$module']; runpy.run_module('$module', run_name='__main__', alter_sys=True)" "$@"
"""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The whole dry run, as the GPU machine's image would run it: jsonargparse and torchdata not importable.

    The budget is generous so that a loaded CI machine does not push a section past its slice: the
    point here is that every code path runs, not how fast (the H200 slices are in check.SECTIONS).
    """
    out = tmp_path_factory.mktemp("gpu_check")
    python = out / "python"
    python.write_text(HIDING_PYTHON)
    python.chmod(0o755)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "all", str(out), "--dry-run", "--budget", "1500"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": str(python)},
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
    params = status["oom"]["details"]["transformer"]["parameters"]
    assert (
        params["floor"] >= 1e-4 and params["vs_unsplit"] is not None
    )  # its own floor; the unsplit run reported
    lm = status["batchsize"]["details"]["lm"]
    assert (
        0 < lm["answerable_max"] <= lm["true_max"] and lm["micro_mode"]["micro_batch_run"] <= lm["true_max"]
    )
    # max_tokens='auto': an epoch at the budget chosen, no OOM, no step above the budget; then the speed arms.
    auto, speed = status["tokens"]["details"]["auto"], status["tokens"]["details"]["speed"]
    assert auto["fits"] and auto["steps"] == auto["batches_per_epoch"] > 1 and 0 < auto["padding"] < 1
    assert auto["peak_of_budget"] <= 1 and auto["costliest"]["measured"] <= auto["budget_bytes"]
    assert {speed["same_worst_case"], speed["auto"]} <= set(speed["arms"]) and len(speed["arms"]) == 3
    assert status["overhead"]["details"]["overhead_percent"]["n"] >= 2  # pairs of fits, their spread reported
    goodput = status["goodput"]["details"]
    assert (
        goodput["measurements"] >= 1 and goodput["overhead_percent"]["n"] >= 2
    )  # measured; pairs with spread
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
            assert (
                f["recompilations"]["per_split_median"] <= 1
            )  # frame compilations per split of the OOM batch
        else:
            assert f["status"] in ("refused", "left out") and f["reason"]
    assert len(compiled["skipped"]) == sum(f["status"] != "ran" for f in forms.values())
    # The OOM record: one per OOM of the simulated device, its categories summing to what was allocated.
    forensics = status["forensics"]
    records = forensics["details"]["records"]
    assert records and all(r["stage"] == "train" for r in records)
    assert all(sum(r["categories"].values()) == r["allocated_bytes"] for r in records)
    assert set(forensics["skipped"]) == {"against memory_snapshot", "snapshot pickle"}
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


@pytest.mark.parametrize("args", [[], ["oom", "out"], ["all"]], ids=["nothing", "a section", "no folder"])
def test_gpu_check_sh_runs_every_section_or_says_how(args):
    """The per-section calls are gone: the script takes `all OUT_DIR` and says so otherwise, before Python runs."""
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args], capture_output=True, text=True
    )
    assert done.returncode == 2 and "usage: gpu_check.sh all OUT_DIR" in done.stderr


def test_the_reference_runs_each_batch_at_the_k_it_ran_at_when_k_changes_after_a_step():
    """A k proposed at the end of a step (the allocator thrashing) applies from the next batch: the `oom` section's
    reference must follow the k each batch ran at, or BatchNorm over other micro-batches reads as a trace."""

    # What OOMRecovery proposes when the allocator's retries keep rising.
    class Thrash(MicroBatchUser, pl.Callback):
        proposal = None

        def on_fit_start(self, trainer, pl_module):
            MicroBatchEngine.attach(trainer, self)

        def teardown(self, trainer, pl_module, stage):
            MicroBatchEngine.get(trainer).release(self)

        def on_train_batch_end(self, trainer, *args):
            engine = MicroBatchEngine.get(trainer)
            if trainer.global_step == 5 and engine.k == 2:
                self.proposal = Proposal(3, Status.THRASH, "allocator thrashing (test)")

        def next_proposal(self):
            proposal, self.proposal = self.proposal, None
            return proposal

    workload = oom.workload("resnet50", 0, dry_run=True)  # BatchNorm: each micro-batch its own statistics
    with device.use(device.SimulatedDevice()):
        batches = workload.batches()
        limit = oom.calibrate(workload, batches)["limit_bytes"]
        recovery, record = oom.OOMRecovery(verbose=False), oom.StepRecord()
        model = oom.fit(workload, batches, 6, [oom.LimitAt(3, limit), record, recovery, Thrash()])
        assert [f.batch_idx for f in recovery.failures] == [3] and recovery.k == 3
        assert record.ks == [1, 1, 1, 2, 2, 2]  # batch 5 voted for k = 3 and ran at 2
        start = {k: v.detach().clone() for k, v in workload.build().state_dict().items()}
        same = oom.fit(workload, batches, 6, [oom.FollowSchedule(record.ks), oom.forced(1)])
        shifted = oom.fit(workload, batches, 6, [oom.FollowSchedule([1, 1, 1, 2, 2, 3]), oom.forced(1)])
    assert oom.same_training(model, same, start)["same_training"] == 0.0
    assert oom.same_training(model, shifted, start)["same_training"] > 1e-4
