"""Predict a training step's peak device memory without allocating it: :func:`predict_peak`.

The user's own training step -- forward (a LightningModule's ``training_step``, found by duck typing:
this module imports torch only), ``zero_grad``, backward and the optimizer step, state creation
included -- runs twice (the first step creates the optimizer state; the second is the steady state,
where the previous step's gradients are alive during the forward) on *fake tensors*
(``torch._subclasses.fake_tensor.FakeTensorMode``): every operator computes its output's shape,
dtype and device, and nothing of the step is allocated (on the CPU, each distinct operator call
runs once on zeros to measure what its kernel allocates inside itself: :mod:`.scratch`). A ``TorchDispatchMode`` above the fake mode sees every
new storage, counts its bytes until its last reference dies (a weakref finalizer), sorts it into a
category (parameters, buffers, gradients, optimizer state, activations, temporaries, inputs, gathered
parameters) and the module that made it, and keeps the breakdown at the highest total.

The precision is applied as Lightning applies it (autocast around the forward for ``*-mixed``,
converted weights and inputs for ``*-true``). Distribution is emulated per device: DDP's gradient
buckets (:class:`ParallelLayout`), FSDP2's sharded parameters, gradients and optimizer state plus the
unit gathered while it computes, and CPU offload (sharded state in host memory, reported apart).

torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` does the same counting (it works
under ``FakeTensorMode``); it is not used here because it counts each storage at its own size (the
emulation of sharding and offload needs to count a storage at a shard's size, or on the host), it
refuses a second iteration of the root module (the steady-state step) without dropping its module
statistics, and it lives in a private package. docs/memory.md says what is modelled and what is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import math
import os
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_gpuopt.memory._ops import alias_mask
from lightning_gpuopt.memory.units import format_bytes

__all__ = [
    "BATCH_CATEGORIES",
    "MemoryCategory",
    "ParallelLayout",
    "PeakLine",
    "PeakPrediction",
    "PhasePeak",
    "PredictionMethod",
    "optimizer_in",
    "predict_peak",
    "predict_peak_deep",
    "predict_peak_line",
    "repeated_blocks",
    "scale_to_batch",
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
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"`world_size` must be a positive int, got {self.world_size!r}")
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


# ---------------------------------------------------------------------------------------------------
# The counter: a dispatch mode above FakeTensorMode that counts each new storage until it dies.
# ---------------------------------------------------------------------------------------------------
_DATA_DEPENDENT = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}


def _storage_key(t: torch.Tensor) -> tuple[Any, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage, storage._cdata


@dataclass
class _Record:
    nbytes: int
    category: MemoryCategory
    module: str
    host: bool = False
    raw: int = 0  # the storage's own bytes when counted (a resize scales the counted bytes)


#: What a phase adds above the memory held through the step.
_TRANSIENT = (MemoryCategory.ACTIVATIONS, MemoryCategory.TEMPORARIES, MemoryCategory.SCRATCH)


class _Counter(TorchDispatchMode):
    """Counts live storages by category and module; keeps the breakdown at the peak."""

    def __init__(
        self,
        device_type: str,
        rounding: Callable[[int], int] | None = None,
        scratch: Callable[[Any, tuple, dict, Any], Any] | None = None,
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self.scratch = scratch  # what a kernel allocates that fake tensors do not show (memory/scratch.py)
        self.rounding = rounding or (lambda n: n)
        self.records: dict[int, _Record] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.device_total = 0
        self.host_total = 0
        self.peak = 0
        self.peak_state: tuple = (Phase.OTHER, 0, "", 0, {}, {})
        self._peak_pending = False
        self._peak_where: tuple = (Phase.OTHER, 0, "", 0)
        self.by_category: dict[MemoryCategory, int] = {}
        self.by_module: dict[str, int] = {}
        self.phase_peaks: list[tuple[int, tuple, int]] = []  # (peak, state at it, transient peak)
        self.transient = 0  # bytes of activations and temporaries alive now
        self.transient_peak = 0
        self.phase = Phase.OTHER
        self.step = 0
        self.module_stack: list[str] = []
        self.in_backward = False
        self.scale: int = 1  # sharded optimizer steps: every allocation is a shard
        self.host_phase = False  # offloaded optimizer steps: allocations live on the host
        self.guessed: set[str] = set()  # data-dependent operators answered with a guess

    # --- accounting --------------------------------------------------------------------------------
    def default_category(self) -> MemoryCategory:
        if self.phase is Phase.OPTIMIZER:
            return MemoryCategory.TEMPORARIES
        if self.phase is Phase.BACKWARD or self.in_backward:
            return MemoryCategory.TEMPORARIES
        if self.phase is Phase.FORWARD:
            return MemoryCategory.ACTIVATIONS
        return MemoryCategory.TEMPORARIES

    def add(
        self,
        t: torch.Tensor,
        category: MemoryCategory | None = None,
        nbytes: int | None = None,
        host: bool | None = None,
        module: str | None = None,
    ) -> None:
        found = _storage_key(t)
        if found is None:
            return
        storage, key = found
        if key in self.records:
            return
        size = storage.nbytes() if nbytes is None else nbytes
        if nbytes is None and self.scale > 1:
            size = -(-size // self.scale)
        if size == 0:
            return
        rec = _Record(
            self.rounding(size),
            category or self.default_category(),
            self.module_stack[-1] if module is None and self.module_stack else (module or ""),
            self.host_phase if host is None else host,
            storage.nbytes(),
        )
        self.records[key] = rec
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self._charge(rec, +1)

    def _charge(self, rec: _Record, sign: int) -> None:
        if rec.host:
            self.host_total += sign * rec.nbytes
            return
        if sign < 0 and self._peak_pending:
            self._snapshot()  # the state just before the first free after a new high is the peak's
        self.device_total += sign * rec.nbytes
        self.by_category[rec.category] = self.by_category.get(rec.category, 0) + sign * rec.nbytes
        self.by_module[rec.module] = self.by_module.get(rec.module, 0) + sign * rec.nbytes
        if rec.category in _TRANSIENT:
            self.transient += sign * rec.nbytes
            self.transient_peak = max(self.transient_peak, self.transient)
        if sign > 0 and self.device_total > self.peak:
            self.peak = self.device_total
            self._peak_pending = True
            self._peak_where = (
                self.phase,
                self.step,
                self.module_stack[-1] if self.module_stack else "",
                self.host_total,
            )

    def _free(self, key: int) -> None:
        rec = self.records.pop(key, None)
        self._refs.pop(key, None)
        if rec is not None:
            self._charge(rec, -1)

    def update(
        self,
        t: torch.Tensor,
        category: MemoryCategory | None = None,
        nbytes: int | None = None,
        host: bool | None = None,
        module: str | None = None,
    ) -> None:
        """Re-classify (or re-size, or move) a counted storage; counts it first when new."""
        found = _storage_key(t)
        if found is None:
            return
        _, key = found
        rec = self.records.get(key)
        if rec is None:
            self.add(t, category, nbytes, host, module)
            return
        self._charge(rec, -1)
        if module is not None:
            rec.module = module
        if category is not None:
            rec.category = category
        if nbytes is not None:
            rec.nbytes = self.rounding(nbytes)
        if host is not None:
            rec.host = host
        self._charge(rec, +1)

    def category_of(self, t: torch.Tensor) -> MemoryCategory | None:
        found = _storage_key(t)
        rec = self.records.get(found[1]) if found else None
        return rec.category if rec else None

    def _snapshot(self) -> None:
        self._peak_pending = False
        self.peak_state = (*self._peak_where, dict(self.by_category), dict(self.by_module))

    def finish(self) -> None:
        if self._peak_pending:
            self._snapshot()

    def start_phase(self, phase: Phase) -> None:
        """Close the running phase (its peak is kept) and start ``phase`` with a fresh peak."""
        self.finish()
        if self.peak_state[1]:  # a step's phase: keep its peak
            self.phase_peaks.append((self.peak, self.peak_state, self.transient_peak))
        self.phase = phase
        self.transient_peak = self.transient
        self.peak = self.device_total
        self._peak_where = (phase, self.step, "", self.host_total)
        self._snapshot()

    def add_second_step(self, extra: dict[Phase, dict[MemoryCategory, int]]) -> None:
        """The second step's phase peaks: the first step's, with ``extra`` bytes alive."""
        for peak, (phase, _step, module, host, cats, mods), transient in list(self.phase_peaks):
            add = extra.get(phase)
            if add is None:
                continue
            cats = dict(cats)
            for category, nbytes in add.items():
                cats[category] = cats.get(category, 0) + nbytes
            mods = dict(mods)
            mods[""] = mods.get("", 0) + sum(add.values())
            self.phase_peaks.append(
                (peak + sum(add.values()), (phase, 2, module, host, cats, mods), transient)
            )

    def best(self) -> tuple:
        """The highest phase peak (the earliest of equal ones)."""
        return max(self.phase_peaks, key=lambda item: item[0], default=(self.peak, self.peak_state, 0))

    def peak_breakdown(self, state: tuple) -> tuple[dict[str, int], dict[str, int]]:
        categories = {c.value: state[4].get(c, 0) for c in MemoryCategory}
        modules = {k: v for k, v in state[5].items() if v}
        return categories, dict(sorted(modules.items(), key=lambda kv: -kv[1]))

    # --- the mode ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _DATA_DEPENDENT:
            # A value fake tensors do not have (``.item()``, ``torch.equal``): guess the common case (a
            # mask is what it is checked to be, a count is 1) and say so in the prediction.
            self.guessed.add(str(func.overloadpacket.__name__))
            dtype = args[0].dtype if args and isinstance(args[0], torch.Tensor) else torch.bool
            if func is not torch.ops.aten._local_scalar_dense.default or dtype is torch.bool:
                return True
            return 1.0 if dtype.is_floating_point else 1
        out = func(*args, **(kwargs or {}))
        mask = alias_mask(func)
        if isinstance(out, torch.Tensor):
            if not (mask and mask[0]):
                self._new(out)
        elif isinstance(out, (tuple, list)):
            if len(mask) == 1:
                mask = mask * len(out)
            for item, is_alias in zip(out, mask):
                if is_alias:
                    continue
                if isinstance(item, torch.Tensor):
                    self._new(item)
                elif isinstance(item, (tuple, list)):
                    for sub in item:
                        if isinstance(sub, torch.Tensor):
                            self._new(sub)
        # In-place ops that resize (out=, resize_) change a counted storage's size.
        if mask and mask[0] and isinstance(out, torch.Tensor):
            found = _storage_key(out)
            if found is not None and found[1] in self.records:
                rec = self.records[found[1]]
                raw = found[0].nbytes()
                if raw != rec.raw and rec.raw:
                    self._charge(rec, -1)
                    rec.nbytes = self.rounding(rec.nbytes * raw // rec.raw)
                    rec.raw = raw
                    self._charge(rec, +1)
        if self.scratch is not None:
            self._kernel_cost(self.scratch(func, args, kwargs or {}, out, self._enlarged), out)
        return out

    def _enlarged(self, t: torch.Tensor) -> int | None:
        """The real bytes of a storage counted larger than its fake (an opaque workspace), else None."""
        found = _storage_key(t)
        rec = self.records.get(found[1]) if found else None
        return rec.nbytes if rec is not None and rec.nbytes > found[0].nbytes() else None

    def _kernel_cost(self, cost: Any, out: Any) -> None:
        if cost.outputs is not None:  # outputs larger for real (a workspace its fake gives no size)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            for t, nbytes in zip(outs, cost.outputs):
                found = _storage_key(t)
                if found is not None and nbytes > found[0].nbytes():
                    self.update(t, nbytes=nbytes)  # counts it first when new (an empty fake storage)
        if cost.scratch:  # alive with the outputs, for the call only
            module = self.module_stack[-1] if self.module_stack else ""
            rec = _Record(self.rounding(cost.scratch), MemoryCategory.SCRATCH, module, self.host_phase)
            self._charge(rec, +1)
            self._charge(rec, -1)

    def _new(self, t: torch.Tensor) -> None:
        if t.device.type == "cpu" and self.device_type != "cpu":
            return  # host tensors (a CPU scalar, an index list) are not device memory
        self.add(t)


# ---------------------------------------------------------------------------------------------------
# Fake copies of the model's state and the batch
# ---------------------------------------------------------------------------------------------------
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _precision_dtypes(precision: str | int | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(dtype weights are converted to, autocast dtype) for a Lightning precision."""
    p = str(precision if precision is not None else "32-true")
    if p in ("64", "64-true", "double"):
        return torch.float64, None
    if p in ("bf16-true", "bf16"):
        return torch.bfloat16, None
    if p in ("16-true", "16", "half"):
        return torch.float16, None
    if p in ("bf16-mixed",):
        return None, torch.bfloat16
    if p in ("16-mixed",):
        return None, torch.float16
    if p in ("32-true", "32", "32-bit"):
        return None, None
    raise ValueError(
        f"`precision` must be a Lightning precision ('32-true', 'bf16-mixed', '16-mixed', 'bf16-true', "
        f"'16-true', '64-true'), got {precision!r}"
    )


def _fake_like(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    # Inside the fake mode: a fake tensor of the same shape and strides, no memory behind it.
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype or t.dtype, device=device)


class _FakeState:
    """Swaps a module's parameters, buffers and plain tensor attributes for fake ones, and back.

    Shared tensors stay shared: an attribute that shares a parameter's or buffer's storage becomes a view
    of its fake, attributes sharing a storage become views of one fake of that storage (counted once, as
    buffers). What the traced step added or changed is put back as it was: attributes, the items of a
    list or dict attribute, and parameters, buffers or submodules registered during the trace (a cache
    made on the first forward). A fake still reachable after that is warned about.
    """

    _TABLES = ("_parameters", "_buffers", "_modules")

    def __init__(self, model: nn.Module, device: torch.device, weight_dtype: torch.dtype | None) -> None:
        self.model = model
        self.device = device
        self.weight_dtype = weight_dtype
        self.undo: list[tuple[dict, str, Any]] = []
        self.mapping: dict[int, torch.Tensor] = {}
        self.attributes: list[torch.Tensor] = []  # fakes of the storages of plain tensor attributes
        self._before: list[tuple[nn.Module, dict[str, Any], dict[str, Any], dict[str, set[str]]]] = []

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.weight_dtype if self.weight_dtype is not None and t.dtype in _FLOATS else t.dtype

    def swap(self) -> None:
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # real storage -> (real, its fake)
        modules = list(self.model.modules())
        for module in modules:
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    new = self.mapping.get(id(t))
                    if new is None:
                        fake = _fake_like(t, self.device, self._dtype(t))
                        new = nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                        self.mapping[id(t)] = new
                        found = _storage_key(t)
                        if found is not None:
                            shared.setdefault(found[1], (t, new))
                    self.undo.append((table, name, t))
                    table[name] = new
        bases: dict[int, torch.Tensor] = {}
        for module in modules:
            contents = {
                k: (list(v) if isinstance(v, list) else dict(v))
                for k, v in module.__dict__.items()
                if type(v) in (list, dict)
            }
            tables = {t: set(getattr(module, t)) for t in self._TABLES}
            self._before.append((module, dict(module.__dict__), contents, tables))
            for name, t in list(module.__dict__.items()):
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                    module.__dict__[name] = self._attribute(t, shared, bases)

    def _attribute(
        self,
        t: torch.Tensor,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
        bases: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        """A fake for a plain tensor attribute: a view of the fake it shares a storage with."""
        found = _storage_key(t)
        key = found[1] if found is not None else None
        if key in shared:  # a parameter's or buffer's storage (spectral_norm: weight = weight_orig.data)
            real, fake = shared[key]
            if fake.dtype == t.dtype:
                with contextlib.suppress(RuntimeError):
                    offset = t.storage_offset() - real.storage_offset()
                    return fake.detach().as_strided(
                        tuple(t.shape), tuple(t.stride()), fake.storage_offset() + offset
                    )
            return _fake_like(t, self.device, t.dtype)  # not counted: it is the parameter's memory
        base = bases.get(key) if key is not None else None
        if base is None:
            numel = found[0].nbytes() // t.element_size() if found is not None else t.numel()
            base = torch.empty(max(numel, 1), dtype=t.dtype, device=self.device)
            self.attributes.append(base)
            if key is not None:
                bases[key] = base
        try:
            return base.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())
        except RuntimeError:
            return _fake_like(t, self.device, t.dtype)

    def restore(self) -> None:
        for table, name, t in reversed(self.undo):
            table[name] = t
        self.undo = []
        left = []
        for module, before, contents, tables in reversed(self._before):
            for table_name, names in tables.items():  # registered during the trace: a cache, removed
                table = getattr(module, table_name)
                for name in [k for k in table if k not in names]:
                    del table[name]
            for name in list(module.__dict__):
                value = module.__dict__[name]
                if not _holds_fake(value):
                    continue
                if name not in before:
                    del module.__dict__[name]
                elif value is not before[name]:
                    module.__dict__[name] = before[name]
                elif name in contents:  # a list or dict the step changed in place
                    old = contents[name]
                    if isinstance(value, list):
                        value[:] = old
                    else:
                        value.clear()
                        value.update(old)
                if _holds_fake(module.__dict__.get(name)):
                    left.append(f"{type(module).__name__}.{name}")
        self._before = []
        if left:
            import warnings

            warnings.warn(
                f"predict_peak could not put back {', '.join(sorted(set(left)))}: the traced step changed a "
                "container nested in it, which still holds a fake tensor. Rebuild the model (or that "
                "attribute) before training it.",
                stacklevel=3,
            )


def _holds_fake(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` is a fake tensor, or a list, tuple or dict holding one (two levels deep)."""
    if isinstance(value, torch.Tensor):
        return getattr(value, "fake_mode", None) is not None
    if depth and isinstance(value, (list, tuple)):
        return any(_holds_fake(v, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return any(_holds_fake(v, depth - 1) for v in value.values())
    return False


def _fake_batch(batch: Any, device: torch.device, input_dtype: torch.dtype | None) -> Any:
    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dtype = input_dtype if input_dtype is not None and x.dtype in _FLOATS else x.dtype
        return torch.empty(tuple(x.shape), dtype=dtype, device=device)

    return tree_map(convert, batch)


def _rebuild_optimizer(
    optimizer: torch.optim.Optimizer, mapping: dict[int, torch.Tensor]
) -> torch.optim.Optimizer:
    """The same optimizer type and hyperparameters over the fake parameters, without state."""
    groups = []
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k != "params"}
        new["params"] = [mapping.get(id(p), p) for p in group["params"]]
        groups.append(new)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **kwargs)


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    loss = getattr(output, "loss", None)  # Hugging Face ModelOutput
    return loss if isinstance(loss, torch.Tensor) else None


def optimizer_in(configured: Any) -> torch.optim.Optimizer | None:
    """The first optimizer in what ``configure_optimizers`` returned, or ``None``.

    Accepts an optimizer, a dict with an ``"optimizer"`` key, and lists or tuples of either (nested a few deep).

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> optimizer_in(([{"optimizer": opt}], [])) is opt
        True
    """
    out = configured
    for _ in range(4):
        if isinstance(out, torch.optim.Optimizer):
            return out
        if isinstance(out, Mapping):
            out = out.get("optimizer")
        elif isinstance(out, (list, tuple)) and out:
            out = out[0]
        else:
            return None
    return out if isinstance(out, torch.optim.Optimizer) else None


def _optimizer_from_configure(module: Any) -> torch.optim.Optimizer | None:
    configure = getattr(module, "configure_optimizers", None)
    return optimizer_in(configure()) if callable(configure) else None


# ---------------------------------------------------------------------------------------------------
# Emulation of the distributed strategies
# ---------------------------------------------------------------------------------------------------
def _ddp_buckets(params: list[nn.Parameter], cap: int) -> list[tuple[int, list[nn.Parameter]]]:
    """DDP's buckets: parameters in reverse order, the first bucket 1 MiB, the others ``cap`` bytes."""
    buckets: list[tuple[int, list[nn.Parameter]]] = []
    current: list[nn.Parameter] = []
    size, limit = 0, min(cap, 2**20)
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > limit:
            buckets.append((size, current))
            current, size, limit = [], 0, cap
        current.append(p)
        size += nbytes
    if current:
        buckets.append((size, current))
    return buckets


def _fsdp_units(model: nn.Module, names: tuple[str, ...] | None) -> list[tuple[str, nn.Module]]:
    modules = dict(model.named_modules())
    if names:
        units = [(n, modules[n]) for n in names if n in modules]
    else:
        units = []
    covered = {id(p) for _, u in units for p in u.parameters()}
    for name, child in model.named_children():
        if any(id(p) not in covered for p in child.parameters()):
            units.append((name, child))
            covered.update(id(p) for p in child.parameters())
    if any(id(p) not in covered for p in model.parameters(recurse=False)):
        units.append(("", model))
    return units


def _shard_bytes(t: torch.Tensor, world: int) -> int:
    """Bytes of one rank's shard: FSDP2 pads dim 0 to a multiple of the world size."""
    if t.dim() == 0:
        return t.element_size()
    rows = -(-t.shape[0] // world)
    return rows * (t.numel() // max(1, t.shape[0])) * t.element_size()


# ---------------------------------------------------------------------------------------------------
# The prediction
# ---------------------------------------------------------------------------------------------------
def _batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return 1
    for v in values:
        n = _batch_size_of(v)
        if n:
            return n
    return 1


def predict_peak(
    model: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer
    | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    | None = None,
    *,
    step: Callable[[nn.Module, Any], Any] | None = None,
    precision: str | None = "32-true",
    layout: ParallelLayout | None = None,
    device: torch.device | str = "cpu",
    rounding: Callable[[int], int] | None = None,
    workspace_bytes: int | None = None,
    kernel_scratch: bool | None = None,
    fallback: bool = True,
) -> PeakPrediction:
    """Predict the peak device memory of training ``model`` on ``batch``, without allocating it.

    Runs two training steps in Lightning's order -- forward, ``zero_grad(set_to_none=True)``,
    backward, optimizer step -- on fake tensors (nothing of the step is allocated, nothing in ``model``
    changes: its parameters, buffers and tensor attributes are swapped for fake ones during the trace
    and put back; for the CPU, ``kernel_scratch`` runs single operator calls), counting every storage
    the step makes until it dies. The peak is per device (``layout``: DDP's buckets, FSDP2's shards,
    CPU offload).

    Args:
        model: the model; a LightningModule works unchanged (its ``training_step`` and
            ``configure_optimizers`` are called). Parameters may live on any device, ``meta`` too.
        batch: one batch as the step receives it (tensors of any device; only shapes and dtypes are
            read). For variable-length data pass the longest batch.
        optimizer: an optimizer (its type and hyperparameters are reused over the fake parameters), a
            factory ``f(parameters) -> optimizer``, or ``None``: the module's ``configure_optimizers``.
        step: ``step(model, batch) -> loss`` (a tensor, a dict with ``"loss"`` or an object with
            ``.loss``); ``None``: ``model.training_step(batch, 0)`` when the model has one, else ``model(batch)``.
        precision: the Lightning precision: ``*-mixed`` runs the forward under autocast, ``*-true``
            converts the weights and floating-point inputs.
        layout: the distribution to emulate; ``None``: a single device.
        device: the device type to trace for (kernels and their saved tensors differ between CPU and
            CUDA); fake CUDA tensors need no GPU.
        rounding: bytes as the device's allocator hands them out; ``None``: on CUDA, the caching
            allocator's 512-byte blocks (:func:`lightning_gpuopt.memory.allocator.cuda_block_bytes`),
            else exact bytes.
        workspace_bytes: kernel workspaces alive through the step; ``None``: on CUDA, cuBLAS's
            (:func:`lightning_gpuopt.memory.allocator.cublas_workspace_bytes`), else 0.
        kernel_scratch: measure what each CPU kernel allocates inside itself (oneDNN's layout
            reorders, softmax intermediates: :mod:`lightning_gpuopt.memory.scratch`) by running each
            distinct operator call once on zero-filled tensors of its shapes; ``None``: when predicting
            for the CPU and the counting allocator can be built here (else the prediction's
            ``decision`` says why not); ``True``: required (raises when it cannot be measured).
        fallback: when the trace fails (data-dependent operations), return the arithmetic estimate of
            :mod:`lightning_gpuopt.memory.estimate` with ``method=ESTIMATED`` and the reason in
            ``decision``; ``False``: raise.

    Returns:
        A :class:`PeakPrediction`.

    Raises:
        ValueError: ``precision`` is unknown, or no optimizer can be found.

    Example:
        >>> net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1))
        >>> p = predict_peak(net, torch.zeros(64, 256), torch.optim.SGD(net.parameters(), lr=0.1),
        ...                  step=lambda m, x: m(x).square().mean())
        >>> p.method.value, p.categories["parameters"] == 4 * sum(q.numel() for q in net.parameters())
        ('traced', True)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = layout or ParallelLayout()
    weight_dtype, autocast_dtype = _precision_dtypes(precision)
    dev = torch.device(device)
    if dev.type == "cuda":
        from lightning_gpuopt.memory.allocator import cublas_workspace_bytes, cuda_block_bytes

        rounding = rounding or cuda_block_bytes
        if workspace_bytes is None:
            major = torch.cuda.get_device_capability(dev)[0] if torch.cuda.is_available() else 9
            workspace_bytes = cublas_workspace_bytes(major, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    workspace_bytes = workspace_bytes or 0
    n = _batch_size_of(batch)
    if optimizer is None and not callable(getattr(model, "configure_optimizers", None)):
        raise ValueError(
            "`optimizer` must be an optimizer or a factory when the model has no `configure_optimizers`, got None"
        )
    # The autograd engine needs a real CUDA device for CUDA tensors, even fake ones: without one, trace
    # with the CPU's kernels (the same saved tensors for matmuls and attention, in the same dtypes).
    traced_on = dev if dev.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")
    state = _FakeState(model, traced_on, weight_dtype)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    scratch, scratch_note = _kernel_scratch(kernel_scratch, dev, traced_on)
    counter = _Counter(traced_on.type, rounding, scratch)
    try:
        with fake_mode:
            state.swap()
            fake_batch = _fake_batch(batch, traced_on, weight_dtype)
            with counter:
                _trace(
                    model,
                    fake_batch,
                    optimizer,
                    step,
                    layout,
                    state,
                    counter,
                    autocast_dtype,
                    traced_on,
                    dev.type == "cuda",
                )
    except _InputError:
        raise
    except Exception as err:
        if not fallback:
            raise
        return _estimated(model, batch, optimizer, precision, layout, n, dev, err)
    finally:
        state.restore()
    phases = []
    for peak, state_at, transient in counter.phase_peaks:
        categories, modules = counter.peak_breakdown(state_at)
        phase, step_index, module, host, _, _ = state_at
        if phase is not Phase.OTHER:
            categories[MemoryCategory.WORKSPACES.value] += workspace_bytes
            modules = {**modules, "": modules.get("", 0) + workspace_bytes} if workspace_bytes else modules
            phases.append(
                PhasePeak(
                    phase.value,
                    step_index,
                    peak + workspace_bytes,
                    categories,
                    modules,
                    module,
                    host,
                    transient,
                )
            )
    best = max(phases, key=lambda ph: ph.peak_bytes)
    return PeakPrediction(
        peak_bytes=best.peak_bytes,
        categories=best.categories,
        modules=best.modules,
        phase=best.phase,
        step=best.step,
        module=best.module,
        host_bytes=best.host_bytes,
        phases=tuple(phases),
        batch_size=n,
        method=PredictionMethod.TRACED,
        device=dev.type,
        decision="; ".join(
            (
                [f"traced with {traced_on.type} kernels (no {dev.type} device here)"]
                if traced_on != dev
                else []
            )
            + (
                [
                    f"data-dependent values guessed ({', '.join(sorted(counter.guessed))}): masks taken as checked, counts as 1"
                ]
                if counter.guessed
                else []
            )
            + ([scratch_note] if scratch_note else [])
            + (
                [
                    "kernel scratch not measured for "
                    + ", ".join(f"{op} ({why})" for op, why in sorted(scratch.skipped.items()))
                ]
                if scratch is not None and scratch.skipped
                else []
            )
        )
        or None,
    )


def _kernel_scratch(
    wanted: bool | None, dev: torch.device, traced_on: torch.device
) -> tuple[Any, str | None]:
    """The scratch measurer for this prediction (or None) and, when it was wanted but is missing, why."""
    on_cpu = dev.type == "cpu" and traced_on.type == "cpu"
    if wanted is False or (wanted is None and not on_cpu):
        return None, None
    if not on_cpu:
        raise ValueError(
            f"kernel_scratch=True measures CPU kernels, but this prediction is for {dev.type}: "
            "pass kernel_scratch=None or False"
        )
    from lightning_gpuopt.memory.scratch import KernelScratch, kernel_scratch_unavailable

    why = kernel_scratch_unavailable()
    if why is not None:
        if wanted:
            raise RuntimeError(f"kernel_scratch=True, but kernel scratch cannot be measured here: {why}")
        return None, f"kernel scratch not measured ({why}): the peak may be a few percent low"
    return KernelScratch(), None


class _InputError(ValueError):
    """What the caller must fix (no loss, no optimizer): raised, never turned into an estimate."""


def _trace(
    model: nn.Module,
    batch: Any,
    optimizer: Any,
    step: Callable[[nn.Module, Any], Any] | None,
    layout: ParallelLayout,
    state: _FakeState,
    counter: _Counter,
    autocast_dtype: torch.dtype | None,
    dev: torch.device,
    target_cuda: bool,
) -> None:
    import warnings

    params = [p for p in dict.fromkeys(model.parameters())]
    world = layout.shard_size
    sharded = layout.sharded
    offload = layout.cpu_offload
    # --- what exists before the first step: parameters, buffers, the batch, DDP's buckets ---
    for p in params:
        counter.add(
            p,
            MemoryCategory.PARAMETERS,
            nbytes=_shard_bytes(p, world) if sharded else None,
            host=offload,
            module="",
        )
    param_owner = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            param_owner.setdefault(id(p), name)
        for b in module.buffers(recurse=False):
            counter.add(b, MemoryCategory.BUFFERS, module=name)
    for t in state.attributes:  # plain tensor attributes' storages: held like buffers
        counter.add(t, MemoryCategory.BUFFERS, module="")
    state.attributes = []  # the module holds them: replaced during the step, they are freed
    for t in _tensors(batch):
        counter.add(t, MemoryCategory.INPUTS, module="")
    keep: list[Any] = []
    trainable = [p for p in params if p.requires_grad]
    bucket_views: dict[int, torch.Tensor] = {}
    if layout.kind == "ddp":
        for size, members in _ddp_buckets(trainable, layout.bucket_cap_bytes):
            flat = torch.empty(size // members[0].element_size(), dtype=members[0].dtype, device=dev)
            counter.update(flat, MemoryCategory.GRADIENTS, module="")
            keep.append(flat)
            offset = 0
            for p in members:
                bucket_views[id(p)] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    # --- module stack (forward hooks; the backward is one phase) and FSDP2 units ---
    names = {id(m): name for name, m in model.named_modules()}
    units = _fsdp_units(model, layout.units) if sharded else []
    unit_of = {id(u): (name, u) for name, u in units}
    gathered: dict[int, torch.Tensor] = {}

    def gather(unit: nn.Module, name: str) -> None:
        if id(unit) in gathered:
            return
        numel = sum(p.numel() for p in unit.parameters())
        dtype = next(unit.parameters()).dtype
        buf = torch.empty(numel, dtype=dtype, device=dev)
        counter.update(buf, MemoryCategory.GATHERED, host=False, module=name)
        gathered[id(unit)] = buf

    def release(unit: nn.Module) -> None:
        gathered.pop(id(unit), None)

    def pre_hook(module: nn.Module, args: Any) -> None:
        counter.module_stack.append(names.get(id(module), ""))
        if id(module) in unit_of:
            gather(module, unit_of[id(module)][0])

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        if counter.module_stack:
            counter.module_stack.pop()
        if id(module) in unit_of and not counter.in_backward:
            if layout.reshard_after_forward:
                release(module)
            name = unit_of[id(module)][0]
            # The unit is gathered again when the gradient of its output arrives, before its own backward.
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda g, module=module, name=name: gather(module, name))

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre_hook))
        handles.append(m.register_forward_hook(post_hook))

    # --- gradients: classified when accumulated; DDP copies them into buckets, FSDP2 reduce-scatters ---
    unit_params = {id(p): (name, u) for name, u in units for p in u.parameters()}
    pending: dict[int, int] = {id(u): len(list(u.parameters())) for _, u in units}

    def grad_ready(p: nn.Parameter) -> None:
        g = p.grad
        if g is None:
            return
        if layout.kind == "ddp":
            view = bucket_views.get(id(p))
            if view is not None:
                view.copy_(g)
                if layout.gradient_as_bucket_view:
                    p.grad = view
                    return
        if sharded:
            _, unit = unit_params[id(p)]
            pending[id(unit)] -= 1
            counter.update(g, MemoryCategory.GRADIENTS)
            if pending[id(unit)] == 0:  # the unit's backward is done: reduce-scatter its gradients
                release(unit)
                for q in unit.parameters():
                    if q.grad is not None:
                        counter.update(
                            q.grad, MemoryCategory.GRADIENTS, nbytes=_shard_bytes(q.grad, world), host=offload
                        )
            return
        counter.update(g, MemoryCategory.GRADIENTS)

    for p in trainable:
        handles.append(p.register_post_accumulate_grad_hook(grad_ready))

    try:
        opt = _build_optimizer(model, optimizer, state, counter)
        if target_cuda:
            for group in opt.param_groups:  # on CUDA, torch's optimizers default to their foreach kernels
                if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                    group["foreach"] = True
        counter.step = 1
        grads_before = counter.by_category.get(MemoryCategory.GRADIENTS, 0)
        counter.start_phase(Phase.FORWARD)
        ctx = (
            torch.autocast(dev.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _run_step(model, batch, step)
        loss = _loss_of(out)
        if loss is None:
            raise _InputError(
                "The training step must return a loss (a tensor, a dict with 'loss', or an object with "
                f"`.loss`), got {type(out).__name__}: pass `step=` returning the loss"
            )
        counter.start_phase(Phase.OTHER)
        opt.zero_grad(set_to_none=True)
        counter.start_phase(Phase.BACKWARD)
        counter.in_backward = True
        loss.backward()
        counter.in_backward = False
        del loss, out
        for _, u in units:
            release(u)
        counter.start_phase(Phase.OPTIMIZER)
        if sharded:
            counter.scale = world
            counter.host_phase = offload
        opt.step()
        counter.scale = 1
        counter.host_phase = False
        for st in opt.state.values():
            for v in st.values() if isinstance(st, Mapping) else ():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    counter.update(v, MemoryCategory.OPTIMIZER_STATE)
        counter.start_phase(Phase.OTHER)
        # The second step runs the same operators with more alive: the first step's gradients during
        # its forward (zero_grad comes after it, Lightning's order), the optimizer state throughout,
        # and no state to create in its optimizer step.
        state_bytes = counter.by_category.get(MemoryCategory.OPTIMIZER_STATE, 0)
        grads_bytes = counter.by_category.get(MemoryCategory.GRADIENTS, 0) - grads_before
        counter.add_second_step(
            {
                Phase.FORWARD: {
                    MemoryCategory.GRADIENTS: grads_bytes,
                    MemoryCategory.OPTIMIZER_STATE: state_bytes,
                },
                Phase.BACKWARD: {MemoryCategory.OPTIMIZER_STATE: state_bytes},
            }
        )
    finally:
        for h in handles:
            h.remove()
        counter.module_stack.clear()


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found.append(x)
        return x

    tree_map(visit, obj)
    return found


def _build_optimizer(
    model: nn.Module, optimizer: Any, state: _FakeState, counter: _Counter
) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = _rebuild_optimizer(optimizer, state.mapping)
    elif optimizer is not None:
        opt = optimizer(p for p in model.parameters() if p.requires_grad)
    else:
        opt = _optimizer_from_configure(model)
        if opt is None:
            raise _InputError(
                f"`configure_optimizers` of {type(model).__name__} must return an optimizer (or a list or dict "
                "holding one) for the prediction; pass `optimizer=` instead"
            )

    class _StateOf(dict):
        # The optimizer's per-parameter state: a tensor stored here is optimizer state from that moment.
        def __setitem__(self, key: Any, value: Any) -> None:
            super().__setitem__(key, value)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                counter.update(value, MemoryCategory.OPTIMIZER_STATE)

    opt.state = defaultdict(_StateOf)
    return opt


def _run_step(model: nn.Module, batch: Any, step: Callable[[nn.Module, Any], Any] | None) -> Any:
    if step is not None:
        return step(model, batch)
    training_step = getattr(model, "training_step", None)
    if callable(training_step):
        return training_step(batch, 0)
    return model(batch)


def _estimated(
    model: nn.Module,
    batch: Any,
    optimizer: Any,
    precision: str | None,
    layout: ParallelLayout,
    n: int,
    dev: torch.device,
    err: Exception,
) -> PeakPrediction:
    """The arithmetic estimate of memory/estimate.py when the trace fails, recorded as a decision."""
    from lightning_gpuopt.memory.estimate import CANDIDATES, count_parameters, estimate

    if layout.kind == "single":
        name = "single device"
    elif layout.kind == "ddp":
        name = "ddp"
    elif layout.cpu_offload:
        name = "fsdp: full shard + cpu offload"
    elif layout.replicate_size > 1 and layout.reshard_after_forward:
        name = "hsdp: full shard in node"
    else:
        name = "fsdp: full shard" if layout.reshard_after_forward else "fsdp: shard grads+optimizer"
    candidate = next(c for c in CANDIDATES if c.name == name)
    opt_kind: Any = optimizer if isinstance(optimizer, torch.optim.Optimizer) else "adam"
    e = estimate(count_parameters(model), candidate, layout.shard_size, precision, opt_kind, 0)
    categories = {c.value: 0 for c in MemoryCategory}
    categories[MemoryCategory.PARAMETERS.value] = e.parameters
    categories[MemoryCategory.GRADIENTS.value] = e.gradients
    categories[MemoryCategory.OPTIMIZER_STATE.value] = e.optimizer
    categories[MemoryCategory.GATHERED.value] = e.gathered
    categories[MemoryCategory.BUFFERS.value] = e.buffers
    reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return PeakPrediction(
        peak_bytes=e.total,
        categories=categories,
        modules={},
        phase=Phase.OTHER.value,
        step=0,
        module="",
        host_bytes=0,
        batch_size=n,
        method=PredictionMethod.ESTIMATED,
        device=dev.type,
        decision=f"tracing failed ({reason}): arithmetic estimate of model state, activations not counted",
    )


# ---------------------------------------------------------------------------------------------------
# Peak as a line in the batch size: two traces, extrapolated
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeakLine:
    """``peak(n) = fixed_bytes + per_sample_bytes × n``, from two predictions.

    Attributes:
        fixed_bytes: the part that does not grow with the batch (model state, the optimizer step).
        per_sample_bytes: what each sample adds at the peak.
        predictions: the traced predictions the line goes through.
    """

    fixed_bytes: float
    per_sample_bytes: float
    predictions: tuple[PeakPrediction, ...] = field(default_factory=tuple)

    def peak(self, n: int) -> int:
        """Predicted peak bytes at ``n`` samples (never below the smaller prediction's peak for n past it)."""
        return math.ceil(self.fixed_bytes + self.per_sample_bytes * n)

    def largest_fitting(self, budget_bytes: int, largest: int | None = None) -> int:
        """The largest ``n`` whose predicted peak stays within ``budget_bytes`` (0: not even one sample)."""
        if self.per_sample_bytes <= 0:
            return largest or 0 if self.fixed_bytes <= budget_bytes else 0
        n = int((budget_bytes - self.fixed_bytes) // self.per_sample_bytes)
        while n > 0 and self.peak(n) > budget_bytes:
            n -= 1
        n = max(0, n)
        return min(n, largest) if largest is not None else n


def predict_peak_line(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    sizes: tuple[int, int] = (1, 8),
    **kwargs: Any,
) -> PeakLine:
    """Trace at two batch sizes and draw the line through them (two traces, whatever the size asked later).

    Args:
        model: as for :func:`predict_peak`.
        make_batch: ``make_batch(n)`` returns a batch of ``n`` samples (fake or meta tensors are fine).
        sizes: the two sizes to trace, smaller first.
        **kwargs: passed to :func:`predict_peak`.

    Example:
        >>> net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1))
        >>> line = predict_peak_line(net, lambda n: torch.zeros(n, 64),
        ...                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), step=lambda m, x: m(x).sum())
        >>> line.per_sample_bytes > 0 and line.peak(8) == line.predictions[1].peak_bytes
        True
    """
    small, large = sizes
    if not 0 < small < large:
        raise ValueError(f"`sizes` must be two increasing positive ints, got {sizes!r}")
    a = predict_peak(model, make_batch(small), **kwargs)
    b = predict_peak(model, make_batch(large), **kwargs)
    slope = max(0.0, (b.peak_bytes - a.peak_bytes) / (large - small))
    fixed = b.peak_bytes - slope * large
    return PeakLine(fixed, slope, (a, b))


# ---------------------------------------------------------------------------------------------------
# Deep models: trace one and two repeated blocks, extrapolate in depth
# ---------------------------------------------------------------------------------------------------
#: Categories that grow with the batch (the rest is model state: parameters, gradients, optimizer state, ...).
BATCH_CATEGORIES = (MemoryCategory.ACTIVATIONS, MemoryCategory.TEMPORARIES, MemoryCategory.INPUTS)


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` holding the most parameters in blocks of one type (a transformer's layers), or None.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(4)))
        >>> repeated_blocks(net)[0]
        '1'
    """
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 3:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, module)
    return (best[1], best[2]) if best else None


@contextlib.contextmanager
def _first_blocks(blocks: nn.ModuleList, k: int):
    saved = blocks._modules
    blocks._modules = {key: saved[key] for key in list(saved)[:k]}
    try:
        yield
    finally:
        blocks._modules = saved


def predict_peak_deep(model: nn.Module, batch: Any, *args: Any, **kwargs: Any) -> PeakPrediction:
    """:func:`predict_peak` for a deep model: trace it with one and with two of its repeated blocks, extrapolate.

    A model whose depth is a ``nn.ModuleList`` of identical blocks (:func:`repeated_blocks`; a
    transformer's layers) costs a trace of its full depth; every block adds the same bytes to every
    category, so two short traces (the list cut to its first one and two blocks, restored after) give
    the full depth's peak: ``P(L) = P(1) + (L - 1) × (P(2) - P(1))``. Models without such a list are
    traced whole. Arguments are those of :func:`predict_peak`.

    Example:
        >>> net = nn.Sequential(*(nn.Linear(64, 64) for _ in range(1)), nn.ModuleList(nn.Linear(64, 64) for _ in range(8)))
        >>> net.forward = lambda x: [x := layer(x) for layer in net[1]][-1]
        >>> kw = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), step=lambda m, x: m(x).sum())
        >>> deep, whole = predict_peak_deep(net, torch.zeros(32, 64), **kw), predict_peak(net, torch.zeros(32, 64), **kw)
        >>> deep.peak_bytes == whole.peak_bytes
        True
    """
    found = repeated_blocks(model)
    if found is None:
        return predict_peak(model, batch, *args, **kwargs)
    name, blocks = found
    depth = len(blocks)
    with _first_blocks(blocks, 1):
        one = predict_peak(model, batch, *args, **kwargs)
    if one.method is not PredictionMethod.TRACED:
        return predict_peak(model, batch, *args, **kwargs)
    with _first_blocks(blocks, 2):
        two = predict_peak(model, batch, *args, **kwargs)

    def grow(a: int, b: int) -> int:
        return a + (depth - 1) * (b - a)

    def grow_dict(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: grow(a.get(k, 0), b.get(k, 0)) for k in dict.fromkeys([*b, *a])}

    first = {(ph.phase, ph.step): ph for ph in one.phases}
    phases = tuple(
        PhasePeak(
            ph.phase,
            ph.step,
            grow(first[(ph.phase, ph.step)].peak_bytes, ph.peak_bytes),
            grow_dict(first[(ph.phase, ph.step)].categories, ph.categories),
            grow_dict(first[(ph.phase, ph.step)].modules, ph.modules),
            ph.module,
            grow(first[(ph.phase, ph.step)].host_bytes, ph.host_bytes),
            grow(first[(ph.phase, ph.step)].transient_bytes, ph.transient_bytes),
        )
        for ph in two.phases
        if (ph.phase, ph.step) in first
    )
    best = max(phases, key=lambda ph: ph.peak_bytes)
    note = f"{depth} blocks of {name or 'the model'} extrapolated from traces of 1 and 2"
    return dataclasses.replace(
        two,
        peak_bytes=best.peak_bytes,
        categories=best.categories,
        modules={k: v for k, v in best.modules.items() if v},
        phase=best.phase,
        step=best.step,
        module=best.module,
        host_bytes=best.host_bytes,
        phases=phases,
        decision="; ".join(filter(None, [note, two.decision])),
    )


def scale_to_batch(prediction: PeakPrediction, n: int) -> int:
    """Peak bytes of ``prediction`` at ``n`` samples: its activations, temporaries and inputs scaled by ``n`` / its batch.

    One trace, extrapolated linearly in the batch size from its own breakdown (the model state does
    not grow with the batch). Exact where the peak's phase stays the same; two traces
    (:func:`predict_peak_line`) also see a phase change.

    Example:
        >>> p = PeakPrediction(300, {"parameters": 100, "activations": 200}, {}, "forward", 1, "", 0, 4,
        ...                    PredictionMethod.TRACED, "cpu")
        >>> scale_to_batch(p, 8)
        500
    """
    growing = sum(prediction.categories.get(c.value, 0) for c in BATCH_CATEGORIES)
    fixed = prediction.peak_bytes - growing
    return fixed + math.ceil(growing * n / max(1, prediction.batch_size))
