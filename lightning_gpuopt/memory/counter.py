"""The counter: a dispatch mode above FakeTensorMode that counts each new storage until it dies."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpuopt._compat import scalar_read_op, storage_id
from lightning_gpuopt.memory.op_outputs import alias_mask
from lightning_gpuopt.memory.prediction_types import MemoryCategory, Phase
from lightning_gpuopt.memory.walk import tensors

__all__ = ["StorageCounter", "storage_key"]


_DATA_DEPENDENT = {
    scalar_read_op(),
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}


def storage_key(t: torch.Tensor) -> tuple[Any, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage, storage_id(storage)


@dataclass
class _Record:
    nbytes: int
    category: MemoryCategory
    module: str
    host: bool = False
    raw: int = 0  # the storage's own bytes when counted (a resize scales the counted bytes)


#: What a phase adds above the memory held through the step.
_TRANSIENT = (MemoryCategory.ACTIVATIONS, MemoryCategory.TEMPORARIES, MemoryCategory.SCRATCH)


class StorageCounter(TorchDispatchMode):
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
        *,
        reclassify: bool = False,
    ) -> None:
        """Count ``t``'s storage once; ``reclassify``: re-classify (or re-size, or move) one counted already."""
        found = storage_key(t)
        if found is None:
            return
        storage, key = found
        rec = self.records.get(key)
        if rec is not None:
            if reclassify:
                self._reclassify(rec, category, nbytes, host, module)
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

    #: Re-classify (or re-size, or move) a counted storage; counts it first when new.
    update = functools.partialmethod(add, reclassify=True)

    def _reclassify(
        self,
        rec: _Record,
        category: MemoryCategory | None,
        nbytes: int | None,
        host: bool | None,
        module: str | None,
    ) -> None:
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

    def category_of(self, t: torch.Tensor) -> MemoryCategory | None:
        found = storage_key(t)
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
            if func is not scalar_read_op() or dtype is torch.bool:
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
            found = storage_key(out)
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
        found = storage_key(t)
        rec = self.records.get(found[1]) if found else None
        return rec.nbytes if rec is not None and rec.nbytes > found[0].nbytes() else None

    def _kernel_cost(self, cost: Any, out: Any) -> None:
        if cost.outputs is not None:  # outputs larger for real (a workspace its fake gives no size)
            outs = tensors(out)
            for t, nbytes in zip(outs, cost.outputs):
                found = storage_key(t)
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
