"""The pack's peak-FLOPs table (dense datasheet peaks by exact CUDA name) and GPUOptReport's MFU built on it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpuopt import GPUOptReport
from lightning_gpuopt.peak_flops import (
    ComputeDtype,
    compute_dtype_of,
    device_peak_flops,
    mfu_unknown_message,
    peak_flops_of,
    resolve_peak_flops,
    tf32_matmuls_enabled,
)
from lightning_gpuopt.report import summary_rows
from tests.helpers import TRAINER_QUIET

T = 1e12

# name: (fp32, tf32, bf16 = fp16, fp8) dense, in TFLOP/s, from NVIDIA's datasheets (sparse figure / 2 where
# only the sparse one is printed); the RTX 4090's bf16/fp16 is the fp32-accumulate figure of the Ada whitepaper.
DATASHEET = {
    "NVIDIA H200": (67.0, 494.7, 989.4, 1978.9),
    "NVIDIA H200 NVL": (60.0, 417.5, 835.5, 1670.5),
    "NVIDIA H100 80GB HBM3": (67.0, 494.7, 989.4, 1978.9),
    "NVIDIA H100 PCIe": (51.0, 378.0, 756.5, 1513.0),
    "NVIDIA H100 NVL": (60.0, 417.5, 835.5, 1670.5),
    "NVIDIA A100-SXM4-80GB": (19.5, 156.0, 312.0, None),
    "NVIDIA L4": (30.3, 60.0, 121.0, 242.5),
    "NVIDIA L40S": (91.6, 183.0, 366.5, 733.0),
    "NVIDIA GeForce RTX 4090": (82.6, 82.6, 165.2, 330.3),
    "NVIDIA B200": (75.0, 1100.0, 2250.0, 4500.0),
}


@pytest.mark.parametrize("name", list(DATASHEET), ids=list(DATASHEET))
def test_each_device_maps_to_its_dense_datasheet_peaks(name):
    fp32, tf32, bf16, fp8 = DATASHEET[name]
    peak = peak_flops_of(name)
    assert peak is not None, f"{name} missing from the table"
    got = (peak.of("fp32"), peak.of("tf32"), peak.of("bf16"), peak.of("fp16"))
    assert got == pytest.approx((fp32 * T, tf32 * T, bf16 * T, bf16 * T), rel=1e-12)
    assert peak.of("fp8") == (None if fp8 is None else pytest.approx(fp8 * T, rel=1e-12))


def test_h200_and_h100_sxm_bf16_are_the_dense_989_4_tflops_and_l40s_is_not_an_l4():
    assert device_peak_flops("NVIDIA H200", "bf16-mixed") == device_peak_flops(
        "NVIDIA H100 80GB HBM3", "bf16-mixed"
    )
    assert device_peak_flops("NVIDIA H200", "bf16-mixed") == pytest.approx(989.4e12)
    assert device_peak_flops("NVIDIA L40S", "bf16-mixed") != device_peak_flops("NVIDIA L4", "bf16-mixed")


def test_unknown_device_has_no_peak_and_the_report_says_so(monkeypatch):
    assert peak_flops_of("NVIDIA H200 MIG 1g.18gb") is None  # exact names only: a MIG slice is not the board
    assert mfu_unknown_message("Fancy GPU") == "MFU unknown for Fancy GPU (pass peak_flops=)"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fancy GPU")
    peak, note = resolve_peak_flops(torch.device("cuda", 0), "bf16-mixed")
    assert peak is None and note == "MFU unknown for Fancy GPU (pass peak_flops=)"
    assert resolve_peak_flops(torch.device("cuda", 0), "bf16-mixed", override=5e14) == (5e14, None)
    rows = dict(
        summary_rows({"run": {"device": "cuda", "mfu_note": note}, "steps": _steps(), "decisions": []})
    )
    assert rows["model FLOPs utilisation"] == note


def _steps() -> list[dict]:
    step = {
        "step": 0,
        "samples": 4,
        "step_time_s": 0.1,
        "mfu": None,
        "peak_bytes": 1,
        "allocated_bytes": 1,
        "k": 1,
        "micro_batch_size": 4,
        "batch_size": 4,
        "precision": "bf16-mixed",
    }
    return [step, {**step, "step": 1}]


def test_compute_dtype_follows_the_precision_and_tf32_reads_fp32_precision():
    assert [compute_dtype_of(p, tf32=False) for p in ("bf16-mixed", "bf16-true", "16-mixed", "32-true")] == [
        ComputeDtype.BF16,
        ComputeDtype.BF16,
        ComputeDtype.FP16,
        ComputeDtype.FP32,
    ]
    assert compute_dtype_of("64-true") is None and compute_dtype_of("transformer-engine") is ComputeDtype.FP8
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API (legacy allow_tf32 only)")
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert tf32_matmuls_enabled() and compute_dtype_of("32-true") is ComputeDtype.TF32
        assert device_peak_flops("NVIDIA H200", "32-true") == pytest.approx(494.7e12)
        matmul.fp32_precision = "ieee"
        assert not tf32_matmuls_enabled() and compute_dtype_of("32-true") is ComputeDtype.FP32
        assert device_peak_flops("NVIDIA H200", "32-true") == pytest.approx(67e12)
    finally:
        matmul.fp32_precision = saved


def test_peak_flops_override_gives_an_mfu_even_on_cpu(tmp_path):
    report = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False, peak_flops=1e12)
    pl.Trainer(max_steps=4, callbacks=[report], **TRAINER_QUIET).fit(BoringModel())
    run, steps = report.report["run"], report.report["steps"]
    assert run["peak_flops"] == 1e12 and run["peak_flops_source"] == "peak_flops=" and run["mfu_note"] is None
    assert run["flops_per_batch"] > 0  # BoringModel: a 32 -> 2 linear layer on 2 x 32 inputs
    timed = [s for s in steps if s["step_time_s"]]
    assert timed and all(
        s["mfu"] == pytest.approx(run["flops_per_batch"] / s["step_time_s"] / 1e12) for s in timed
    )


def test_without_override_cpu_runs_have_no_mfu_and_no_note(tmp_path):
    report = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False)
    pl.Trainer(max_steps=3, callbacks=[report], **TRAINER_QUIET).fit(BoringModel())
    assert report.report["run"]["peak_flops"] is None and report.report["run"]["mfu_note"] is None
    assert all(s["mfu"] is None for s in report.report["steps"])


@pytest.mark.parametrize("bad", [0, -1.0, "1e12", True], ids=["zero", "negative", "string", "bool"])
def test_bad_peak_flops_is_refused(bad):
    with pytest.raises(ValueError, match="`peak_flops` must be a positive number"):
        GPUOptReport(peak_flops=bad)


@pytest.mark.cuda
def test_on_a_known_gpu_the_report_has_an_mfu(tmp_path):
    name = torch.cuda.get_device_name(0)
    if peak_flops_of(name) is None:
        pytest.skip(f"{name} is not in the peak-FLOPs table")
    report = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False)
    trainer_args = {**TRAINER_QUIET, "accelerator": "cuda", "precision": "bf16-mixed"}
    pl.Trainer(max_steps=4, callbacks=[report], **trainer_args).fit(BoringModel())
    assert report.report["run"]["peak_flops"] == device_peak_flops(name, "bf16-mixed")
    assert any(s["mfu"] for s in report.report["steps"])


def test_the_table_is_kept_while_lightnings_misses_or_misreads_boards(monkeypatch):
    """Why the pack keeps its own table (docs/architecture.md, "Automation and what it pays"): for bf16 Lightning's
    `get_available_flops` has no figure for 3 of the table's boards and a wrong one for 3 more. When this test
    fails, Lightning caught up: use its table and drop ours."""
    import warnings

    from lightning.fabric.utilities import throughput

    current = [""]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: current[0])
    differs = {}
    for name in DATASHEET:
        current[0] = name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning warns where it has no figure
            theirs = throughput.get_available_flops(torch.device("cuda", 0), torch.bfloat16)
        ours = peak_flops_of(name).bf16
        if theirs is None or abs(theirs / ours - 1) > 0.01:
            differs[name] = None if theirs is None else round(theirs / ours, 2)
    assert differs == {
        "NVIDIA H200": None,
        "NVIDIA H200 NVL": None,
        "NVIDIA B200": None,
        "NVIDIA H100 NVL": 2.37,  # the sparse figure
        "NVIDIA L40S": 0.33,  # the L4's
        "NVIDIA GeForce RTX 4090": 0.5,
    }
