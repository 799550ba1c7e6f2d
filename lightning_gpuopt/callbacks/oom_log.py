"""GPUOptReport's OOM log: one :class:`~lightning_gpuopt.oom_record.OOMRecord` per out-of-memory error on this rank.

It is the process's OOM listener (:mod:`lightning_gpuopt.memory.forensics`) while a fit runs. Three calls
build a record:

1. the allocator's observer, inside the failing allocation (CUDA's, or SimulatedMemory's): the memory
   by category then, the phase from the stack's code, and on CUDA the fragmentation, the memory outside
   the allocator and the snapshot pickle;
2. whoever caught it, inside its ``except`` block (the micro-batch engine, or a trial step of
   MemoryAwareBatchSize's search): the stage, the phase, what the attempt ran and (the engine) the memory
   in use when it began, which splits the bytes into those held before the step and those it allocated
   (when no observer spoke, e.g. a CPU without SimulatedMemory, the memory is read here instead);
3. the catcher again, once it decided (the engine: once the ranks agreed): what the pack did (``action``).

An OOM that no catcher claims (one caught by user code) is of stage ``"other"``, its phase from the stack.
The modules that own the activations are measured at the next
training batch after an OOM (:class:`~lightning_gpuopt.memory.forensics.ActivationOwners`, entered for
that one batch).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gpuopt._compiled import is_compiled_anywhere
from lightning_gpuopt.memory import forensics, get_probe
from lightning_gpuopt.memory.forensics import ActivationOwners, MemoryHistory, OOMEvent
from lightning_gpuopt.oom_policy import parse_tried_bytes
from lightning_gpuopt.oom_record import OOMRecord

__all__ = ["NOT_MEASURED", "OOMLog", "memory_limit", "state_tensors"]

#: ``modules["how"]`` of a record whose owners are still to be measured.
NOT_MEASURED = "not measured yet"

#: What the pack did about an OOM that no catcher claimed.
_UNCLAIMED = "caught outside the pack's recovery"


def memory_limit(probe: Any) -> int | None:
    """The memory this process may use, where there is one: the CUDA budget, or SimulatedMemory's limit."""
    if probe.kind == "simulated":
        return probe.limit_bytes
    return probe.total if probe.kind == "cuda" else None


def state_tensors(trainer: pl.Trainer) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The training state's tensors: (parameters, gradients, optimizer state)."""
    params = list(trainer.lightning_module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        value
        for optimizer in trainer.optimizers
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, Tensor)
    ]
    return params, grads, state


class OOMLog:
    """This rank's OOM records for one fit (see the module docstring).

    Args:
        trainer: the Trainer.
        folder: where snapshot pickles go (beside the report).
        max_files: snapshots written per rank at most.
        history: the CUDA allocator's history ring buffer (``None``: not recorded).
        history_after_oom: start ``history`` at the first OOM.
        started: ``time.perf_counter()`` when the fit started.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        folder: Path,
        max_files: int,
        history: MemoryHistory | None,
        history_after_oom: bool,
        started: float,
    ) -> None:
        self.trainer = trainer
        self.device = trainer.strategy.root_device
        self.folder = folder
        self.max_files = max_files
        self.history = history
        self.history_after_oom = history_after_oom
        self.started = started
        self.records: list[OOMRecord] = []
        self.snapshots = 0
        self._pending: list[OOMRecord] = []
        self._awaiting: OOMRecord | None = None
        self._owners: ActivationOwners | None = None

    # ------------------------------------------------------------------ the listener (memory.forensics)

    def oom_observed(self, event: OOMEvent) -> None:
        probe = get_probe(self.device)
        if probe.kind == "cpu" or (probe.kind == "cuda" and event.device != str(probe.device)):
            return  # another device's, or no device memory to break down
        record = self._capture(
            event.requested_bytes,
            event.allocated_bytes,
            event.reserved_bytes,
            event.limit_bytes if event.limit_bytes is not None else memory_limit(probe),
            forensics.phase_of_frames(event.frames),
        )
        if probe.kind == "cuda":
            self._cuda_figures(record, dump=True)
        self._pending.append(record)

    def oom_caught(self, error: BaseException, **context: Any) -> None:
        self._close_awaiting()
        tried = parse_tried_bytes(str(error))
        record = self._claim(tried)
        if record is None:  # no observer spoke (a plain CPU, an allocation outside the caching allocator)
            probe = get_probe(self.device)
            allocated = reserved = probe.allocated
            if probe.kind == "cuda":
                reserved = probe.reserved
            phase = context.get("phase", "forward")
            record = self._capture(tried, allocated, reserved, memory_limit(probe), phase)
            if probe.kind == "cuda":
                self._cuda_figures(record, dump=True)
        record.stage = context.get("stage", record.stage)
        record.phase = context.get("phase", record.phase)
        if record.stage in ("validation", "test", "predict") and record.modules.get("how") == NOT_MEASURED:
            record.modules = {"how": "none: evaluation saves nothing for a backward", "top": []}
        record.step = int(context.get("step", record.step))
        record.k = context.get("k")
        record.batch_size = context.get("batch_size")
        record.micro_batch_size = context.get("micro_batch_size")
        record.message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        kept = self._count_kept_gradients(record, context.get("gradients", ()))
        baseline = context.get("held_before_bytes")
        if baseline is not None:  # what the attempt began with, against what it allocated
            held = forensics.held_before_step(record.categories, baseline, kept)
            record.held_before_step = held
            record.held_before_step_bytes = sum(held.values())
            record.allocated_during_step_bytes = record.allocated_bytes - record.held_before_step_bytes
        self._awaiting = record

    def oom_action(self, action: str) -> None:
        if self._awaiting is None:
            return
        self._awaiting.action = action
        self._close_awaiting()

    # ------------------------------------------------------------------ from the report's hooks

    def flush(self) -> None:
        """Every OOM heard so far becomes a record (the ones no catcher claimed: stage ``"other"``)."""
        self._close_awaiting()
        for record in self._pending:
            record.action = _UNCLAIMED
            self._keep(record)
        self._pending = []

    def wants_owners(self) -> bool:
        """Whether a record waits for the modules owning the activations to be measured."""
        return any(r.modules.get("how") == NOT_MEASURED for r in self.records)

    def measure_owners(self, module: torch.nn.Module) -> None:
        """Enter the owners' measurement for this training batch (not under torch.compile, whose graphs the hooks
        would change)."""
        if self._owners is not None:
            return
        if is_compiled_anywhere(module):
            for record in self.records:
                if record.modules.get("how") == NOT_MEASURED:
                    record.modules = {"how": "not measured under torch.compile", "top": []}
            return
        self._owners = ActivationOwners(module, self.device).__enter__()

    def owners_measured(self, step: int, k: int, micro_batch_size: int) -> None:
        """Leave the measurement; every record still waiting gets the owners at this batch's activation peak."""
        owners, self._owners = self._owners, None
        if owners is None:
            return
        owners.__exit__(None, None, None)
        how = f"measured at step {step}, the next training batch after the OOM (micro-batch {micro_batch_size}, k {k})"
        for record in self.records:
            if record.modules.get("how") == NOT_MEASURED:
                record.modules = {"how": how, "top": ActivationOwners.top(owners.at_peak)}

    def close(self, reason: str = "no training batch ran after it") -> None:
        """At the end of the fit: the owners' measurement is left, and records still waiting say why."""
        self.flush()
        if self._owners is not None:
            self._owners.__exit__(None, None, None)
            self._owners = None
        for record in self.records:
            if record.modules.get("how") == NOT_MEASURED:
                record.modules = {"how": f"not measured: {reason}", "top": []}
        if self.history is not None:
            self.history.stop()

    # ------------------------------------------------------------------ the parts

    def _capture(
        self,
        requested: int | None,
        allocated: int,
        reserved: int,
        limit: int | None,
        phase: str,
    ) -> OOMRecord:
        trainer = self.trainer
        params, grads, state = state_tensors(trainer)
        categories = forensics.categories_now(allocated, self.device, params, grads, state)
        if self._owners is not None:
            modules = {"how": "measured at the OOM", "top": ActivationOwners.top(self._owners.by_module)}
        elif phase == "optimizer step":
            modules = {"how": "none: the optimizer step runs after the backward freed them", "top": []}
        else:
            modules = {"how": NOT_MEASURED, "top": []}
        return OOMRecord(
            step=trainer.global_step,
            rank=trainer.global_rank,
            stage="other",
            phase=phase,
            requested_bytes=requested,
            allocated_bytes=int(allocated),
            reserved_bytes=int(reserved),
            limit_bytes=limit,
            categories=categories,
            modules=modules,
            time_s=time.perf_counter() - self.started,
        )

    def _cuda_figures(self, record: OOMRecord, dump: bool) -> None:
        record.fragmentation = forensics.cuda_fragmentation(self.device)
        record.outside_allocator_bytes, record.outside_allocator_source = forensics.memory_outside_allocator(
            self.device
        )
        if dump and self.snapshots < self.max_files:
            self.snapshots += 1
            name = f"oom_{record.step}_rank{record.rank}" + (
                f"_{self.snapshots}" if self.snapshots > 1 else ""
            )
            self.folder.mkdir(parents=True, exist_ok=True)
            record.snapshot = Path(MemoryHistory.dump(self.folder / f"{name}.pickle")).name

    def _claim(self, tried: int | None) -> OOMRecord | None:
        """The latest observed OOM this error is about (the same request, where the message says it)."""
        for i in range(len(self._pending) - 1, -1, -1):
            requested = self._pending[i].requested_bytes
            if tried is None or abs(requested - tried) <= max(2**20, 0.01 * tried):
                return self._pending.pop(i)
        return None

    def _count_kept_gradients(self, record: OOMRecord, kept: Any) -> int:
        """Gradients the engine keeps aside during the batch (earlier batches of an accumulation window) move
        from ``other`` to ``gradients``; returns their bytes."""
        if not kept:
            return 0
        params, grads, state = state_tensors(self.trainer)
        counted = forensics.storages([*params, *grads, *state], self.device)
        extra = sum(n for key, n in forensics.storages(kept, self.device).items() if key not in counted)
        moved = min(extra, record.categories["other"])
        record.categories["gradients"] += moved
        record.categories["other"] -= moved
        return moved

    def _close_awaiting(self) -> None:
        if self._awaiting is not None:
            record, self._awaiting = self._awaiting, None
            self._keep(record)

    def _keep(self, record: OOMRecord) -> None:
        self.records.append(record)
        self.records.sort(key=lambda r: r.time_s)
        if self.history is not None and self.history_after_oom:
            self.history.start()
