"""What the micro-batch engine asks the callbacks that use it, and how two users' answers compose.

A callback attaches to the engine as one of its users (``MicroBatchEngine.attach(trainer, user)``). A user
that subclasses :class:`MicroBatchUser` answers the questions whose methods it overrides, and no others;
any other object only holds the engine. Nothing outside the engine writes into it: it asks its users, in
the order they attached (the Trainer's callback order), and where two users answer the same question it
composes their answers by a fixed rule or refuses the second user when it attaches, in one line naming
both. The rules, per method of :class:`MicroBatchUser`:

- ``decide_oom``: one user at most; a second is refused.
- ``weighting``: one weighting; equal ones (same settings) share the first, different ones are refused.
- ``may_split``: a batch is split only when every user allows it.
- ``micro_batch_cap``: the smallest cap wins.
- ``next_proposal``: the proposal with the most micro-batches wins (the one that needs the least memory);
  ties go to the first user.
- ``measure_split``: a whole batch is split for a measurement when any user asks; a refusal is told to every
  asker (``measure_refused``), and none is asked again in this fit.
- ``log_keys_to_sum``: the union.
- ``check_attempt``: asked in order; the first that sends the attempt back ends the asking for that attempt.
- ``k_changed``, ``rung_turned_on``, ``after_backward``: every user is told, in order.

The long form: docs/architecture.md, "The engine's contract".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_gpuopt.microbatch.errors import Refused

if TYPE_CHECKING:
    from lightning_gpuopt.microbatch.batch_runs import MicroBatchBackward
    from lightning_gpuopt.microbatch.loss_weighting import LossWeighting
    from lightning_gpuopt.microbatch.rungs import Rung
    from lightning_gpuopt.microbatch.splits import KChange
    from lightning_gpuopt.oom_policy import OOMFailure, Recovery
    from lightning_gpuopt.votes import Proposal

__all__ = ["QUESTIONS", "MicroBatchUser", "Users"]


class MicroBatchUser:
    """The questions the micro-batch engine asks a user; override the ones your callback answers.

    Every method is optional: the engine asks a user only the questions whose methods its class overrides.
    Answers must be alike on every rank (the engine's decisions are the ranks' decisions).
    """

    def decide_oom(self, failure: OOMFailure, smallest_failed: int, splittable: bool) -> Recovery | int:
        """After an OOM in an attempt: the :class:`~lightning_gpuopt.oom_policy.Recovery` (or the k) to retry
        with, or raise (``MicroBatchOOMError``) when nothing is left to try. Without a user that answers, an
        OOM propagates unchanged."""
        raise NotImplementedError

    def weighting(self) -> LossWeighting:
        """How micro-batch losses are weighted (``loss_weighting.py``); asked once, when the user attaches."""
        raise NotImplementedError

    def may_split(self, batch: Any) -> bool:
        """Whether ``batch`` may run as several micro-batches (``False``: it runs whole)."""
        raise NotImplementedError

    def micro_batch_cap(self) -> int | None:
        """The largest micro-batch allowed, in samples (``None``: no cap)."""
        raise NotImplementedError

    def next_proposal(self) -> Proposal | None:
        """A proposal for the vote after the training batch that starts now (grow back, allocator thrashing);
        asked once per batch, so the user gives each proposal once."""
        raise NotImplementedError

    def measure_split(self, batch_idx: int) -> bool:
        """Run this training batch, first of its accumulation window and due to run whole, as 2 micro-batches for a
        measurement (k is unchanged). Only for steps whose update a split leaves unchanged (the asker's to know)."""
        raise NotImplementedError

    def measure_refused(self, why: str) -> None:
        """The loss-weighting check refused the split a measurement asked for (the batch ran whole)."""
        raise NotImplementedError

    def log_keys_to_sum(self) -> Iterable[str]:
        """Logged keys summed over micro-batches instead of averaged; asked once, when the user attaches."""
        raise NotImplementedError

    def check_attempt(self, batch_idx: int, loss: Tensor | None) -> bool:
        """After an attempt every rank kept (``loss``: its detached loss for the whole batch, gradients in place):
        ``True`` drops it and runs the batch again, after the check changed what the batch runs under."""
        raise NotImplementedError

    def k_changed(self, change: KChange) -> None:
        """k (or an evaluation stage's k) changed."""
        raise NotImplementedError

    def rung_turned_on(self, rung: Rung, reason: str) -> None:
        """A recovery rung was turned on (by an OOM, or on resume)."""
        raise NotImplementedError

    def after_backward(self, told: MicroBatchBackward) -> None:
        """After each micro-batch's backward in a training attempt (this batch's gradients so far in ``.grad``)."""
        raise NotImplementedError


#: The questions, in the order of :class:`MicroBatchUser`'s methods.
QUESTIONS = tuple(name for name in vars(MicroBatchUser) if not name.startswith("_"))

#: What each question is about, for the line that refuses a second user.
_ABOUT = {
    "decide_oom": "decide what to do after an out-of-memory error",
    "weighting": "weight the micro-batches' losses, differently",
}


def _answers(user: object, question: str) -> Callable[..., Any] | None:
    """``user``'s bound method for ``question``, or ``None`` when its class does not override it."""
    if not isinstance(user, MicroBatchUser):
        return None
    if getattr(type(user), question, None) is getattr(MicroBatchUser, question):
        return None
    return getattr(user, question)


def _names(first: object, second: object) -> str:
    """How a refusal names two users ("X and Y", or "X and a second X" for two instances of one class)."""
    name = type(second).__name__
    return f"{type(first).__name__} and {'a second ' if type(first) is type(second) else ''}{name}"


class Users:
    """One engine's users, in the order they attached, and their composed answers (see the module docs).

    Args:
        fallback: the weighting used while no user gives one.
    """

    def __init__(self, fallback: LossWeighting) -> None:
        self.fallback = fallback
        self._users: dict[int, object] = {}
        self._refused_split = False
        self._build()

    def __len__(self) -> int:
        return len(self._users)

    @property
    def all(self) -> tuple[object, ...]:
        """Every user, in the order they attached."""
        return tuple(self._users.values())

    def add(self, user: object) -> None:
        """Add ``user`` (once); raises ``Refused`` naming both users when its answers cannot compose with another's."""
        if id(user) in self._users:
            return
        for question in ("decide_oom", "weighting"):
            mine = _answers(user, question)
            if mine is None:
                continue
            for other in self._users.values():
                theirs = _answers(other, question)
                if theirs is None or (question == "weighting" and _same_weighting(mine(), theirs())):
                    continue
                raise Refused(
                    f"{_names(other, user)} both {_ABOUT[question]} for this Trainer, "
                    "and the engine takes one answer: keep one of them."
                )
        self._users[id(user)] = user
        self._build()

    def remove(self, user: object) -> None:
        if self._users.pop(id(user), None) is not None:
            self._build()

    def _build(self) -> None:
        users = self._users.values()

        def asked(question: str) -> tuple[Callable[..., Any], ...]:
            return tuple(a for a in (_answers(u, question) for u in users) if a is not None)

        deciders = asked("decide_oom")
        #: The OOM decision (``None``: an OOM propagates unchanged).
        self.decide_oom: Callable[..., Any] | None = deciders[0] if deciders else None
        weightings = asked("weighting")
        #: The weighting of micro-batch losses in force.
        self.weighting: LossWeighting = weightings[0]() if weightings else self.fallback
        #: Logged keys summed over micro-batches.
        self.sum_log_keys: frozenset[str] = frozenset(k for ask in asked("log_keys_to_sum") for k in ask())
        #: ``check(batch_idx, loss) -> bool``, in order.
        self.checks: tuple[Callable[[int, Tensor | None], bool], ...] = asked("check_attempt")
        #: ``listener(MicroBatchBackward)``, in order.
        self.backward_listeners: tuple[Callable[[MicroBatchBackward], None], ...] = asked("after_backward")
        self._splitters = asked("may_split")
        self._caps = asked("micro_batch_cap")
        self._proposers = asked("next_proposal")
        self._measurers = asked("measure_split")
        self._refusal_listeners = asked("measure_refused")
        self._k_listeners = asked("k_changed")
        self._rung_listeners = asked("rung_turned_on")
        self._refused_split = False

    # ------------------------------------------------------------------ composed answers

    def may_split(self, batch: Any) -> bool:
        """Whether ``batch`` may be split: every user allows it."""
        return not self._splitters or all(allows(batch) for allows in self._splitters)

    def micro_batch_cap(self) -> int | None:
        """The smallest cap any user sets (``None``: none does)."""
        if not self._caps:
            return None
        caps = [c for c in (cap() for cap in self._caps) if c]
        return min(caps) if caps else None

    def next_proposal(self) -> Proposal | None:
        """The users' proposals for the vote after this batch: the one with the most micro-batches, first on ties."""
        proposals = [p for p in (ask() for ask in self._proposers) if p is not None]
        return max(proposals, key=lambda p: p.k) if proposals else None

    @property
    def asks_measure_split(self) -> bool:
        """Whether any user may ask for a measurement split in this fit."""
        return bool(self._measurers) and not self._refused_split

    def measure_split(self, batch_idx: int) -> bool:
        """Whether any user asks to split this batch for a measurement."""
        return self.asks_measure_split and any([ask(batch_idx) for ask in self._measurers])

    def measure_refused(self, why: str) -> None:
        """Tell every asker that the check refused the measurement's split; none is asked again in this fit."""
        self._refused_split = True
        for told in self._refusal_listeners:
            told(why)

    def k_changed(self, change: KChange) -> None:
        for listener in self._k_listeners:
            listener(change)

    def rung_turned_on(self, rung: Rung, reason: str) -> None:
        for listener in self._rung_listeners:
            listener(rung, reason)


def _same_weighting(a: LossWeighting, b: LossWeighting) -> bool:
    return a is b or a.settings == b.settings
