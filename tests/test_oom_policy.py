from __future__ import annotations

import math

import pytest

from lightning_gpuopt.memory import format_bytes
from lightning_gpuopt.oom_policy import OOMFailure, next_micro_batch_count, parse_tried_bytes


def _failure(**overrides) -> OOMFailure:
    values = dict(step=0, batch_idx=0, phase="forward", batch_size=64, k=1, micro_batch_size=64,
                  baseline_bytes=1000, allocated_bytes=5000, tried_bytes=3000, limit_bytes=6000, message="")
    values.update(overrides)
    return OOMFailure(**values)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity)", 2 * 2**30),
        ("CUDA out of memory (simulated). Tried to allocate 16.00 KiB (16384 bytes); 1.2 MiB in use", 16 * 2**10),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512 MiB", 512 * 2**20),
        ("Tried to allocate 100 bytes", 100),
        ("CUDA error: out of memory", None),
        ("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)", None),
    ],
)
def test_parse_tried_bytes(message, expected):
    assert parse_tried_bytes(message) == expected


def test_demand_is_what_the_attempt_held_plus_what_it_asked_for():
    assert _failure().demand_bytes == 5000 + 3000 - 1000
    assert _failure(tried_bytes=None).demand_bytes is None


def test_prediction_from_the_failure_figures():
    # 7000 B over 64 samples = 109.4 B/sample; 0.9 * 6000 - 1000 = 4400 B free -> 40 samples -> k 2
    assert next_micro_batch_count(_failure(), smallest_failed_size=64) == 2
    # a much larger demand predicts a much smaller micro-batch in one go, not by halving
    k = next_micro_batch_count(_failure(allocated_bytes=40_000), smallest_failed_size=64)
    assert k == math.ceil(64 / (4400 // ((40_000 + 3000 - 1000) / 64)))
    assert k > 4


def test_without_figures_k_doubles():
    f = _failure(k=2, micro_batch_size=32, allocated_bytes=None, tried_bytes=None, limit_bytes=None)
    assert next_micro_batch_count(f, smallest_failed_size=32) == 4


@pytest.mark.parametrize("smallest_failed", [64, 40, 17, 2])
def test_never_a_size_that_already_failed(smallest_failed):
    f = _failure(allocated_bytes=1001, tried_bytes=1)  # figures that would predict the whole batch fits
    k = next_micro_batch_count(f, smallest_failed_size=smallest_failed)
    assert math.ceil(64 / k) < smallest_failed
    assert k > f.k


def test_gives_up_at_one_sample():
    assert next_micro_batch_count(_failure(k=64, micro_batch_size=1), smallest_failed_size=1) is None


def test_k_never_exceeds_the_batch():
    f = _failure(batch_size=5, micro_batch_size=5, allocated_bytes=10**9)
    assert next_micro_batch_count(f, smallest_failed_size=5) == 5


def test_format_bytes():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(5 * 2**40) == "5.00 TiB"
