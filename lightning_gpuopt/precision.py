"""Pure decisions behind PrecisionSwitch: which precision a device runs best, where to fall back, when.

No Lightning here. :func:`device_info` is the one function that asks torch about the device (so
the selection table is unit-tested with mocked queries); :func:`choose_precision`,
:func:`fallback_ladder` and :class:`StabilityWatch` decide from plain values; :func:`grad_norms` and
:func:`any_nonfinite` are the few tensor operations the callback needs. The global TF32 switch, a side effect,
is ``tf32_switch.py``'s.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gpuopt import _compat
from lightning_gpuopt._compat import local_shard
from lightning_gpuopt._warnings import moved_names

__all__ = [
    "LADDER",
    "PRECISION_INDEX",
    "Choice",
    "DeviceInfo",
    "StabilityWatch",
    "StepOutcome",
    "any_nonfinite",
    "check_ladder",
    "choose_precision",
    "device_info",
    "fallback_ladder",
    "faster_rung",
    "fp8_available",
    "fsdp2_mixed_precision",
    "grad_norms",
    "grads_nonfinite",
    "is_faster",
    "precision_index",
    "tf32_wanted",
    "unsupported_reason",
]

#: The precisions a run can switch between at runtime, fastest first. All three keep float32
#: weights and optimizer state, so a switch needs no conversion (``*-true`` half precisions would).
LADDER: tuple[str, ...] = ("16-mixed", "bf16-mixed", "32-true")

#: The logged ``gpuopt/precision`` value of each precision name (higher: fewer bits in the math).
PRECISION_INDEX: dict[str, int] = {
    "64-true": 0,
    "32-true": 1,
    "bf16-mixed": 2,
    "16-mixed": 3,
    "bf16-true": 4,
    "16-true": 5,
    "transformer-engine": 6,
    "transformer-engine-float16": 7,
}

#: fp8 through NVIDIA Transformer Engine needs Ada or Hopper (compute capability 8.9) or newer.
FP8_MIN_CAPABILITY = (8, 9)
TF32_MIN_CAPABILITY = (8, 0)
FP16_MIN_CAPABILITY = (7, 0)


@dataclass(frozen=True)
class DeviceInfo:
    """What the precision choice needs to know about one device.

    Attributes:
        kind: ``"cuda"`` (NVIDIA or ROCm), ``"cpu"``, ``"mps"``, or another ``torch.device`` type.
        name: the device's name, for messages.
        capability: CUDA compute capability ``(major, minor)``; ``None`` off CUDA.
        bf16: bfloat16 runs natively (on CUDA: ``is_bf16_supported(including_emulation=False)``, not
            the emulation sm_7.x offers; on CPU: autocast works, slowly without AMX/AVX512-BF16; on MPS:
            macOS 14 or newer).
        fp16_autocast: float16 autocast is available on this device kind.
        hip: a ROCm (HIP) build: no TF32, no Transformer Engine.
    """

    kind: str
    name: str = ""
    capability: tuple[int, int] | None = None
    bf16: bool = False
    fp16_autocast: bool = True
    hip: bool = False

    @property
    def label(self) -> str:
        """``"NVIDIA A100-SXM4-80GB (sm_80)"``, ``"CPU"``: how messages name the device."""
        if self.kind == "cuda" and self.capability is not None:
            arch = "ROCm" if self.hip else f"sm_{self.capability[0]}{self.capability[1]}"
            return f"{self.name or 'CUDA device'} ({arch})"
        return self.name or self.kind.upper()


def device_info(device: torch.device | str) -> DeviceInfo:
    """Ask torch what ``device`` can do; the only device query of the precision choice (mock it in tests).

    Example:
        >>> device_info("cpu").kind
        'cpu'
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = tuple(torch.cuda.get_device_capability(index))
        try:
            bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # torch < 2.3 has no including_emulation: decide by the capability
            bf16 = capability >= (8, 0)
        return DeviceInfo(
            kind="cuda",
            name=torch.cuda.get_device_name(index),
            capability=(int(capability[0]), int(capability[1])),
            bf16=bf16,
            fp16_autocast=True,
            hip=torch.version.hip is not None,
        )
    if device.type == "cpu":
        return DeviceInfo(kind="cpu", name="CPU", bf16=True, fp16_autocast=True)
    if device.type == "mps":
        newer = getattr(torch.backends.mps, "is_macos_or_newer", None)
        bf16 = bool(newer(14, 0)) if callable(newer) else False
        return DeviceInfo(kind="mps", name="MPS", bf16=bf16, fp16_autocast=_autocast_available("mps"))
    return DeviceInfo(kind=device.type, name=device.type.upper(), bf16=False, fp16_autocast=False)


def _autocast_available(kind: str) -> bool:
    check = getattr(torch.amp, "is_autocast_available", None)
    return bool(check(kind)) if callable(check) else False


def fp8_available() -> bool:
    """Whether NVIDIA Transformer Engine is importable (``pip install transformer-engine[pytorch]``)."""
    return importlib.util.find_spec("transformer_engine") is not None


@dataclass(frozen=True)
class Choice:
    """The setup-time choice: a Lightning precision name and why."""

    precision: str
    reason: str


def choose_precision(
    info: DeviceInfo, *, cpu_bf16: bool = False, fp8: bool = False, fp8_installed: bool = False
) -> Choice:
    """The fastest precision ``info``'s device runs well, by compute capability, never by emulation.

    CUDA: native bf16 (sm >= 8.0) → ``bf16-mixed``; sm 7.x → ``16-mixed`` (GradScaler); older →
    ``32-true``. ``fp8=True`` asks for ``transformer-engine`` where it is installed and sm >= 8.9.
    CPU → ``32-true`` (``bf16-mixed`` with ``cpu_bf16=True``). MPS → ``16-mixed`` where autocast
    runs there, else ``32-true``. (TF32 for ``32-true`` runs: :func:`tf32_wanted`.)

    Example:
        >>> choose_precision(DeviceInfo("cuda", "V100", (7, 0))).precision
        '16-mixed'
        >>> choose_precision(DeviceInfo("cuda", "A100", (8, 0), bf16=True)).precision
        'bf16-mixed'
    """
    if info.kind == "cuda" and info.capability is not None:
        cap = info.capability
        if fp8 and fp8_installed and not info.hip and cap >= FP8_MIN_CAPABILITY:
            return Choice("transformer-engine", f"fp8 asked for and {info.label} runs it (sm >= 8.9)")
        wish = ""
        if fp8:
            wish = (
                "fp8 asked for, but transformer-engine is not installed; "
                if not fp8_installed
                else f"fp8 asked for, but {info.label} is older than sm_89; "
            )
        if info.bf16:
            return Choice("bf16-mixed", f"{wish}{info.label} runs bfloat16 natively")
        if cap >= FP16_MIN_CAPABILITY or info.hip:
            return Choice("16-mixed", f"{wish}{info.label} has float16 tensor cores but no native bfloat16")
        return Choice("32-true", f"{wish}{info.label} has no fast float16 or bfloat16 math")
    if info.kind == "cpu":
        if cpu_bf16:
            return Choice("bf16-mixed", "CPU with cpu_bf16=True")
        return Choice("32-true", "CPU (bfloat16 is opt-in: cpu_bf16=True)")
    if info.kind == "mps":
        if info.fp16_autocast:
            return Choice("16-mixed", "Apple GPU (MPS) runs float16 natively")
        return Choice("32-true", "MPS without autocast in this torch version")
    return Choice("32-true", f"{info.label}: no mixed-precision rule for this device kind")


def tf32_wanted(info: DeviceInfo, precision: str, tf32: bool = True) -> bool:
    """Whether to turn TF32 matmuls on: ``precision`` is ``32-true`` on an NVIDIA GPU with sm >= 8.0."""
    return (
        tf32
        and precision == "32-true"
        and info.kind == "cuda"
        and not info.hip
        and info.capability is not None
        and info.capability >= TF32_MIN_CAPABILITY
    )


def unsupported_reason(precision: str, info: DeviceInfo) -> str | None:
    """Why ``info``'s device cannot run ``precision`` (a ladder name), or ``None`` when it can.

    Example:
        >>> unsupported_reason("bf16-mixed", DeviceInfo("cuda", "V100", (7, 0)))
        'V100 (sm_70) has no native bfloat16 (emulated on sm_7.x: slower than float32)'
    """
    if precision == "bf16-mixed" and not info.bf16:
        if info.kind == "cuda":
            return f"{info.label} has no native bfloat16 (emulated on sm_7.x: slower than float32)"
        return f"{info.label} has no bfloat16 autocast"
    if precision == "16-mixed" and not info.fp16_autocast:
        return f"{info.label} has no float16 autocast"
    return None


def check_ladder(ladder: Iterable[str]) -> tuple[str, ...]:
    """Validate a user's ladder: names from :data:`LADDER`, no repeats, fastest first; returns it as a tuple.

    Raises:
        TypeError: ``ladder`` is a string or not iterable.
        ValueError: an unknown name, a repeat, the wrong order, or an empty ladder.

    Example:
        >>> check_ladder(["16-mixed", "32-true"])
        ('16-mixed', '32-true')
    """
    if isinstance(ladder, str):
        raise TypeError(
            f"`ladder` must be a sequence of precision names such as {LADDER}, got the string {ladder!r}"
        )
    rungs = tuple(ladder)
    unknown = [r for r in rungs if r not in LADDER]
    if unknown:
        raise ValueError(
            f"`ladder` names must be among {LADDER} (precisions that keep float32 weights, so a switch needs no "
            f"conversion), got {unknown!r}. Remove them, or use the Trainer's `precision` for other precisions."
        )
    if not rungs:
        raise ValueError(f"`ladder` must name at least one precision from {LADDER}, got an empty ladder")
    if len(set(rungs)) != len(rungs):
        raise ValueError(f"`ladder` must not repeat a precision, got {rungs!r}")
    ordered = tuple(r for r in LADDER if r in rungs)
    if rungs != ordered:
        raise ValueError(
            f"`ladder` must go from the fastest precision to the most stable one, {ordered!r}, got {rungs!r}"
        )
    return rungs


def fallback_ladder(current: str, rungs: Sequence[str], info: DeviceInfo) -> tuple[str, ...]:
    """The precisions to fall back to from ``current``, in order: the rungs below it the device runs.

    A ``current`` precision off :data:`LADDER` (``bf16-true``, ``64-true``, ``transformer-engine``)
    has no runtime fallback.

    Example:
        >>> fallback_ladder("16-mixed", LADDER, DeviceInfo("cuda", "V100", (7, 0)))
        ('32-true',)
        >>> fallback_ladder("16-mixed", LADDER, DeviceInfo("cuda", "A100", (8, 0), bf16=True))
        ('bf16-mixed', '32-true')
    """
    if current not in LADDER:
        return ()
    below = LADDER[LADDER.index(current) + 1 :]
    return tuple(r for r in below if r in rungs and unsupported_reason(r, info) is None)


def faster_rung(current: str, start: str, rungs: Sequence[str], info: DeviceInfo) -> str | None:
    """The next faster precision to try again after a fallback: one rung up, never above ``start``."""
    if current not in LADDER or start not in LADDER:
        return None
    above = [r for r in LADDER[LADDER.index(start) : LADDER.index(current)] if r == start or r in rungs]
    above = [r for r in above if unsupported_reason(r, info) is None]
    return above[-1] if above else None


def precision_index(precision: str) -> int:
    """The ``gpuopt/precision`` value logged for ``precision`` (-1 for a name not in :data:`PRECISION_INDEX`)."""
    return PRECISION_INDEX.get(precision, -1)


# ----------------------------------------------------------------------------- watching


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step showed.

    Attributes:
        applied: the optimizer step was applied.
        scaler: a GradScaler (``16-mixed``) was in charge of the step.
        loss_finite: the loss of the step's window was finite.
        scale: the GradScaler's scale after its update (read only after a skipped step; ``None``: unknown).
    """

    applied: bool
    scaler: bool = False
    loss_finite: bool = True
    scale: float | None = None


@dataclass
class StabilityWatch:
    """Tells persistent numerical trouble from the GradScaler's normal skips; counts troubled steps.

    A troubled step is one not applied because its loss was not finite (any precision), or because
    its gradients were not finite without a GradScaler (``bf16-mixed``, ``32-true``). A GradScaler's
    skip with a finite loss is its normal calibration (overflowing gradients, a smaller scale next
    time) and is not trouble, unless the scale falls below ``min_scale``: then float16 cannot hold
    the gradients even unscaled. ``patience`` troubled steps in a row, or such a scale, say switch.

    Args:
        patience: troubled optimizer steps in a row that ask for a switch (>= 1).
        min_scale: the GradScaler scale below which float16 is given up (> 0).

    Example:
        >>> watch = StabilityWatch(patience=2)
        >>> watch.observe(StepOutcome(applied=False, scaler=True, loss_finite=True, scale=32768.0)) is None
        True
        >>> watch.observe(StepOutcome(applied=False, scaler=True, loss_finite=False, scale=16384.0)) is None
        True
        >>> watch.observe(StepOutcome(applied=False, scaler=True, loss_finite=False, scale=8192.0))
        'the loss was not finite in 2 steps in a row'
    """

    patience: int = 2
    min_scale: float = 1.0
    #: Troubled steps in a row.
    consecutive: int = 0
    #: The GradScaler's scale read after the latest skipped step, while no step was applied since.
    last_scale: float | None = None

    def verdict(self, outcome: StepOutcome) -> str | None:
        """Why ``outcome`` asks for a switch, given the steps before it; ``None``: it does not. Records nothing."""
        if outcome.applied:
            return None
        if outcome.scaler and outcome.scale is not None and outcome.scale < self.min_scale:
            return (
                f"the loss scale fell to {outcome.scale:g}, below min_scale={self.min_scale:g}: the gradients "
                "overflow float16 even unscaled"
            )
        if self._troubled(outcome) and self.consecutive + 1 >= self.patience:
            what = "loss was" if not outcome.loss_finite else "gradients were"
            return f"the {what} not finite in {self.consecutive + 1} step{'s' if self.consecutive else ''} in a row"
        return None

    def record(self, outcome: StepOutcome) -> None:
        """Count ``outcome`` in."""
        if outcome.applied:
            self.consecutive = 0
            self.last_scale = None
            return
        if outcome.scaler and outcome.scale is not None:
            self.last_scale = outcome.scale
        if self._troubled(outcome):
            self.consecutive += 1

    def observe(self, outcome: StepOutcome) -> str | None:
        """:meth:`verdict` then :meth:`record`."""
        reason = self.verdict(outcome)
        self.record(outcome)
        return reason

    def armed(self, backoff: float | None = None) -> bool:
        """Whether one more troubled step would ask for a switch (so the next step is checked before it applies).

        Args:
            backoff: the GradScaler's backoff factor (``None`` without a GradScaler).
        """
        if self.consecutive + 1 >= self.patience:
            return True
        return (
            backoff is not None and self.last_scale is not None and self.last_scale * backoff < self.min_scale
        )

    def reset(self) -> None:
        """Start over (after a switch: a new precision, a new GradScaler)."""
        self.consecutive = 0
        self.last_scale = None

    @staticmethod
    def _troubled(outcome: StepOutcome) -> bool:
        return not outcome.loss_finite or not outcome.scaler


# ----------------------------------------------------------------------------- torch-level helpers


def fsdp2_mixed_precision(precision: str) -> object | None:
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning ``precision`` name, or ``None`` when FSDP2's default serves.

    ``bf16-mixed``: parameters all-gathered and computed in bfloat16, gradients reduce-scattered in
    float32, the sharded parameters (what the optimizer steps) float32. Other names: ``None``.

    Example:
        >>> policy = fsdp2_mixed_precision("bf16-mixed")
        >>> policy.param_dtype, policy.reduce_dtype
        (torch.bfloat16, torch.float32)
        >>> fsdp2_mixed_precision("32-true") is None
        True
    """
    if precision != "bf16-mixed":
        return None
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def grad_norms(grads: Iterable[Tensor | None]) -> list[Tensor]:
    """The L2 norm of each gradient in float32 (float64 for float64 gradients), one fused kernel per device and
    dtype (``_compat.foreach_norm``).

    A sharded gradient (FSDP2's ``DTensor``) counts by this rank's shard only: the non-finite check reads
    each rank's own shard and all-reduces the flag, no collective per tensor.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        if g is not None:
            g = local_shard(g)
        if g is not None and not g.is_sparse:
            groups.setdefault((g.device, g.dtype), []).append(g)
    norms: list[Tensor] = []
    for (_, dtype), tensors in groups.items():
        wide = torch.promote_types(dtype, torch.float32)  # float64 gradients keep float64 (no narrowing)
        try:
            norms.extend(_compat.foreach_norm(tensors, wide))
        except (AttributeError, TypeError, RuntimeError):  # a torch without the fused norm for this group
            norms.extend(torch.linalg.vector_norm(t, 2, dtype=wide) for t in tensors)
    return norms


def any_nonfinite(scalars: Sequence[Tensor], device: torch.device) -> Tensor:
    """1.0 when one of the 0-dim ``scalars`` (losses, norms) is inf or NaN, else 0.0, on ``device``: no host sync.

    Their float32 sum is inf or NaN exactly then (or when it overflows float32, beyond 3.4e38).
    """
    if not scalars:
        return torch.zeros((), device=device)
    parts = [
        t
        if t.dtype == torch.float32 and t.device == device and t.dim() == 0
        else t.detach().to(device=device, dtype=torch.float32).reshape(())
        for t in scalars
    ]
    return (~torch.isfinite(torch.stack(parts).sum())).float()


def grads_nonfinite(grads: Iterable[Tensor | None], device: torch.device) -> Tensor:
    """1.0 when a gradient is not finite, else 0.0, on ``device``: no host sync.

    An inf or NaN element makes its norm, and so the sum of the norms, inf or NaN. Gradients so large
    that their norm overflows float32 (elements beyond about 1e19) count as not finite too: never a
    false "finite".
    """
    return any_nonfinite(grad_norms(grads), device)


def is_faster(a: str, b: str) -> bool:
    """Whether ladder precision ``a`` is faster (earlier in the ladder) than ``b``."""
    return a in LADDER and b in LADDER and LADDER.index(a) < LADDER.index(b)


# The global TF32 switch is a side effect, not a decision: it moved to ``tf32_switch.py`` (issue 35).
__getattr__ = moved_names(
    __name__,
    {
        "enable_tf32": "lightning_gpuopt.tf32_switch.turn_on_tf32",
        "restore_tf32": "lightning_gpuopt.tf32_switch.restore_tf32",
    },
)
