"""The OOM record: what ``gpuopt_report.json["ooms"]`` keeps of each out-of-memory error (:class:`OOMRecord`),
the parts of memory it names, and the words the report and the errors use for it. ``gpuopt report`` reads
records back with :meth:`OOMRecord.from_dict`. Pure: no Lightning, no device calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "OOM_PARTS",
    "OOMRecord",
    "describe_action",
    "largest_part",
    "oom_parts",
    "part_advice",
    "part_label",
    "smaller_may_fit",
    "stop_reason",
]


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


#: What lowers each part: one advice, or (while a smaller micro-batch may still fit, once none does).
_ADVICE: dict[str, str | tuple[str, str]] = {
    "parameters": "a lower-memory precision (bf16-true), or sharding (FSDP2Strategy)",
    "gradients": "sharding the gradients (FSDP2Strategy), or fewer trainable parameters",
    "optimizer_state": "sharding or offloading it (FSDP2Strategy), or an 8-bit optimizer",
    "activations": (
        "smaller micro-batches (OOMRecovery does it), activation checkpointing, bf16-mixed",
        "activation checkpointing (OOMRecovery(checkpoint_modules=[...])), bf16-mixed",
    ),
    "other_held": (
        "keep on the CPU, or free before fit, what the program holds on the device besides the training state "
        "(a dataset, saved outputs, caches): it was in use before the step began"
    ),
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
        >>> part_advice("activations")
        'smaller micro-batches (OOMRecovery does it), activation checkpointing, bf16-mixed'
        >>> part_advice("activations", smaller_fits=False)
        'activation checkpointing (OOMRecovery(checkpoint_modules=[...])), bf16-mixed'
    """
    advice = _ADVICE["other during" if part == "other" and split else part]
    return advice if isinstance(advice, str) else advice[0 if smaller_fits else 1]


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
