"""Pure decisions behind OOM recovery: how many micro-batches to try next, and what to tell the user.

No Lightning and no device calls here: the micro-batch engine gathers the figures (from the memory
probe and the OOM message) and these functions decide, so every rule is unit-tested on its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["OOMFailure", "next_micro_batch_count", "parse_tried_bytes"]

_UNITS = {"B": 1, "BYTES": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}
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
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


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

    @property
    def demand_bytes(self) -> int | None:
        """A lower bound on what the failed micro-batch needed above the baseline."""
        if None in (self.baseline_bytes, self.allocated_bytes, self.tried_bytes):
            return None
        return max(0, self.allocated_bytes + self.tried_bytes - self.baseline_bytes)


def next_micro_batch_count(failure: OOMFailure, smallest_failed_size: int, headroom: float = 0.9) -> int | None:
    """How many micro-batches to try after ``failure``; ``None`` when even one sample per micro-batch failed.

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

    Example:
        >>> f = OOMFailure(step=3, batch_idx=3, phase="forward", batch_size=64, k=1, micro_batch_size=64,
        ...     baseline_bytes=100, allocated_bytes=500, tried_bytes=300, limit_bytes=500, message="")
        >>> next_micro_batch_count(f, smallest_failed_size=64)  # 11 B/sample, 350 B free -> 31 samples
        3
    """
    n, size = failure.batch_size, failure.micro_batch_size
    if size <= 1 or smallest_failed_size <= 1:
        return None
    target = min(size, smallest_failed_size) - 1  # never a size that failed
    demand = failure.demand_bytes
    if demand and failure.limit_bytes and failure.baseline_bytes is not None:
        available = failure.limit_bytes * headroom - failure.baseline_bytes
        per_sample = demand / size
        predicted = int(available // per_sample) if available > 0 else 1
        target = max(1, min(target, predicted))
    else:
        target = max(1, min(target, math.ceil(size / 2)))
    k = max(failure.k + 1, math.ceil(n / target))
    while k < n and math.ceil(n / k) > target:
        k += 1
    return min(k, n)
