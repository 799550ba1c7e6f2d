from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gpuopt.memory import format_bytes
from lightning_gpuopt.oom_policy import (
    OOMFailure,
    grow_back_micro_batch_count,
    next_micro_batch_count,
    parse_tried_bytes,
    recently_failed_size,
)
from lightning_gpuopt.votes import Status, Vote, agree, rung_bits, rung_indices


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


_EVERY_UNIT = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_EVERY_UNIT |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


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
        ("Tried to allocate 512 B", 512),
        *((f"Tried to allocate 3 {unit}", 3 * scale) for unit, scale in _EVERY_UNIT.items()),
        ("Tried to allocate 1.5 kb", 1500),
        ("Tried to allocate 0 bytes", None),
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
def test_never_a_size_that_already_failure(smallest_failed):
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
    from lightning_gpuopt.votes import Vote, agree

    assert agree([Vote(0, 3), Vote(0, 3)], k=3) == agree([Vote(0, 3)], k=3)
    assert not agree([Vote(0, 3), Vote(0, 3)], k=3).retry and agree([Vote(0, 3)], k=3).source == ""


def test_agreement_one_oom_makes_every_rank_retry_with_the_most_cautious_k():
    from lightning_gpuopt.votes import STATUS_OOM, Vote, agree, rung_bits

    a = agree([Vote(0, 2), Vote(STATUS_OOM, 5), Vote(STATUS_OOM, 4)], k=2)
    assert (a.retry, a.k, a.ranks, a.source, a.rungs) == (True, 5, (1, 2), "oom", ())
    # The rungs any out-of-memory rank asked for, every rank turns on: the union, in ladder order.
    votes = [Vote(STATUS_OOM | rung_bits([1]), 1), Vote(0, 8), Vote(STATUS_OOM | rung_bits([0, 1]), 8)]
    assert agree(votes, k=8).rungs == (0, 1)
    assert agree([Vote(rung_bits([0]), 8), Vote(0, 8)], k=8).rungs == ()  # no OOM: nothing to turn on


def test_agreement_fatal_anywhere_stops_everyone():
    from lightning_gpuopt.votes import STATUS_FATAL, STATUS_OOM, Vote, agree

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
    from lightning_gpuopt.votes import Vote, agree

    a = agree([Vote(*v) for v in votes], k=k)
    assert (a.k, a.source, a.ranks) == expected and not a.retry


@pytest.mark.parametrize(
    ("votes", "k", "expected"),
    [
        ([(1, 2), (1, 4)], 1, (4, (0, 1))),  # rank 0 needs k 2, rank 1 k 4: both run 4
        ([(1, 4), (1, 2)], 1, (4, (0, 1))),
        ([(1, 8), (0, 1), (1, 3), (0, 1)], 1, (8, (0, 2))),  # ranks without an OOM retry too, at 8
        ([(1, 3), (8, 1)], 2, (3, (0,))),  # one rank could grow back, another ran out: the OOM wins
        ([(1, 3), (16, 9)], 2, (3, (0,))),  # a thrashing rank's next-batch proposal does not set the retry
    ],
    ids=["2-vs-4", "4-vs-2", "four-ranks", "oom-beats-grow", "oom-beats-thrash"],
)
def test_ranks_out_of_memory_at_once_agree_on_the_largest_k(votes, k, expected):
    a = agree([Vote(*v) for v in votes], k=k)
    assert (a.retry, a.source, a.fatal_ranks) == (True, "oom", ())
    assert (a.k, a.ranks) == expected


#: A rank's flags: fine, an OOM (with the recovery rungs it asks for), fatal, grow back, thrash, or skip.
_status = st.sampled_from([0, 1, 2, 8, 16, 32]).flatmap(
    lambda s: st.just(s) if s != 1 else st.sets(st.integers(0, 2)).map(lambda r: 1 | int(rung_bits(r)))
)


@settings(derandomize=True, deadline=None, max_examples=200)
@given(
    votes=st.lists(st.tuples(_status, st.integers(1, 64)), min_size=1, max_size=6),
    k=st.integers(1, 64),
    order=st.randoms(use_true_random=False),
)
def test_the_agreement_over_ranks_with_different_proposals(votes, k, order):
    """Any fatal vote stops every rank; else any OOM retries on every rank with a k at least each OOM-ing rank's
    proposal and with every rung any of them asked for; the rank order does not change the decision."""
    a = agree([Vote(*v) for v in votes], k=k)
    shuffled = list(votes)
    order.shuffle(shuffled)
    b = agree([Vote(*v) for v in shuffled], k=k)
    assert (a.retry, a.k, a.rungs, a.source, a.skip) == (b.retry, b.k, b.rungs, b.source, b.skip)
    fatal = [r for r, (status, _) in enumerate(votes) if status & Status.FATAL]
    oom = [r for r, (status, _) in enumerate(votes) if status & Status.OOM]
    if fatal:
        assert a.fatal_ranks == tuple(fatal) and not a.retry
        return
    assert a.retry == bool(oom)
    if oom:
        assert a.k in [votes[r][1] for r in oom] and all(a.k >= votes[r][1] for r in oom)
        assert a.ranks == tuple(oom)
        assert set(a.rungs) == {i for r in oom for i in rung_indices(votes[r][0])}
        return
    proposals = [kv if status & (Status.GROW | Status.THRASH) else k for status, kv in votes]
    assert a.k == max(proposals)  # shrinks only when every rank can, grows when any rank must
    assert a.skip == any(status & Status.SKIP for status, _ in votes)


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
        (6, 10, 300, 350, None, None, None),  # room for 2 samples, as now: no k that keeps the same size
    ],
    ids=["room", "plenty", "no-room", "failed-recently", "budget-cap", "k1", "flat", "same-size"],
)
def test_grow_back_prediction(k, n, peak, limit, below, cap, expected):
    from lightning_gpuopt.oom_policy import grow_back_micro_batch_count

    got = grow_back_micro_batch_count(k, n, 100, peak, limit, 0.9, below, cap)
    assert got == expected
    if got is not None:  # never a size at or above one that failed, never above the cap
        size = math.ceil(n / got)
        assert below is None or size < below
        assert cap is None or size <= cap


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.integers(1, n), st.just(n))))
def test_smaller_micro_batch_count_is_the_next_k_that_shrinks_the_micro_batch(k_and_n):
    """The smallest k' > k whose largest micro-batch is smaller (k's own when nothing is smaller)."""
    from lightning_gpuopt.oom_policy import smaller_micro_batch_count

    k, n = k_and_n
    new = smaller_micro_batch_count(k, n)
    if k == n:
        assert new == n
        return
    assert k < new <= n
    assert math.ceil(n / new) < math.ceil(n / k)
    assert all(math.ceil(n / j) == math.ceil(n / k) for j in range(k + 1, new))  # none smaller was skipped


# ---------------------------------------------------------------------------- the next k after several failures
#
# A batch's attempts as the engine runs them (issue 34): each failure hands ``next_micro_batch_count`` the
# smallest size that failed so far and the largest per-sample cost any failure of the batch showed, until a
# micro-batch fits or the function gives up (``None``: OOMRecovery then tries a recovery rung or raises
# MicroBatchOOMError). Memory follows an affine model: a micro-batch of s samples needs
# base + (gradients when k > 1) + per_sample × s.


@dataclass(frozen=True)
class Memory:
    """A device on which a micro-batch of ``s`` samples needs ``base + gradients·[k > 1] + per_sample·s`` bytes."""

    base: int
    gradients: int
    per_sample: int
    limit: int
    figures: bool  # whether the OOM says what it tried to allocate and the probe what was allocated

    def needs(self, s: int, k: int) -> int:
        return self.base + (self.gradients if k > 1 else 0) + self.per_sample * s

    def failure(self, n: int, k: int) -> OOMFailure:
        s = math.ceil(n / k)
        held = self.gradients if k > 1 else 0
        # The allocation that failed came after part of the micro-batch's activations were made.
        allocated = self.base + held + self.per_sample * s // 2
        figures = self.figures
        return _failure(
            batch_size=n,
            k=k,
            micro_batch_size=s,
            baseline_bytes=self.base,
            allocated_bytes=allocated if figures else None,
            tried_bytes=self.needs(s, k) - allocated if figures else None,
            limit_bytes=self.limit if figures else None,
            gradient_bytes=self.gradients if figures else None,
            held_gradient_bytes=held if figures else None,
        )


def _attempts(memory: Memory, n: int, k: int, min_size: int) -> tuple[list[int], bool]:
    """The k of each attempt at a batch of ``n`` starting at ``k``, and whether the last one fit."""
    ks, smallest_failed, per_sample = [k], n + 1, 0.0
    while memory.needs(math.ceil(n / k), k) > memory.limit:
        failure = memory.failure(n, k)
        smallest_failed = min(smallest_failed, failure.micro_batch_size)
        per_sample = max(per_sample, failure.per_sample_bytes or 0.0)
        k = next_micro_batch_count(failure, smallest_failed, min_size=min_size, per_sample_bytes=per_sample)
        if k is None:
            return ks, False
        ks.append(k)
        assert len(ks) <= n + 1, ks  # every attempt shrinks the micro-batch: at most n of them
    return ks, True


memories = st.builds(
    Memory,
    base=st.integers(0, 10**6),
    gradients=st.integers(0, 10**5),
    per_sample=st.integers(1, 10**4),
    limit=st.integers(1, 3 * 10**6),
    figures=st.booleans(),
)


@settings(derandomize=True, deadline=None, max_examples=300)
@given(memory=memories, n=st.integers(1, 300), start=st.integers(1, 300), min_size=st.integers(1, 3))
def test_attempts_after_failures_at_several_sizes(memory, n, start, min_size):
    """Each retry: more micro-batches, each smaller than every size that failed, never more than the batch has
    samples nor fewer samples than ``min_size``; the attempts end at a size that fits, or give up only at the
    smallest split (k = n at ``min_size`` 1), and never while a split could fit."""
    k0 = min(start, max(1, n // min_size))
    ks, fit = _attempts(memory, n, k0, min_size)
    sizes = [math.ceil(n / k) for k in ks]
    assert all(a < b for a, b in itertools.pairwise(ks)), ks  # monotonic
    assert all(a > b for a, b in itertools.pairwise(sizes)), sizes  # never a size that already failed
    assert all(k <= n and n // k >= min_size for k in ks[1:]), (ks, n, min_size)
    smallest_split = max(1, n // min_size)  # the most micro-batches that keep min_size samples each
    if not fit:  # the documented give-up: the smallest micro-batch that keeps min_size samples failed
        assert sizes[-1] == math.ceil(n / smallest_split), (ks, sizes)
        if min_size == 1:
            assert ks[-1] == n
        # every split with at least min_size samples a micro-batch was tried or is larger than one that failed
        assert all(memory.needs(math.ceil(n / k), k) > memory.limit for k in range(k0, smallest_split + 1))


@settings(derandomize=True, deadline=None, max_examples=300)
@given(memory=memories, n=st.integers(2, 300), start=st.integers(1, 300), min_size=st.integers(1, 3))
def test_one_retry_at_the_largest_micro_batch_that_fits_when_the_figures_say(memory, n, start, min_size):
    """With the figures of the failure (what was allocated, what it asked for, the gradients), the retry takes
    the largest micro-batch that fits under ``headroom`` (0.9) × the limit at once, not by halving; when none
    fits there, the smallest one allowed."""
    memory = Memory(memory.base, memory.gradients, memory.per_sample, memory.limit, figures=True)
    k0 = min(start, max(1, n // min_size))
    size0 = math.ceil(n / k0)
    if memory.needs(size0, k0) <= memory.limit:
        return  # the first attempt fits: no retry
    split_sizes = {math.ceil(n / j) for j in range(k0 + 1, n // min_size + 1)} - {size0}
    allowed = sorted(s for s in split_sizes if s < size0)
    room = (memory.limit * 0.9 - memory.base - memory.gradients) // memory.per_sample
    fitting = [s for s in allowed if s <= room]
    ks, _ = _attempts(memory, n, k0, min_size)
    if not allowed:
        assert ks == [k0]
        return
    assert math.ceil(n / ks[1]) == (max(fitting) if fitting else allowed[0]), (ks, fitting, allowed)
    if fitting:
        assert len(ks) == 2  # it fits


def test_a_later_failure_of_the_batch_remembers_the_largest_cost_seen():
    """A failure shows at least what a sample costs; an earlier failure of the same batch that showed more
    (it got further) sets the prediction: a smaller micro-batch."""
    # 64 samples whole: 10 B a sample shown, 250 B under 0.9 x 2500 beside 1000 B baseline and 1000 B gradients.
    f = _failure(
        batch_size=64,
        micro_batch_size=64,
        baseline_bytes=1000,
        allocated_bytes=1320,
        tried_bytes=320,
        limit_bytes=2500,
        gradient_bytes=1000,
        held_gradient_bytes=0,
    )
    assert f.per_sample_bytes == 10
    assert next_micro_batch_count(f, 64) == 3  # 25 samples -> k 3 (22)
    assert next_micro_batch_count(f, 64, per_sample_bytes=5.0) == 3  # a smaller cost seen before: no change
    assert next_micro_batch_count(f, 64, per_sample_bytes=40.0) == 11  # 6 samples -> k 11 (6)


@settings(derandomize=True, deadline=None, max_examples=300)
@given(
    memory=memories,
    n=st.integers(2, 300),
    k=st.integers(1, 300),
    min_size=st.integers(1, 3),
    earlier=st.integers(1, 300),
    cost=st.floats(0, 10**5),
)
def test_next_k_with_a_memory_of_failures(memory, n, k, min_size, earlier, cost):
    """Whatever the failures before (the smallest size that failed, the largest per-sample cost seen): the next
    micro-batch is smaller than each of them, within the batch and at least ``min_size`` samples; ``None`` only
    when no such micro-batch exists."""
    k = min(k, n)
    failure = memory.failure(n, k)
    smallest_failed = min(failure.micro_batch_size, earlier)
    new = next_micro_batch_count(failure, smallest_failed, min_size=min_size, per_sample_bytes=cost)
    possible = [j for j in range(k + 1, n + 1) if math.ceil(n / j) < smallest_failed and n // j >= min_size]
    if new is None:
        assert possible == [], (n, k, smallest_failed, min_size, possible)
        return
    assert new in possible, (n, k, smallest_failed, min_size, new)
    # a worse memory of failures never asks for fewer micro-batches
    worse = next_micro_batch_count(failure, smallest_failed, min_size=min_size, per_sample_bytes=cost * 2 + 1)
    assert worse is not None and worse >= new


@pytest.mark.parametrize(
    ("n", "min_size", "expected"),
    [
        (64, 1, [1, 2, 4, 8, 16, 32, 64]),  # without figures k doubles, down to micro-batches of 1
        (64, 1, [3, 6, 11, 22, 32, 64]),  # from k 3 (22 samples): 11, 6, 3, 2, 1
        (10, 1, [1, 2, 4, 5, 10]),  # 10, 5, 3 (k 4: 3,3,2,2), 2, 1
        (7, 1, [1, 2, 4, 7]),  # 7, 4, 2 (k 4: 2,2,2,1), 1
        (10, 2, [1, 2, 4, 5]),  # 2 samples: BatchNorm's smallest micro-batch
        (10, 3, [1, 2, 3]),  # k 3: 4,3,3; k 4 would make micro-batches of 2
        (9, 2, [1, 2, 3]),  # 9, 5, 3; k 4 (3,2,2,2) is no smaller, k 5 has a micro-batch of 1
        (5, 2, [1, 2]),  # 5, 3; k 3 would make a micro-batch of 1
        (3, 2, [1]),  # no split keeps 2 samples a micro-batch
        (1, 1, [1]),
    ],
)
def test_the_k_of_each_attempt_when_every_attempt_fails(n, min_size, expected):
    """Without figures (an OOM message that says nothing, a probe that measures nothing), every attempt failing:
    the k of each attempt, then the give-up (``None``) once no smaller micro-batch of ``min_size`` is left."""
    memory = Memory(base=0, gradients=0, per_sample=1, limit=0, figures=False)
    ks, fit = _attempts(memory, n, expected[0], min_size)
    assert (ks, fit) == (expected, False)


def test_the_names_that_moved_out_still_import_from_here_with_a_warning():
    import lightning_gpuopt.oom_policy as oom_policy
    from lightning_gpuopt import oom_record, votes

    with pytest.warns(DeprecationWarning, match=r"oom_policy\.Vote moved to lightning_gpuopt\.votes\.Vote"):
        assert oom_policy.Vote is votes.Vote
    with pytest.warns(DeprecationWarning, match="moved to lightning_gpuopt.oom_record.OOMRecord"):
        from lightning_gpuopt.oom_policy import OOMRecord
    assert OOMRecord is oom_record.OOMRecord
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        oom_policy.nothing  # noqa: B018


def test_the_per_sample_cost_leaves_out_the_gradients_held():
    assert _failure(held_gradient_bytes=60).per_sample_bytes == (5000 + 3000 - 1000 - 60) / 64


def test_gradients_without_a_per_sample_figure_change_nothing():
    """The gradients' size alone (no figure of those held at the OOM) does not enter the prediction."""
    assert next_micro_batch_count(_failure(gradient_bytes=50), 64) == next_micro_batch_count(_failure(), 64)


def test_a_split_whose_micro_batch_min_size_holds_at_a_failed_size_is_refused():
    """min_size 10 caps k at 6 (micro-batches of 11): 10 samples failed before, so nothing is left."""
    assert (
        next_micro_batch_count(_failure(allocated_bytes=None), smallest_failed_size=10, min_size=10) is None
    )
    assert next_micro_batch_count(_failure(allocated_bytes=None), smallest_failed_size=12, min_size=10) == 6


def test_a_failure_exactly_window_steps_back_is_recent_and_the_smallest_recent_size_wins():
    assert recently_failed_size({64: 35}, step=45, window=10) == 64
    assert recently_failed_size({64: 40, 32: 42, 16: 30}, step=45, window=10) == 32


def test_grow_back_from_two_micro_batches_to_one_and_below_a_failed_size():
    assert grow_back_micro_batch_count(2, 128, baseline_bytes=100, peak_bytes=420, limit_bytes=1000) == 1
    assert grow_back_micro_batch_count(4, 128, 100, 420, 1000, below_size=65) == 2  # 64 samples: below 65


def test_the_status_bits_are_distinct_single_bits():
    """A rank's say travels as one int: each flag must be a bit of its own to be read back."""
    bits = [int(s) for name, s in Status.__members__.items() if name != "NONE"]  # aliases and composites too
    assert all(b & (b - 1) == 0 for b in bits) and len(set(bits)) == len(bits)
