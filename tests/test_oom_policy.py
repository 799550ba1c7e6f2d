from __future__ import annotations

import math

import pytest

from lightning_gpuopt.memory import format_bytes
from lightning_gpuopt.oom_policy import OOMFailure, next_micro_batch_count, parse_tried_bytes


def _failure(**overrides) -> OOMFailure:
    values = dict(
        step=0,
        batch_idx=0,
        phase="forward",
        batch_size=64,
        k=1,
        micro_batch_size=64,
        baseline_bytes=1000,
        allocated_bytes=5000,
        tried_bytes=3000,
        limit_bytes=6000,
        message="",
    )
    values.update(overrides)
    return OOMFailure(**values)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity)", 2 * 2**30),
        (
            "CUDA out of memory (simulated). Tried to allocate 16.00 KiB (16384 bytes); 1.2 MiB in use",
            16 * 2**10,
        ),
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


# ---------------------------------------------------------------------------- ranks agree


def test_agreement_everyone_fine_keeps_k():
    from lightning_gpuopt.oom_policy import Vote, agree

    assert agree([Vote(0, 3), Vote(0, 3)], k=3) == agree([Vote(0, 3)], k=3)
    assert not agree([Vote(0, 3), Vote(0, 3)], k=3).retry and agree([Vote(0, 3)], k=3).source == ""


def test_agreement_one_oom_makes_every_rank_retry_with_the_most_cautious_k():
    from lightning_gpuopt.oom_policy import STATUS_OOM, Vote, agree, rung_bits

    a = agree([Vote(0, 2), Vote(STATUS_OOM, 5), Vote(STATUS_OOM, 4)], k=2)
    assert (a.retry, a.k, a.ranks, a.source, a.rungs) == (True, 5, (1, 2), "oom", ())
    # The rungs any out-of-memory rank asked for, every rank turns on: the union, in ladder order.
    votes = [Vote(STATUS_OOM | rung_bits([1]), 1), Vote(0, 8), Vote(STATUS_OOM | rung_bits([0, 1]), 8)]
    assert agree(votes, k=8).rungs == (0, 1)
    assert agree([Vote(rung_bits([0]), 8), Vote(0, 8)], k=8).rungs == ()  # no OOM: nothing to turn on


def test_agreement_fatal_anywhere_stops_everyone():
    from lightning_gpuopt.oom_policy import STATUS_FATAL, STATUS_OOM, Vote, agree

    a = agree([Vote(STATUS_OOM, 4), Vote(STATUS_FATAL, 64)], k=2)
    assert a.fatal_ranks == (1,) and not a.retry


@pytest.mark.parametrize(
    ("votes", "k", "expected"),
    [
        (
            [(8, 1), (8, 2)],
            4,
            (2, "grow back", (0, 1)),
        ),  # both can grow: the larger proposal (smaller step) wins
        ([(8, 1), (0, 4)], 4, (4, "", ())),  # rank 1 cannot grow: nobody does
        ([(16, 5), (8, 1)], 4, (5, "thrash", (0,))),  # thrashing anywhere splits everywhere
    ],
    ids=["all-grow", "one-cannot", "thrash-wins"],
)
def test_agreement_on_the_next_k(votes, k, expected):
    from lightning_gpuopt.oom_policy import Vote, agree

    a = agree([Vote(*v) for v in votes], k=k)
    assert (a.k, a.source, a.ranks) == expected and not a.retry


# ---------------------------------------------------------------------------- growing back


@pytest.mark.parametrize(
    ("k", "n", "peak", "limit", "below", "cap", "expected"),
    [
        (4, 128, 420, 1000, None, None, 2),  # 10 B/sample, 800 B budget above the 100 B start -> 80 samples
        (4, 128, 420, 10_000, None, None, 1),  # plenty: the whole batch
        (4, 128, 420, 500, None, None, None),  # 350 B budget: 35 samples, not more than 32 now
        (4, 128, 420, 1000, 64, None, 3),  # 64 failed recently: at most 63 -> k 3 (43 samples)
        (4, 128, 420, 10_000, None, 48, 3),  # a measured budget caps at 48 -> k 3
        (1, 128, 420, 10_000, None, None, None),  # nothing smaller than 1
        (4, 128, 100, 1000, None, None, 1),  # the step added nothing: the whole batch
    ],
    ids=["room", "plenty", "no-room", "failed-recently", "budget-cap", "k1", "flat"],
)
def test_grow_back_prediction(k, n, peak, limit, below, cap, expected):
    from lightning_gpuopt.oom_policy import grow_back_micro_batch_count

    got = grow_back_micro_batch_count(k, n, 100, peak, limit, 0.9, below, cap)
    assert got == expected
    if got is not None:  # never a size at or above one that failed, never above the cap
        size = math.ceil(n / got)
        assert below is None or size < below
        assert cap is None or size <= cap


@pytest.mark.parametrize(("k", "n"), [(1, 10), (3, 10), (2, 5), (9, 10), (10, 10)])
def test_smaller_micro_batch_count_always_shrinks_the_micro_batch(k, n):
    from lightning_gpuopt.oom_policy import smaller_micro_batch_count

    new = smaller_micro_batch_count(k, n)
    assert new <= n
    assert new > k or k == n
    if k < n:
        assert math.ceil(n / new) < math.ceil(n / k)
