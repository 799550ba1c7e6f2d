"""The pure rules behind PrecisionSwitch: the selection table, the ladder, the watch, TF32, the gradient check."""

from __future__ import annotations

import doctest

import pytest
import torch

import lightning_gpuopt.precision as precision_module
from lightning_gpuopt.precision import (
    LADDER,
    DeviceInfo,
    StabilityWatch,
    StepOutcome,
    any_nonfinite,
    check_ladder,
    choose_precision,
    device_info,
    fallback_ladder,
    faster_rung,
    grads_nonfinite,
    precision_index,
    tf32_wanted,
    unsupported_reason,
)


def cuda(
    major: int, minor: int, name: str = "GPU", hip: bool = False, bf16: bool | None = None
) -> DeviceInfo:
    """A CUDA device as device_info() reports it: native bf16 from sm 8.0 on (NVIDIA)."""
    native = (major, minor) >= (8, 0) if bf16 is None else bf16
    return DeviceInfo("cuda", name, (major, minor), bf16=native, fp16_autocast=True, hip=hip)


CPU = DeviceInfo("cpu", "CPU", None, bf16=True, fp16_autocast=True)


# ----------------------------------------------------------------------------- the selection table


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (cuda(3, 7, "Tesla K80"), "32-true"),
        (cuda(5, 2, "Tesla M60"), "32-true"),
        (cuda(6, 0, "Tesla P100"), "32-true"),
        (cuda(6, 1, "GTX 1080 Ti"), "32-true"),
        (cuda(7, 0, "Tesla V100"), "16-mixed"),
        (cuda(7, 5, "Tesla T4"), "16-mixed"),
        (cuda(8, 0, "A100"), "bf16-mixed"),
        (cuda(8, 6, "RTX 3090"), "bf16-mixed"),
        (cuda(8, 9, "L4"), "bf16-mixed"),
        (cuda(9, 0, "H100"), "bf16-mixed"),
        (cuda(10, 0, "B200"), "bf16-mixed"),
        (cuda(12, 0, "RTX 5090"), "bf16-mixed"),
        (cuda(9, 0, "AMD MI250X", hip=True, bf16=True), "bf16-mixed"),
        (cuda(9, 0, "AMD MI50", hip=True, bf16=False), "16-mixed"),
        (CPU, "32-true"),
        (DeviceInfo("mps", "MPS", bf16=True, fp16_autocast=True), "16-mixed"),
        (DeviceInfo("mps", "MPS", bf16=False, fp16_autocast=False), "32-true"),
        (DeviceInfo("xpu", "XPU", bf16=False, fp16_autocast=False), "32-true"),
    ],
    ids=lambda v: v.label.replace(" ", "_") if isinstance(v, DeviceInfo) else v,
)
def test_selection_table(info, expected):
    assert choose_precision(info).precision == expected


def test_cpu_bf16_is_opt_in():
    assert choose_precision(CPU, cpu_bf16=True).precision == "bf16-mixed"
    assert choose_precision(cuda(7, 0), cpu_bf16=True).precision == "16-mixed"  # a CPU-only switch


@pytest.mark.parametrize(
    ("info", "installed", "expected", "said"),
    [
        (cuda(8, 9, "L4"), True, "transformer-engine", "fp8 asked for"),
        (cuda(9, 0, "H100"), True, "transformer-engine", "sm >= 8.9"),
        (cuda(8, 0, "A100"), True, "bf16-mixed", "older than sm_89"),
        (cuda(9, 0, "H100"), False, "bf16-mixed", "not installed"),
        (cuda(9, 4, "MI300X", hip=True, bf16=True), True, "bf16-mixed", "older than sm_89"),
    ],
    ids=["sm89", "sm90", "sm80-too-old", "not-installed", "rocm"],
)
def test_fp8_only_when_asked_installed_and_sm89(info, installed, expected, said):
    choice = choose_precision(info, fp8=True, fp8_installed=installed)
    assert choice.precision == expected
    assert said in choice.reason
    assert choose_precision(info, fp8=False, fp8_installed=True).precision != "transformer-engine"


@pytest.mark.parametrize(
    ("info", "precision", "tf32", "expected"),
    [
        (cuda(8, 0), "32-true", True, True),
        (cuda(9, 0), "32-true", True, True),
        (cuda(8, 0), "32-true", False, False),
        (cuda(8, 0), "bf16-mixed", True, False),
        (cuda(7, 0), "32-true", True, False),
        (cuda(9, 0, hip=True), "32-true", True, False),
        (CPU, "32-true", True, False),
    ],
    ids=["sm80", "sm90", "told-not-to", "not-fp32", "sm70", "rocm", "cpu"],
)
def test_tf32_for_fp32_on_ampere_or_newer(info, precision, tf32, expected):
    assert tf32_wanted(info, precision, tf32) is expected


def _fake_cuda(monkeypatch, capability, emulation=True, hip=None, name="Fake GPU", kwarg=True):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    if kwarg:
        # what torch answers: emulation counts unless including_emulation=False
        def is_bf16_supported(including_emulation=True):
            return capability >= (8, 0) or (including_emulation and emulation)
    else:  # torch < 2.3: no including_emulation

        def is_bf16_supported():
            return True

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize("kwarg", [True, False], ids=["including_emulation", "old-torch"])
def test_device_info_decides_bf16_by_capability_not_emulation(monkeypatch, kwarg):
    _fake_cuda(monkeypatch, (7, 5), emulation=True, kwarg=kwarg)
    info = device_info("cuda:0")
    assert info.kind == "cuda" and info.capability == (7, 5) and info.name == "Fake GPU"
    assert info.bf16 is False  # torch.cuda.is_bf16_supported() alone says True (emulation)
    assert choose_precision(info).precision == "16-mixed"
    _fake_cuda(monkeypatch, (8, 0), kwarg=kwarg)
    assert device_info("cuda").bf16 is True


def test_device_info_names_rocm_and_cpu(monkeypatch):
    _fake_cuda(monkeypatch, (9, 0), hip="6.2", name="AMD Instinct MI250X")
    info = device_info(torch.device("cuda", 0))
    assert info.hip and info.label == "AMD Instinct MI250X (ROCm)"
    assert not tf32_wanted(info, "32-true")
    assert device_info("cpu") == CPU
    assert cuda(8, 0, "A100").label == "A100 (sm_80)"


# ----------------------------------------------------------------------------- the ladder


def test_unsupported_reason():
    assert unsupported_reason("bf16-mixed", cuda(7, 0, "V100")) == (
        "V100 (sm_70) has no native bfloat16 (emulated on sm_7.x: slower than float32)"
    )
    assert unsupported_reason("bf16-mixed", cuda(8, 0)) is None
    assert (
        unsupported_reason("16-mixed", DeviceInfo("mps", fp16_autocast=False))
        == "MPS has no float16 autocast"
    )
    assert unsupported_reason("32-true", DeviceInfo("xpu", fp16_autocast=False)) is None


@pytest.mark.parametrize(
    ("current", "rungs", "info", "expected"),
    [
        ("16-mixed", LADDER, cuda(8, 0), ("bf16-mixed", "32-true")),
        ("16-mixed", LADDER, cuda(7, 0), ("32-true",)),
        ("16-mixed", LADDER, CPU, ("bf16-mixed", "32-true")),
        ("16-mixed", ("16-mixed", "32-true"), cuda(8, 0), ("32-true",)),
        ("bf16-mixed", LADDER, cuda(8, 0), ("32-true",)),
        ("32-true", LADDER, cuda(8, 0), ()),
        ("16-mixed", ("16-mixed",), cuda(8, 0), ()),
        ("bf16-true", LADDER, cuda(8, 0), ()),
        ("64-true", LADDER, CPU, ()),
    ],
    ids=["a100", "v100-no-bf16", "cpu", "custom", "bf16", "bottom", "one-rung", "true-half", "64"],
)
def test_fallback_ladder(current, rungs, info, expected):
    assert fallback_ladder(current, rungs, info) == expected


def test_faster_rung_goes_one_step_up_never_above_the_start():
    assert faster_rung("32-true", "16-mixed", LADDER, cuda(8, 0)) == "bf16-mixed"
    assert faster_rung("32-true", "16-mixed", LADDER, cuda(7, 0)) == "16-mixed"  # no bf16 on sm 7.0
    assert faster_rung("32-true", "16-mixed", ("16-mixed", "32-true"), cuda(8, 0)) == "16-mixed"
    assert faster_rung("bf16-mixed", "16-mixed", LADDER, cuda(8, 0)) == "16-mixed"
    assert faster_rung("32-true", "bf16-mixed", LADDER, cuda(8, 0)) == "bf16-mixed"
    assert faster_rung("16-mixed", "16-mixed", LADDER, cuda(8, 0)) is None
    assert faster_rung("32-true", "bf16-true", LADDER, cuda(8, 0)) is None


@pytest.mark.parametrize(
    ("ladder", "error", "match"),
    [
        ("16-mixed", TypeError, "sequence of precision names"),
        (["16-mixed", "fp16"], ValueError, r"names must be among .* got \['fp16'\]"),
        (["bf16-true"], ValueError, "keep float32 weights"),
        ([], ValueError, "at least one"),
        (["32-true", "32-true"], ValueError, "must not repeat"),
        (
            ["32-true", "16-mixed"],
            ValueError,
            r"fastest precision to the most stable one, \('16-mixed', '32-true'\)",
        ),
    ],
    ids=["string", "unknown", "true-half", "empty", "repeat", "order"],
)
def test_check_ladder_rejects(ladder, error, match):
    with pytest.raises(error, match=match):
        check_ladder(ladder)


def test_precision_index_is_a_fixed_table():
    assert [precision_index(p) for p in ("64-true", "32-true", "bf16-mixed", "16-mixed")] == [0, 1, 2, 3]
    assert precision_index("something-else") == -1


# ----------------------------------------------------------------------------- the watch


def skipped(loss_finite: bool, scale: float) -> StepOutcome:
    return StepOutcome(applied=False, scaler=True, loss_finite=loss_finite, scale=scale)


APPLIED = StepOutcome(applied=True)


def test_gradscaler_calibration_is_not_trouble():
    watch = StabilityWatch(patience=2, min_scale=1.0)
    scale = 65536.0
    for _ in range(10):  # overflowing gradients, finite loss: the scaler backs off, as designed
        scale /= 2
        assert watch.observe(skipped(True, scale)) is None
    assert watch.consecutive == 0 and watch.last_scale == scale
    assert watch.observe(APPLIED) is None and watch.last_scale is None


def test_nonfinite_loss_in_patience_steps_in_a_row_switches():
    watch = StabilityWatch(patience=3)
    assert watch.observe(skipped(False, 32768.0)) is None
    assert watch.observe(skipped(True, 16384.0)) is None  # a normal skip neither counts nor breaks the run
    assert watch.observe(skipped(False, 8192.0)) is None
    assert watch.armed()
    assert watch.observe(skipped(False, 4096.0)) == "the loss was not finite in 3 steps in a row"
    fresh = StabilityWatch(patience=3)
    fresh.observe(skipped(False, 1.0e4))
    fresh.observe(APPLIED)  # an applied step starts over
    assert fresh.consecutive == 0 and not fresh.armed()


def test_without_a_scaler_nonfinite_gradients_are_trouble():
    watch = StabilityWatch(patience=2)
    held = StepOutcome(applied=False, scaler=False, loss_finite=True)
    assert watch.observe(held) is None
    assert watch.verdict(held) == "the gradients were not finite in 2 steps in a row"
    assert watch.consecutive == 1  # verdict records nothing
    assert (
        StabilityWatch(patience=1).verdict(StepOutcome(False, False, False))
        == "the loss was not finite in 1 step in a row"
    )


def test_scale_below_min_scale_switches_and_arms_the_step_before():
    watch = StabilityWatch(patience=5, min_scale=5.0)
    assert watch.observe(skipped(True, 16.0)) is None
    assert not watch.armed(backoff=0.5)  # the next skip would leave 8 >= 5
    assert watch.observe(skipped(True, 8.0)) is None
    assert watch.armed(backoff=0.5) and not watch.armed(backoff=None)  # the next would leave 4 < 5
    reason = watch.observe(skipped(True, 4.0))
    assert reason.startswith("the loss scale fell to 4, below min_scale=5")
    watch.reset()
    assert watch.consecutive == 0 and watch.last_scale is None


# ----------------------------------------------------------------------------- torch-level helpers


def test_grads_nonfinite_finds_every_inf_and_nan_and_leaves_gradients_alone():
    big = torch.full((3,), 1e18)  # finite and large
    grads = [torch.randn(4, 4), big, torch.full((2,), 300.0, dtype=torch.float16), None]
    before = [g.clone() for g in grads[:3]]
    assert (
        grads_nonfinite(grads, torch.device("cpu")).item() == 0.0
    )  # float16's 300² would overflow in float16
    assert all(torch.equal(a, b) for a, b in zip(grads[:3], before))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            flagged = grads_nonfinite(
                [torch.ones(3), torch.tensor([1.0, bad], dtype=dtype)], torch.device("cpu")
            )
            assert flagged.item() == 1.0
    assert grads_nonfinite([torch.tensor([float("inf"), -float("inf")])], torch.device("cpu")).item() == 1.0
    # documented: a norm beyond float32 counts as not finite (never a false "finite")
    assert grads_nonfinite([torch.full((3,), 1e30)], torch.device("cpu")).item() == 1.0
    assert grads_nonfinite([], torch.device("cpu")).item() == 0.0
    cpu = torch.device("cpu")
    assert any_nonfinite([torch.tensor(1.0), torch.tensor(float("nan"))], cpu).item() == 1.0
    assert any_nonfinite([torch.tensor(1.0), torch.tensor(2.0, dtype=torch.float16)], cpu).item() == 0.0
    assert any_nonfinite([], cpu).item() == 0.0


def test_docstring_examples_run():
    result = doctest.testmod(precision_module)
    assert result.attempted > 0 and result.failed == 0


def test_precision_switchs_initial_choices_are_the_ladder_and_its_two_keywords():
    from typing import get_args

    from lightning_gpuopt.callbacks.precision_switch import Initial
    from lightning_gpuopt.precision import LADDER

    assert get_args(Initial) == ("auto", "keep", *LADDER)
