"""One log of what the pack decided during a run: every change of k, OOM retry, precision switch, search.

The pack's callbacks call :func:`record_decision` when they change the run; :class:`GPUOptReport`
reads :func:`decisions` to mark them on its memory timeline. The log lives on the Trainer, so it
covers one Trainer and every callback of the pack in it; a new ``fit`` on the same Trainer appends.
Your own callbacks may record decisions too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Decision", "decisions", "note_resume_policy", "record_decision", "resume_policies"]

_LOG_ATTR = "_gpuopt_decisions"
_POLICIES_ATTR = "_gpuopt_resume_policies"


@dataclass(frozen=True)
class Decision:
    """One decision of the pack.

    Attributes:
        step: ``trainer.global_step`` when it was taken.
        kind: what changed: ``"oom"`` (an OOM retry), ``"micro-batches"`` (k changed), ``"precision"``,
            ``"batch size"``, ``"workers"``, ``"checkpointing"``, ...
        source: the callback that decided (``"OOMRecovery"``, ...).
        message: one sentence for people: before -> after, and why.
        data: plain values behind it (numbers, strings), for the report's JSON.
    """

    step: int
    kind: str
    source: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_decision(trainer: Any, kind: str, source: str, message: str, **data: Any) -> Decision:
    """Add a decision to the Trainer's log at the current ``global_step`` and return it.

    Example:
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace(global_step=7)
        >>> record_decision(trainer, "workers", "MyCallback", "num_workers 2 -> 4", before=2, after=4).step
        7
        >>> [d.message for d in decisions(trainer)]
        ['num_workers 2 -> 4']
    """
    decision = Decision(int(getattr(trainer, "global_step", 0)), kind, source, message, dict(data))
    log = getattr(trainer, _LOG_ATTR, None)
    if log is None:
        log = []
        setattr(trainer, _LOG_ATTR, log)
    log.append(decision)
    return decision


def decisions(trainer: Any) -> list[Decision]:
    """Every decision recorded on this Trainer, in order."""
    return list(getattr(trainer, _LOG_ATTR, []))


def note_resume_policy(trainer: Any, state: str, policy: str) -> None:
    """Say what a resume of this Trainer's run did with one piece of state (``"rng"``, ``"data"``, ...): the
    report's entry for the resume lists them.

    Example:
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace()
        >>> note_resume_policy(trainer, "rng", "restored, each rank's")
        >>> resume_policies(trainer)
        {'rng': "restored, each rank's"}
    """
    policies = getattr(trainer, _POLICIES_ATTR, None)
    if policies is None:
        policies = {}
        setattr(trainer, _POLICIES_ATTR, policies)
    policies[state] = policy


def resume_policies(trainer: Any) -> dict[str, str]:
    """What the resume of this Trainer's run did with each piece of state, as :func:`note_resume_policy` said."""
    return dict(getattr(trainer, _POLICIES_ATTR, {}))
