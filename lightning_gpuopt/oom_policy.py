"""Pure decisions behind OOM recovery: how many micro-batches to try next, when to grow back.

No Lightning and no device calls here: the micro-batch engine gathers the figures (from the memory
probe and the OOM message) and these functions decide, so every rule is unit-tested on its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._warnings import moved_names
from lightning_gpuopt.memory.units import parse_bytes

__all__ = [
    "OOMFailure",
    "Recovery",
    "allocator_thrashing",
    "grow_back_micro_batch_count",
    "next_micro_batch_count",
    "parse_tried_bytes",
    "recently_failed_size",
    "smaller_micro_batch_count",
    "smallest_split_cannot_fit",
]

_TRIED = re.compile(r"Tried to allocate\s+([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B|bytes)\b", re.IGNORECASE)


def parse_tried_bytes(message: str) -> int | None:
    """The size of the allocation that failed, from an OOM message, if the message says it.

    Example:
        >>> parse_tried_bytes("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.3 GiB total)")
        2147483648
        >>> parse_tried_bytes("CUBLAS_STATUS_ALLOC_FAILED") is None
        True
    """
    match = _TRIED.search(message)
    if match is None:
        return None
    number, unit = match.groups()
    try:
        return parse_bytes(number + ("B" if unit.lower() == "bytes" else unit))
    except ValueError:  # "0 bytes", or more than any device has: not a size to plan with
        return None


@dataclass(frozen=True)
class OOMFailure:
    """What is known about one failed attempt at a training step.

    Attributes:
        step: ``trainer.global_step`` when it failed.
        batch_idx: index of the batch in the epoch.
        phase: ``"forward"`` or ``"backward"``.
        batch_size: samples in the batch.
        k: micro-batches of the failed attempt.
        micro_batch_size: samples in the largest micro-batch of the failed attempt.
        baseline_bytes: memory allocated before the attempt (parameters, gradients, optimizer state, batch).
        allocated_bytes: memory allocated when the OOM was raised (``None`` when unknown).
        tried_bytes: size of the allocation that failed, from the message (``None`` when not stated).
        limit_bytes: memory this process may use (``None`` when unknown).
        message: the first line of the original error message.
        gradient_bytes: the gradients of every trainable parameter: every micro-batch after the first
            runs beside all of them (``None`` when unknown).
        held_gradient_bytes: the gradients that existed when the OOM was raised (``None`` when unknown).
    """

    step: int
    batch_idx: int
    phase: str
    batch_size: int
    k: int
    micro_batch_size: int
    baseline_bytes: int | None
    allocated_bytes: int | None
    tried_bytes: int | None
    limit_bytes: int | None
    message: str
    gradient_bytes: int | None = None
    held_gradient_bytes: int | None = None

    def decision_fields(self) -> dict[str, Any]:
        """What the decision log keeps of the failure (the data of its ``"oom"`` record)."""
        names = ("phase", "k", "micro_batch_size", "batch_size", "allocated_bytes", "limit_bytes")
        return {name: getattr(self, name) for name in names}

    @property
    def demand_bytes(self) -> int | None:
        """A lower bound on what the failed micro-batch needed above the baseline."""
        if None in (self.baseline_bytes, self.allocated_bytes, self.tried_bytes):
            return None
        return max(0, self.allocated_bytes + self.tried_bytes - self.baseline_bytes)

    @property
    def per_sample_bytes(self) -> float | None:
        """A lower bound on what one sample of a micro-batch costs: the demand above the baseline and the
        gradients held, per sample of the failed micro-batch (``None`` without figures)."""
        demand = self.demand_bytes
        if demand is None or self.held_gradient_bytes is None:
            return None
        return max(0, demand - self.held_gradient_bytes) / self.micro_batch_size


def smallest_split_cannot_fit(failure: OOMFailure, min_size: int = 1) -> int | None:
    """Bytes that a split into micro-batches of ``min_size`` samples needs at least, when that is over the limit.

    Every micro-batch after the first runs beside the baseline (parameters, optimizer state, the batch)
    and the gradients of every parameter; on top, each sample costs at least what the failed micro-batch
    held per sample (:attr:`OOMFailure.per_sample_bytes`, a lower bound when the cost is affine in the
    micro-batch size). When even ``min_size`` samples exceed the limit, no split can fit and retrying is
    futile. Returns that lower bound then; ``None`` when a split may fit or the figures are missing.

    Example:
        >>> f = OOMFailure(step=0, batch_idx=0, phase="forward", batch_size=64, k=1, micro_batch_size=64,
        ...     baseline_bytes=46, allocated_bytes=90, tried_bytes=2, limit_bytes=92, message="",
        ...     gradient_bytes=45, held_gradient_bytes=0)
        >>> smallest_split_cannot_fit(f, min_size=2)  # 46 + 45 + 2 x 46/64 > 92
        93
        >>> smallest_split_cannot_fit(f, min_size=1) is None  # 46 + 45 + 46/64 fits 92
        True
    """
    per_sample = failure.per_sample_bytes
    if (
        per_sample is None
        or failure.limit_bytes is None
        or failure.gradient_bytes is None
        or failure.baseline_bytes is None
    ):
        return None
    need = failure.baseline_bytes + failure.gradient_bytes + per_sample * min_size
    return math.ceil(need) if need > failure.limit_bytes else None


def next_micro_batch_count(
    failure: OOMFailure,
    smallest_failed_size: int,
    headroom: float = 0.9,
    min_size: int = 1,
    per_sample_bytes: float | None = None,
) -> int | None:
    """How many micro-batches to try after ``failure``; ``None`` when no split is left whose micro-batches are
    smaller than every size that failed and hold at least ``min_size`` samples.

    With figures from the probe and the message, the per-sample cost of the failed micro-batch
    (what it held when the allocation failed, plus the allocation) predicts the largest micro-batch
    that fits under ``headroom`` × limit. The cost is a lower bound (a later phase may need more), so
    the prediction is capped below every size that already failed; further failures refine it.
    Without figures, k doubles. The result always yields a micro-batch smaller than
    ``smallest_failed_size``.

    Args:
        failure: the failed attempt.
        smallest_failed_size: the smallest micro-batch size that has failed so far (this one included).
        headroom: fraction of the limit the prediction aims for.
        min_size: the smallest micro-batch the model can run (2 with BatchNorm in training mode): no
            micro-batch of the returned k has fewer samples.
        per_sample_bytes: the largest per-sample cost earlier failures of the same batch showed (each is a
            lower bound; a failure at a smaller size got further and shows more).

    Example:
        >>> f = OOMFailure(step=3, batch_idx=3, phase="forward", batch_size=64, k=1, micro_batch_size=64,
        ...     baseline_bytes=100, allocated_bytes=500, tried_bytes=300, limit_bytes=500, message="")
        >>> next_micro_batch_count(f, smallest_failed_size=64)  # 700/64 B per sample, 350 B free -> 32 samples
        2
    """
    n, size = failure.batch_size, failure.micro_batch_size
    largest_k = max(1, n // max(1, min_size))  # split_sizes: the smallest micro-batch has n // k samples
    target = min(size, smallest_failed_size) - 1  # never a size that failed
    demand = failure.demand_bytes
    if demand and failure.limit_bytes and failure.baseline_bytes is not None:
        available = failure.limit_bytes * headroom - failure.baseline_bytes
        per_sample = demand / size
        if failure.per_sample_bytes and failure.gradient_bytes is not None:
            # A split runs every micro-batch after the first beside all gradients: those are fixed, not per sample.
            available -= failure.gradient_bytes
            per_sample = max(failure.per_sample_bytes, per_sample_bytes or 0.0)
        target = max(1, min(target, int(available // per_sample)))  # nothing available: 1
    else:
        target = max(1, min(target, math.ceil(size / 2)))
    target = max(target, min_size)
    # ceil(n / k) <= target: below every size that failed, unless min_size or largest_k hold it up (checked next).
    k = min(math.ceil(n / target), n, largest_k)
    # Capped at the smallest split (every micro-batch keeps ``min_size`` samples), the micro-batch may be no
    # smaller than one that failed: that split was tried, nothing smaller may run.
    return k if math.ceil(n / k) < min(size, smallest_failed_size) else None


def smaller_micro_batch_count(k: int, batch_size: int) -> int:
    """The smallest k' > k whose micro-batches are smaller than k's (at most ``batch_size``).

    Example:
        >>> smaller_micro_batch_count(3, 10)  # 4 samples per micro-batch -> 3
        4
        >>> smaller_micro_batch_count(2, 5)  # 3 -> 2 (k=3 gives 2, 2, 1)
        3
    """
    size = math.ceil(batch_size / k)
    k2 = k + 1
    while k2 < batch_size and math.ceil(batch_size / k2) >= size:
        k2 += 1
    return min(k2, batch_size)


def allocator_thrashing(retries: list[int]) -> bool:
    """Whether the allocator thrashes: its cumulative retry count rose at each of the last two steps.

    Args:
        retries: the allocator's cumulative retries, read at the end of each of the last steps (oldest first).

    Example:
        >>> allocator_thrashing([4, 5, 7]), allocator_thrashing([4, 4, 7]), allocator_thrashing([5, 6])
        (True, False, False)
    """
    return len(retries) >= 3 and retries[-3] < retries[-2] < retries[-1]


def recently_failed_size(failures: dict[int, int], step: int, window: int) -> int | None:
    """The smallest micro-batch size that ran out of memory within ``window`` steps before ``step``.

    Growing back never aims at or above it (a size that failed recently would likely fail again).

    Args:
        failures: micro-batch size -> the global step of its last OOM.
        step: the current global step.
        window: how many steps back a failure counts.

    Example:
        >>> recently_failed_size({64: 10, 32: 40}, step=45, window=10)
        32
        >>> recently_failed_size({64: 10}, step=45, window=10) is None
        True
    """
    recent = [size for size, at in failures.items() if step - at <= window]
    return min(recent) if recent else None


def grow_back_micro_batch_count(
    k: int,
    batch_size: int,
    baseline_bytes: int,
    peak_bytes: int,
    limit_bytes: int,
    headroom: float = 0.9,
    below_size: int | None = None,
    max_micro_batch_size: int | None = None,
) -> int | None:
    """A smaller k that the measured step predicts to fit under ``headroom`` × limit; ``None`` when none does.

    The step's cost above what it started with (``peak − baseline``), divided by the micro-batch
    size, is an upper bound on the cost per sample (the optimizer phase and anything else that does
    not grow with the micro-batch are counted as if they did), so the prediction errs on the safe
    side. The new micro-batch stays below ``below_size`` (a size that failed recently) and at most
    ``max_micro_batch_size`` (a measured budget).

    Args:
        k: micro-batches per batch now.
        batch_size: samples per batch.
        baseline_bytes: memory allocated when the step started.
        peak_bytes: the step's peak.
        limit_bytes: memory this process may use.
        headroom: fraction of the limit to aim for.
        below_size: the new micro-batch must be smaller than this (``None``: no bound).
        max_micro_batch_size: the new micro-batch must be at most this (``None``: no bound).

    Example:
        >>> # 128 samples as 4 x 32; the step peaked 320 B above its 100 B start: 10 B per sample.
        >>> grow_back_micro_batch_count(4, 128, baseline_bytes=100, peak_bytes=420, limit_bytes=1000)
        2
        >>> grow_back_micro_batch_count(4, 128, 100, 420, 1000, below_size=64)  # 64 failed recently
        3
    """
    if k <= 1:
        return None
    size = math.ceil(batch_size / k)
    per_sample = max(0, peak_bytes - baseline_bytes) / size
    budget = headroom * limit_bytes - baseline_bytes
    target = batch_size if per_sample == 0 else int(budget // per_sample)
    if below_size is not None:
        target = min(target, below_size - 1)
    if max_micro_batch_size is not None:
        target = min(target, max_micro_batch_size)
    target = min(target, batch_size)
    if target <= size:
        return None
    new_k = math.ceil(batch_size / target)
    return new_k if new_k < k else None


@dataclass(frozen=True)
class Recovery:
    """What OOM recovery does next for a failed attempt: retry with ``k`` micro-batches (``None``: the
    k the batch started with), after turning on the recovery rungs named in ``rungs`` (see
    ``lightning_gpuopt/microbatch/rungs.py``)."""

    k: int | None
    rungs: tuple[str, ...] = ()


#: Names that moved out of this module (issue 35): the ranks' vote to ``votes.py``, the OOM record to
#: ``oom_record.py``. Importing them from here still works for one release, with a ``DeprecationWarning``.
_MOVED = {
    "lightning_gpuopt.votes": "Status STATUS_OOM STATUS_FATAL STATUS_GROW STATUS_THRASH Source Proposal Vote "
    "Agreement agree rung_bits rung_indices",
    "lightning_gpuopt.oom_record": "OOMRecord OOM_PARTS oom_parts part_label largest_part smaller_may_fit "
    "part_advice describe_action stop_reason",
}
__getattr__ = moved_names(
    __name__, {n: f"{home}.{n}" for home, names in _MOVED.items() for n in names.split()}
)
