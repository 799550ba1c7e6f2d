"""PrecisionSwitch's decisions, without a Trainer: the arguments, the choice at setup, switching down and up,
the resume, the non-finite guard's rule, and the record a checkpoint keeps.

The callback (``callbacks/precision_switch.py``) wires these to Lightning's hooks, asks the ranks and installs
the plugins (``precision_plugins.py``); the ladder and the device table are ``precision.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_gpuopt._validate import choice, positive_int
from lightning_gpuopt.precision import (
    LADDER,
    DeviceInfo,
    StabilityWatch,
    StepOutcome,
    check_ladder,
    choose_precision,
    fallback_ladder,
    faster_rung,
    fp8_available,
    fsdp2_mixed_precision,
    is_faster,
    unsupported_reason,
)

__all__ = [
    "Initial",
    "PolicyPlan",
    "PrecisionChange",
    "PrecisionSwitchOptions",
    "SwitchRecord",
    "check_ladder_runs",
    "fallback_note",
    "fallbacks",
    "fsdp2_policy_plan",
    "initial_precision",
    "switch_verdict",
]

#: What ``initial`` may be: the Trainer's own precision kept, the device's best, or a rung of the ladder.
Initial = Literal["auto", "keep", "16-mixed", "bf16-mixed", "32-true"]


@dataclass(frozen=True)
class PrecisionChange:
    """One change of precision during a fit, as :attr:`PrecisionSwitch.switches` lists it."""

    step: int
    before: str
    after: str
    reason: str


@dataclass(frozen=True)
class PrecisionSwitchOptions:
    """PrecisionSwitch's arguments, checked once (:class:`~lightning_gpuopt.PrecisionSwitch` documents each).

    ``ladder`` is normalised to a tuple (``None``: the whole :data:`~lightning_gpuopt.precision.LADDER`).
    """

    initial: Initial = "auto"
    ladder: Sequence[str] | None = None
    patience: int = 2
    min_scale: float = 1.0
    retry_after: int | None = None
    rerun: bool = True
    cpu_bf16: bool = False
    tf32: bool = True
    fp8: bool = False
    fsdp2_policy: bool = True
    verbose: bool = True

    def __post_init__(self) -> None:
        choice("initial", self.initial, Initial)
        ladder = LADDER if self.ladder is None else check_ladder(self.ladder)
        positive_int("patience", self.patience, unit="troubled steps in a row")
        min_scale = self.min_scale
        if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) or not min_scale > 0:
            raise ValueError(f"`min_scale` must be a number > 0, got {min_scale!r}")
        positive_int("retry_after", self.retry_after, unit="optimizer steps", allow_none=True)
        for name in ("rerun", "cpu_bf16", "tf32", "fp8", "fsdp2_policy", "verbose"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {type(getattr(self, name)).__name__}")
        if self.fp8 and not fp8_available():
            raise ImportError(
                "PrecisionSwitch(fp8=True) needs NVIDIA Transformer Engine: `pip install transformer-engine[pytorch]` "
                "(and a GPU with compute capability 8.9 or newer), or leave fp8=False."
            )
        object.__setattr__(self, "ladder", ladder)
        object.__setattr__(self, "min_scale", float(min_scale))


# ---------------------------------------------------------------------------------------------------
# The choice at setup
# ---------------------------------------------------------------------------------------------------
def check_ladder_runs(ladder: tuple[str, ...], info: DeviceInfo) -> None:
    """Refuse a given ``ladder`` that names a precision this device cannot run, naming the ladder without it."""
    for rung in ladder:
        why = unsupported_reason(rung, info)
        if why is not None:
            others = tuple(r for r in ladder if r != rung)
            raise ValueError(
                f"`ladder` {ladder} names {rung!r}, which this device cannot run: {why}. "
                f"Leave it out (ladder={others}), or leave `ladder` unset for the device's own."
            )


def initial_precision(
    initial: str, before: str, info: DeviceInfo, *, cpu_bf16: bool, fp8: bool
) -> tuple[str, str]:
    """The precision a fit starts in and why: the Trainer's (``"keep"``), the device's best, or the one named."""
    if initial == "keep":
        return before, f"initial='keep' on {info.label}"
    if initial == "auto":
        picked = choose_precision(info, cpu_bf16=cpu_bf16, fp8=fp8, fp8_installed=fp8_available())
        return picked.precision, f"auto: {picked.reason}"
    why = unsupported_reason(initial, info)
    if why is not None:
        raise ValueError(
            f"`initial={initial!r}`: this device cannot run it ({why}). Use initial='auto' to pick "
            "the fastest precision the device runs natively."
        )
    return initial, f"initial={initial!r} on {info.label}"


@dataclass(frozen=True)
class PolicyPlan:
    """Under the pack's FSDP2Strategy: the ``MixedPrecisionPolicy`` to set, why the precision is then fixed."""

    #: The policy to give the strategy before it shards (``None``: leave the strategy's as it is).
    policy: object | None = None
    #: Why the precision cannot switch at runtime once sharded (``None``: it can).
    fixed: str | None = None
    #: The setup line's part about FSDP2.
    note: str = ""


def fsdp2_policy_plan(
    precision: str, own_policy: object | None, shards_itself: str | None, use_policy: bool
) -> PolicyPlan:
    """How ``precision`` runs under FSDP2: as its ``MixedPrecisionPolicy``, or as autocast over its shards.

    Args:
        precision: the precision in force.
        own_policy: the strategy's ``mp_policy`` as the user gave it.
        shards_itself: the module's class name when it shards itself in ``configure_model``, else ``None``.
        use_policy: ``PrecisionSwitch(fsdp2_policy=...)``.
    """
    policy = fsdp2_mixed_precision(precision)
    if own_policy is not None and own_policy != policy:
        return PolicyPlan(
            fixed=f"FSDP2Strategy's own mp_policy ({own_policy}) is fixed once the model is sharded",
            note=f"FSDP2: the strategy's own mp_policy kept ({own_policy})",
        )
    if policy is None:
        return PolicyPlan()
    if shards_itself is not None:
        return PolicyPlan(
            note=f"{shards_itself} shards itself in configure_model: {precision} is autocast over "
            "its own sharding (pass `mp_policy=` to your fully_shard calls for bfloat16 all-gathers)"
        )
    if not use_policy:
        return PolicyPlan(
            note="FSDP2: bfloat16 autocast over float32 sharded parameters (fsdp2_policy=False)"
        )
    return PolicyPlan(
        policy=policy,
        fixed="FSDP2's MixedPrecisionPolicy is fixed once the model is sharded (fsdp2_policy=False: bfloat16 "
        "autocast over float32 parameters, which can fall back at runtime)",
        note="FSDP2 MixedPrecisionPolicy: bfloat16 parameters all-gathered, float32 reductions",
    )


# ---------------------------------------------------------------------------------------------------
# The non-finite guard's rule
# ---------------------------------------------------------------------------------------------------
def switch_verdict(
    watch: StabilityWatch, *, scaler: bool, loss_bad: bool, grads_bad: bool, backoff: float | None
) -> str | None:
    """Why the attempt just run should switch precision now (``None``: apply, skip or hold back as usual).

    ``loss_bad`` and ``grads_bad`` are the flags agreed by every rank; ``backoff`` the GradScaler's factor,
    which predicts the scale its step will set.
    """
    if not (loss_bad or grads_bad):
        return None
    predicted = None
    if scaler and watch.last_scale is not None and backoff is not None:
        predicted = watch.last_scale * backoff
    return watch.verdict(StepOutcome(applied=False, scaler=scaler, loss_finite=not loss_bad, scale=predicted))


# ---------------------------------------------------------------------------------------------------
# The record: what the state dict carries, switching down and up, the resume
# ---------------------------------------------------------------------------------------------------
@dataclass
class SwitchRecord:
    """The precision in force and what happened to get there; a checkpoint keeps it (plain values)."""

    #: ``PrecisionSwitch(retry_after=...)``: the first wait before a faster precision is tried again.
    retry_after: int | None = None
    #: Every change of precision of this fit (resumed ones included), in order.
    switches: list[PrecisionChange] = field(default_factory=list)
    #: Optimizer steps not applied: skipped by the GradScaler or held back for non-finite values.
    skipped_steps: int = 0
    #: Of :attr:`skipped_steps`, those held back (non-finite values without a GradScaler).
    nonfinite_steps: int = 0
    #: Batches run again in a new precision after a switch (``accumulate_grad_batches`` = 1).
    rerun_batches: int = 0
    precision: str | None = None
    #: The precision the run started in (the one a retry goes back to).
    start: str | None = None
    retry_interval: int | None = None
    last_switch_step: int | None = None

    def __post_init__(self) -> None:
        if self.retry_interval is None:
            self.retry_interval = self.retry_after

    def state_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "start": self.start,
            "switches": [[c.step, c.before, c.after, c.reason] for c in self.switches],
            "skipped_steps": self.skipped_steps,
            "nonfinite_steps": self.nonfinite_steps,
            "rerun_batches": self.rerun_batches,
            "retry_interval": self.retry_interval,
            "last_switch_step": self.last_switch_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.precision = state.get("precision")
        self.start = state.get("start")
        self.switches = [
            PrecisionChange(int(s), str(b), str(a), str(r)) for s, b, a, r in state.get("switches", [])
        ]
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.rerun_batches = int(state.get("rerun_batches", 0))
        self.retry_interval = state.get("retry_interval", self.retry_after)
        self.last_switch_step = state.get("last_switch_step")

    def switched(self, step: int, after: str, reason: str) -> PrecisionChange:
        """Note a change to ``after`` at ``step``."""
        change = PrecisionChange(step, self.precision, after, reason)
        self.switches.append(change)
        self.precision = after
        self.last_switch_step = step
        return change

    def down_target(
        self, reason: str, rungs: tuple[str, ...], ladder: Sequence[str], policy: str | None
    ) -> str:
        """The precision to fall back to from ``rungs`` (the fallbacks left), or a ``FloatingPointError``.

        A faster precision that fails again (the last change was a retry) doubles the wait before the next try.
        """
        if not rungs:
            if policy is not None:
                raise FloatingPointError(
                    f"PrecisionSwitch: {reason} in {self.precision}, and there is no precision to fall back to: "
                    f"{policy}. Check the learning rate, the data "
                    "(inf/NaN inputs or labels) and the loss; or raise `patience` to skip more bad steps."
                )
            raise FloatingPointError(
                f"PrecisionSwitch: {reason} in {self.precision}, and no more stable precision is left "
                f"(ladder {tuple(ladder)}). This is not a precision problem: check the learning rate, the data "
                "(inf/NaN inputs or labels) and the loss; or raise `patience` to skip more bad steps."
            )
        last = self.switches[-1] if self.switches else None
        if last is not None and self.retry_interval and is_faster(last.after, last.before):
            self.retry_interval *= 2
        return rungs[0]

    def retry_target(self, step: int, ladder: Sequence[str], info: DeviceInfo | None) -> str | None:
        """The faster precision to try again at ``step``, when ``retry_after`` stable steps have passed."""
        if self.retry_after is None or self.precision == self.start or self.last_switch_step is None:
            return None
        if step - self.last_switch_step < self.retry_interval:
            return None
        return faster_rung(self.precision, self.start, ladder, info)

    def summary(self) -> str | None:
        """The fit's closing line (``None``: nothing happened to say)."""
        if not (self.switches or self.skipped_steps):
            return None
        n = len(self.switches)
        scaler_skips = self.skipped_steps - self.nonfinite_steps
        return (
            f"PrecisionSwitch: fit ended in {self.precision} after {n} switch{'es' if n != 1 else ''}; "
            f"{self.skipped_steps} optimizer step(s) not applied ({scaler_skips} skipped by the GradScaler, "
            f"{self.nonfinite_steps} held back for non-finite values), {self.rerun_batches} batch(es) run again"
        )


def fallbacks(
    current: str | None, ladder: Sequence[str], info: DeviceInfo | None, policy: str | None
) -> tuple[str, ...]:
    """The precisions a run can still fall back to from ``current`` (none under a fixed FSDP2 policy)."""
    if policy is not None:
        return ()
    return fallback_ladder(current, ladder, info)


def fallback_note(
    why_fixed: str | None, policy: str | None, precision: str | None, rungs: tuple[str, ...]
) -> str:
    """The setup line's part about what happens on persistent non-finite values."""
    if why_fixed is not None:
        return f"no runtime fallback: {why_fixed}"
    if policy is not None:
        return f"no runtime fallback: {policy}; non-finite steps are held back on every rank"
    if not rungs:
        return f"no more stable precision below {precision}: non-finite steps are held back"
    return f"falls back to {' → '.join(rungs)} on persistent non-finite values"
