"""The ranks' vote on every attempt: each rank's say (:class:`Vote`, :class:`Status` flags), why k changes
(:class:`Source`), a callback's :class:`Proposal`, and :func:`agree`, the decision every rank takes from the
same votes. Used by every attempt of the micro-batch engine, OOM or not, and by the batch-size search's trial
steps under FSDP2. Pure: no Lightning, no device calls.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "STATUS_FATAL",
    "STATUS_GROW",
    "STATUS_OOM",
    "STATUS_THRASH",
    "Agreement",
    "PeerFailure",
    "Proposal",
    "Source",
    "Status",
    "Vote",
    "agree",
    "rung_bits",
    "rung_indices",
]


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


class PeerFailure(RuntimeError):
    """Another rank's attempt failed; raised on this rank at the vote before one of FSDP's collectives.

    ``votes`` is that vote: the attempt's agreement, already taken (no further vote for this attempt).
    """

    def __init__(self, votes: list[Vote]) -> None:
        failed = [r for r, v in enumerate(votes) if v.status]
        super().__init__(f"rank(s) {', '.join(map(str, failed))} ran out of memory during this attempt")
        self.votes = votes
