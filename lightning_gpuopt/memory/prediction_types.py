"""What :func:`~lightning_gpuopt.memory.predict_peak` returns and takes: the categories of memory, the
parallel layout to emulate, the peak of each phase and of the step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from lightning_gpuopt._validate import positive_int
from lightning_gpuopt.memory.units import format_bytes

__all__ = [
    "MemoryCategory",
    "ParallelLayout",
    "PeakPrediction",
    "Phase",
    "PhasePeak",
    "PredictionInputError",
    "PredictionMethod",
]


class MemoryCategory(str, enum.Enum):
    """What a counted byte is for."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    INPUTS = "inputs"
    GATHERED = "gathered parameters"
    WORKSPACES = "kernel workspaces"  # held through the step (cuBLAS's)
    SCRATCH = "kernel scratch"  # allocated inside one operator call, for that call (CPU: measured)


class PredictionMethod(str, enum.Enum):
    """How a prediction was made."""

    TRACED = "traced"  # the step ran on fake tensors
    ESTIMATED = "estimated"  # tracing failed: the arithmetic estimate of memory/estimate.py


class Phase(str, enum.Enum):
    """Where in the step the peak happened."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer step"
    OTHER = "between phases"


@dataclass(frozen=True)
class ParallelLayout:
    """How the training state is distributed over ``world_size`` devices (the emulation of :func:`predict_peak`).

    Attributes:
        kind: ``"single"``, ``"ddp"`` or ``"fsdp"`` (FSDP2, ``fully_shard``).
        world_size: ranks sharing the sharded parts.
        gradient_as_bucket_view: DDP's gradients are views into its buckets (one copy of the gradients,
            alive from the start); ``False``: buckets and gradients (two copies).
        bucket_cap_bytes: DDP's bucket size (its ``bucket_cap_mb``).
        reshard_after_forward: FSDP2 frees a unit's gathered parameters after its forward (full
            sharding) or keeps them until its backward (sharding gradients and optimizer state only).
        cpu_offload: FSDP2 keeps sharded parameters, gradients and optimizer state in host memory.
        units: qualified names of the modules FSDP2 gathers one at a time; ``None``: each direct child
            of the model holding parameters.
        replicate_size: FSDP2 as HSDP: the ``world_size`` ranks form this many replicas, each sharding
            the state over :attr:`shard_size` ranks (its all-reduce across replicas runs in place on the
            sharded gradients); 1: sharded over every rank.

    Example:
        >>> ParallelLayout("fsdp", world_size=8).sharded
        True
        >>> ParallelLayout("fsdp", world_size=16, replicate_size=2).shard_size   # 2 nodes of 8: HSDP
        8
    """

    kind: str = "single"
    world_size: int = 1
    gradient_as_bucket_view: bool = False
    bucket_cap_bytes: int = 25 * 2**20
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    units: tuple[str, ...] | None = None
    replicate_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("single", "ddp", "fsdp"):
            raise ValueError(
                f"`kind` must be 'single', 'ddp' or 'fsdp', got {self.kind!r}: use 'fsdp' for FSDP2 (fully_shard)"
            )
        positive_int("world_size", self.world_size)
        if self.cpu_offload and self.kind != "fsdp":
            raise ValueError(f"`cpu_offload` needs kind='fsdp', got kind={self.kind!r}")
        r = self.replicate_size
        if isinstance(r, bool) or not isinstance(r, int) or r < 1 or self.world_size % r:
            raise ValueError(
                f"`replicate_size` must be a positive int dividing `world_size` ({self.world_size}), got {r!r}"
            )
        if r > 1 and self.kind != "fsdp":
            raise ValueError(f"`replicate_size` > 1 (HSDP) needs kind='fsdp', got kind={self.kind!r}")

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp"

    @property
    def shard_size(self) -> int:
        """Ranks the sharded state is divided among: ``world_size`` / ``replicate_size``."""
        return self.world_size // self.replicate_size


@dataclass(frozen=True)
class PhasePeak:
    """The highest device bytes within one phase of one step, with the breakdown at that moment.

    ``transient_bytes``: the most bytes of activations and temporaries alive at once in the phase (not
    necessarily at its peak): what the phase adds above the memory held through the step.
    """

    phase: str
    step: int
    peak_bytes: int
    categories: dict[str, int]
    modules: dict[str, int]
    module: str
    host_bytes: int
    transient_bytes: int = 0

    def at_peak(self) -> dict[str, Any]:
        """The fields a :class:`PeakPrediction` whose peak this phase holds takes from it (all but
        ``transient_bytes``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "transient_bytes"}


@dataclass(frozen=True)
class PeakPrediction:
    """A training step's predicted peak device memory and what it was made of at that moment.

    Attributes:
        peak_bytes: the highest device bytes allocated at once during the step (two steps: the first
            creates the optimizer state, the second is the steady state).
        categories: device bytes by :class:`MemoryCategory` value at the peak.
        modules: device bytes at the peak by the module that made them (qualified name; ``""``:
            outside any module: inputs, loss, optimizer, parameters of the root).
        phase: ``"forward"``, ``"backward"``, ``"optimizer step"`` or ``"between phases"``.
        step: 1 (the first step, optimizer state created) or 2 (the steady state).
        module: the innermost module running at the peak (``""``: none).
        host_bytes: bytes in host memory at the device peak (CPU offload), else 0.
        batch_size: samples in the batch predicted for.
        method: traced, or estimated when tracing failed (:attr:`decision` says why).
        device: the device type traced for.
        decision: why the prediction is an estimate, and what was guessed or extrapolated (``None``: nothing).
        phases: the peak of every phase of the two steps (forward, backward, optimizer step).
    """

    peak_bytes: int
    categories: dict[str, int]
    modules: dict[str, int]
    phase: str
    step: int
    module: str
    host_bytes: int
    batch_size: int
    method: PredictionMethod
    device: str
    decision: str | None = None
    phases: tuple[PhasePeak, ...] = ()

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.categories.items() if v)
        where = f"{self.phase} of step {self.step}" + (f" in {self.module}" if self.module else "")
        text = f"peak {format_bytes(self.peak_bytes)} ({self.method.value}, {where}): {parts}"
        if self.host_bytes:
            text += f"; host {format_bytes(self.host_bytes)}"
        if self.decision:
            text += f"; {self.decision}"
        return text


class PredictionInputError(ValueError):
    """What the caller must fix (no loss, no optimizer): raised, never turned into an estimate."""
