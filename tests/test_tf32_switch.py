"""The global TF32 switch: turned on only where nothing chose, restored exactly (both torch APIs)."""

import pytest
import torch

from lightning_gpuopt import precision, tf32_switch
from lightning_gpuopt.tf32_switch import restore_tf32, turn_on_tf32


@pytest.fixture
def tf32_untouched():
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision if tf32_switch._new_tf32_api() else matmul.allow_tf32
    yield
    if isinstance(saved, str):
        matmul.fp32_precision = saved
    else:
        matmul.allow_tf32 = saved


@pytest.mark.usefixtures("tf32_untouched")
def test_tf32_through_the_new_api_and_restored():
    if not tf32_switch._new_tf32_api():
        pytest.skip(f"torch {torch.__version__} has no torch.backends.cuda.matmul.fp32_precision")
    matmul = torch.backends.cuda.matmul
    assert matmul.fp32_precision == "none"
    previous = turn_on_tf32()
    assert matmul.fp32_precision == "tf32" and previous == "none"
    restore_tf32(previous)
    assert matmul.fp32_precision == "none"
    assert torch.get_float32_matmul_precision() == "highest"  # no mix of APIs left behind
    matmul.fp32_precision = "ieee"  # someone chose: leave it
    assert turn_on_tf32() is None and matmul.fp32_precision == "ieee"


@pytest.mark.usefixtures("tf32_untouched")
def test_tf32_through_the_legacy_flag_on_old_torch(monkeypatch):
    monkeypatch.setattr(tf32_switch, "_new_tf32_api", lambda: False)
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "none"
    previous = turn_on_tf32()
    assert previous is False and matmul.allow_tf32 is True
    assert turn_on_tf32() is None  # already on
    restore_tf32(previous)
    assert matmul.allow_tf32 is False
    restore_tf32(None)  # nothing changed: nothing to undo


def test_old_names_in_precision_warn_and_still_work():
    with pytest.warns(DeprecationWarning, match=r"lightning_gpuopt\.tf32_switch\.turn_on_tf32"):
        old = precision.enable_tf32
    assert old is turn_on_tf32
    with pytest.warns(DeprecationWarning, match="restore_tf32"):
        assert precision.restore_tf32 is restore_tf32
