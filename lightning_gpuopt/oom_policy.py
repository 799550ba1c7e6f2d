"""Pure decisions behind OOM recovery: how many micro-batches to try next, and what to tell the user.

No Lightning and no device calls here: the micro-batch engine gathers the figures (from the memory
probe and the OOM message) and these functions decide, so every rule is unit-tested on its own.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "OOM_PARTS",
    "STATUS_FATAL",
    "STATUS_GROW",
    "STATUS_OOM",
    "STATUS_THRASH",
    "Agreement",
    "OOMFailure",
    "OOMRecord",
    "Proposal",
    "Recovery",
    "Source",
    "Status",
    "Vote",
    "agree",
    "allocator_thrashing",
    "describe_action",
    "grow_back_micro_batch_count",
    "largest_part",
    "next_micro_batch_count",
    "oom_parts",
    "parse_tried_bytes",
    "part_advice",
    "part_label",
    "recently_failed_size",
    "rung_bits",
    "rung_indices",
    "smaller_may_fit",
    "smaller_micro_batch_count",
    "smallest_split_cannot_fit",
    "stop_reason",
]

_UNITS = {
    "B": 1,
    "BYTES": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}
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
    if size <= min_size or smallest_failed_size <= min_size or failure.k >= largest_k:
        return None
    target = min(size, smallest_failed_size) - 1  # never a size that failed
    demand = failure.demand_bytes
    if demand and failure.limit_bytes and failure.baseline_bytes is not None:
        available = failure.limit_bytes * headroom - failure.baseline_bytes
        per_sample = demand / size
        if failure.per_sample_bytes and failure.gradient_bytes is not None:
            # A split runs every micro-batch after the first beside all gradients: those are fixed, not per sample.
            available -= failure.gradient_bytes
            per_sample = max(failure.per_sample_bytes, per_sample_bytes or 0.0)
        predicted = int(available // per_sample) if available > 0 else 1
        target = max(1, min(target, predicted))
    else:
        target = max(1, min(target, math.ceil(size / 2)))
    target = max(target, min_size)
    k = max(failure.k + 1, math.ceil(n / target))  # ceil(n / k) <= target: k >= n / target, target whole
    k = min(k, n, largest_k)
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


class Status(enum.IntFlag):
    """A rank's say on a batch, as flags (they travel as one int in the ranks' vote)."""

    NONE = 0
    OOM = 1  #: the attempt ran out of memory: the batch is retried
    FATAL = 2  #: out of memory with nothing left to try: every rank stops
    CHECKPOINT = 4  #: unused since the rungs have their own bits (:data:`RUNG`); kept for its value
    GROW = 8  #: the k proposed for the next batch is smaller: memory to spare
    THRASH = 16  #: the k proposed for the next batch is larger: the allocator is thrashing
    SKIP = 32  #: ``training_step`` returned ``None`` (or no loss): every rank skips the batch
    RUNG = 256  #: turn on the first recovery rung past more micro-batches; rung ``i`` is ``RUNG << i``


#: The flags under their former names.
STATUS_OOM = Status.OOM
STATUS_FATAL = Status.FATAL
STATUS_GROW = Status.GROW
STATUS_THRASH = Status.THRASH


class Source(str, enum.Enum):
    """Why k changes (a :class:`~lightning_gpuopt.microbatch.KChange`'s ``source``); equal to its string."""

    NONE = ""
    OOM = "oom"
    GROW_BACK = "grow back"
    THRASH = "thrash"
    RESUME = "resume"
    MEMORY = "memory"  #: MemoryAwareBatchSize's measured budget

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class Proposal:
    """What a callback proposes for the batch after the next vote: ``k`` micro-batches, flagged ``status``
    (:attr:`Status.GROW` or :attr:`Status.THRASH`), because of ``reason`` (shown to the user)."""

    k: int
    status: Status
    reason: str


@dataclass(frozen=True)
class Vote:
    """One rank's say on a batch: its status flags and the k it proposes (for the retry, or the next batch)."""

    status: Status | int
    k: int


@dataclass(frozen=True)
class Agreement:
    """What every rank does after a batch's votes.

    Attributes:
        fatal_ranks: ranks that ran out of memory with nothing left to try (every rank stops).
        retry: some rank ran out of memory: every rank runs the batch again with ``k``.
        k: the k for the retry, or for the next batch.
        rungs: the recovery rungs (their indices in the engine's ladder) any rank asked for: every rank turns
            them on before the retry.
        source: why k changes (:class:`Source`; ``Source.NONE`` when it does not).
        ranks: the ranks that asked for the change.
        skip: some rank's ``training_step`` returned ``None`` (no retry pending): every rank skips the batch.
    """

    fatal_ranks: tuple[int, ...]
    retry: bool
    k: int
    rungs: tuple[int, ...]
    source: Source
    ranks: tuple[int, ...]
    skip: bool = False


def agree(votes: list[Vote], k: int) -> Agreement:
    """The decision every rank takes from the same votes, so that ranks stay in step.

    Any fatal vote stops every rank. Else any OOM makes every rank retry the batch with the largest k
    an OOM-ing rank proposed (the most cautious split wins). Else each rank's proposal for the next
    batch counts, the current ``k`` for a rank without one: the largest wins, so k shrinks (grows
    back) only when every rank can afford it, and grows when any rank thrashes. A rank whose step
    returned ``None`` makes every rank skip the batch (after any retry an OOM asks for).

    Example:
        >>> agree([Vote(0, 2), Vote(1, 4)], k=2)  # rank 1 ran out of memory and asks for 4
        Agreement(fatal_ranks=(), retry=True, k=4, rungs=(), source=<Source.OOM: 'oom'>, ranks=(1,), skip=False)
        >>> agree([Vote(32, 2), Vote(0, 2)], k=2).skip  # rank 0's step returned None
        True
        >>> agree([Vote(8, 1), Vote(0, 2)], k=2).k  # rank 0 could grow back, rank 1 cannot
        2
    """
    fatal = tuple(r for r, v in enumerate(votes) if v.status & STATUS_FATAL)
    oom = [(r, v) for r, v in enumerate(votes) if v.status & STATUS_OOM and not v.status & STATUS_FATAL]
    if fatal:
        return Agreement(fatal, False, k, (), Source.OOM, fatal)
    if oom:
        new_k = max(v.k for _, v in oom)
        asked = 0
        for _, v in oom:
            asked |= int(v.status)
        return Agreement((), True, new_k, rung_indices(asked), Source.OOM, tuple(r for r, _ in oom))
    skip = any(v.status & Status.SKIP for v in votes)
    proposals = [v.k if v.status & (STATUS_GROW | STATUS_THRASH) else k for v in votes]
    new_k = max(proposals)
    if new_k == k:
        return Agreement((), False, k, (), Source.NONE, (), skip)
    bit = STATUS_THRASH if new_k > k else STATUS_GROW
    asked = tuple(r for r, v in enumerate(votes) if v.status & bit)
    return Agreement((), False, new_k, (), Source.THRASH if new_k > k else Source.GROW_BACK, asked, skip)


def rung_bits(indices: Iterable[int]) -> Status:
    """The vote's flags asking for the recovery rungs at ``indices`` of the engine's ladder.

    Example:
        >>> int(rung_bits([0, 2]))
        1280
        >>> rung_indices(int(Status.OOM | rung_bits([0, 2])))
        (0, 2)
    """
    bits = 0
    for i in indices:
        bits |= int(Status.RUNG) << i
    return Status(bits)


def rung_indices(status: int) -> tuple[int, ...]:
    """The ladder indices of the rungs a vote's flags ask for, in order."""
    bits, out, i = int(status) >> (int(Status.RUNG).bit_length() - 1), [], 0
    while bits:
        if bits & 1:
            out.append(i)
        bits >>= 1
        i += 1
    return tuple(out)


@dataclass
class OOMRecord:
    """One out-of-memory error the pack handled, as ``gpuopt_report.json["ooms"]`` keeps it (docs/report.md,
    "Reading an OOM record").

    Attributes:
        step: ``trainer.global_step`` when it happened.
        rank: the process's global rank.
        stage: ``"train"``, ``"validation"``, ``"test"``, ``"predict"``, ``"trial"`` (a step of
            MemoryAwareBatchSize's search) or ``"other"`` (caught outside the pack).
        phase: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        requested_bytes: the allocation that failed (``None`` when the error does not say).
        allocated_bytes: bytes held by live tensors then.
        reserved_bytes: bytes the allocator held then (its cache included).
        limit_bytes: the memory the process may use (``None``: unknown).
        categories: ``allocated_bytes`` by what it was for (``parameters``, ``gradients``, ``optimizer_state``,
            ``activations``, ``other``), summing to it.
        activations_measured: whether ``activations`` was measured (else it is 0 and they are in ``other``).
        held_before_step_bytes: of ``allocated_bytes``, what was in use when the step's attempt began (``None``:
            not known, outside the engine's attempts: the optimizer step, trial steps).
        allocated_during_step_bytes: the rest of ``allocated_bytes``: what the step allocated.
        held_before_step: ``held_before_step_bytes`` by category; the rest of each category was allocated during
            the step.
        modules: the modules owning the most activations: ``{"how": ..., "top": [{"module", "bytes"}]}``.
        action: what the pack did next (``"micro-batch 64 → 32 (k 1 → 2)"``, ``"gave up: ..."``).
        message: the first line of the error.
        k, batch_size, micro_batch_size: what the failed attempt ran (``None`` outside the engine).
        fragmentation: on CUDA, ``{"free_in_reserved_bytes", "largest_free_block_bytes"}``.
        outside_allocator_bytes: on CUDA, device bytes this process holds outside the allocator.
        outside_allocator_source: how they were read (NVML for this process, or the whole device).
        snapshot: the memory snapshot pickle written for it (a file name beside the report), if any.
        picture: its picture (``oom_<step>_rank<r>.png``), if drawn.
        time_s: seconds since the fit started.
    """

    step: int
    rank: int
    stage: str
    phase: str
    requested_bytes: int | None
    allocated_bytes: int
    reserved_bytes: int
    limit_bytes: int | None
    categories: dict[str, int]
    activations_measured: bool = True
    held_before_step_bytes: int | None = None
    allocated_during_step_bytes: int | None = None
    held_before_step: dict[str, int] | None = None
    modules: dict[str, Any] = field(default_factory=lambda: {"how": "not measured", "top": []})
    action: str = ""
    message: str = ""
    k: int | None = None
    batch_size: int | None = None
    micro_batch_size: int | None = None
    fragmentation: dict[str, int] | None = None
    outside_allocator_bytes: int | None = None
    outside_allocator_source: str | None = None
    snapshot: str | None = None
    picture: str | None = None
    time_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The record as plain values (what the JSON holds)."""
        return asdict(self)


#: The parts an OOM's memory is told in: the record's categories, with ``other`` split into what was held
#: before the step (``other_held``) and what the step allocated, where the record has the split.
OOM_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "other_held", "other")

_PART_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "other_held": "other, held before the step",
}

#: What lowers each part: (while a smaller micro-batch may still fit, once none does).
_ADVICE = {
    "parameters": ("a lower-memory precision (bf16-true), or sharding (FSDP2Strategy)",) * 2,
    "gradients": ("sharding the gradients (FSDP2Strategy), or fewer trainable parameters",) * 2,
    "optimizer_state": ("sharding or offloading it (FSDP2Strategy), or an 8-bit optimizer",) * 2,
    "activations": (
        "smaller micro-batches (OOMRecovery does it), activation checkpointing, bf16-mixed",
        "activation checkpointing (OOMRecovery(checkpoint_modules=[...])), bf16-mixed",
    ),
    "other_held": (
        "keep on the CPU, or free before fit, what the program holds on the device besides the training state "
        "(a dataset, saved outputs, caches): it was in use before the step began",
    )
    * 2,
    "other during": (
        "smaller micro-batches (the batch, temporaries); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "bf16-mixed (smaller inputs and temporaries); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
    "other": (
        "smaller micro-batches (the batch, temporaries), or keeping on the CPU what the program holds on the "
        "device; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "keeping on the CPU what the program holds on the device, or bf16-mixed (smaller temporaries); "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
}


def oom_parts(record: dict[str, Any]) -> dict[str, int]:
    """An OOM record's bytes in use by part (:data:`OOM_PARTS`): its categories, with ``other`` split into what
    was held before the step and what the step allocated when the record has the split.

    Example:
        >>> record = {"categories": {"parameters": 10, "gradients": 0, "optimizer_state": 20, "activations": 40,
        ...                          "other": 130}, "held_before_step": {"parameters": 10, "other": 120}}
        >>> oom_parts(record)
        {'parameters': 10, 'gradients': 0, 'optimizer_state': 20, 'activations': 40, 'other_held': 120, 'other': 10}
    """
    categories = record.get("categories") or {}
    parts = {name: int(categories.get(name, 0)) for name in OOM_PARTS if name not in ("other_held", "other")}
    other = int(categories.get("other", 0))
    held = record.get("held_before_step")
    if held is not None:
        parts["other_held"] = min(other, int(held.get("other", 0)))
        other -= parts["other_held"]
    parts["other"] = other
    return parts


def part_label(part: str, split: bool = False) -> str:
    """A part's name for people; ``split``: the record tells ``other`` held before the step apart.

    Example:
        >>> part_label("optimizer_state"), part_label("other"), part_label("other", split=True)
        ('optimizer state', 'other', 'other, allocated during the step')
    """
    if part == "other":
        return "other, allocated during the step" if split else "other"
    return _PART_LABELS[part]


def largest_part(parts: dict[str, int]) -> str:
    """The part holding the most bytes (the first of equals, in :data:`OOM_PARTS` order)."""
    return max(parts, key=lambda name: (parts[name], -OOM_PARTS.index(name)))


def smaller_may_fit(record: dict[str, Any]) -> bool:
    """Whether a smaller micro-batch may still fit after this OOM: not after the pack gave up, nor at one sample.

    Example:
        >>> smaller_may_fit({"micro_batch_size": 8, "action": "micro-batch 8 → 4 (k 8 → 16)"})
        True
        >>> smaller_may_fit({"micro_batch_size": 8, "action": "gave up: Out of memory ..."})
        False
    """
    return record.get("micro_batch_size") != 1 and not str(record.get("action") or "").startswith("gave up")


def part_advice(part: str, smaller_fits: bool = True, split: bool = False) -> str:
    """What lowers ``part``; ``smaller_fits``: whether a smaller micro-batch may still fit (else it is not advised).

    Example:
        >>> part_advice("activations", smaller_fits=False)
        'activation checkpointing (OOMRecovery(checkpoint_modules=[...])), bf16-mixed'
    """
    key = "other during" if part == "other" and split else part
    return _ADVICE[key][0 if smaller_fits else 1]


def describe_action(stage: str, n: int, k: int, new_k: int, rungs: Iterable[str] = ()) -> str:
    """What the ranks agreed to do after an OOM, in a few words, for :attr:`OOMRecord.action`.

    Example:
        >>> describe_action("train", n=64, k=1, new_k=2)
        'micro-batch 64 → 32 (k 1 → 2)'
        >>> describe_action("train", n=64, k=64, new_k=64, rungs=["activation checkpointing"])
        'activation checkpointing on; micro-batch 1 kept'
        >>> describe_action("validation", n=64, k=1, new_k=4)
        'validation batches in 4 chunks of 16'
    """
    turned_on = "; ".join(f"{name} on" for name in rungs)
    if stage != "train":
        return f"{stage} batches in {new_k} chunks of {math.ceil(n / new_k)}"
    before, after = math.ceil(n / k), math.ceil(n / new_k)
    if new_k == k:
        return f"{turned_on or 'retried'}; micro-batch {after} kept"
    split = f"micro-batch {before} → {after} (k {k} → {new_k})"
    return f"{turned_on}; {split}" if turned_on else split


def stop_reason(error: BaseException) -> str:
    """``"gave up: "`` and the first sentence of ``error``, whole, for an OOM the pack could not recover from.

    Example:
        >>> stop_reason(RuntimeError("Out of memory at step 3 (forward) with micro-batches of 1. Next steps: ..."))
        'gave up: Out of memory at step 3 (forward) with micro-batches of 1'
    """
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return "gave up: " + text.split(". ")[0].rstrip(".")
