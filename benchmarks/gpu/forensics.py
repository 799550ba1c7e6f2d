"""GPU check section ``forensics``: the OOM record against a real CUDA OOM, and what the history ring buffer costs.

1. **A real OOM**: a GPT-shaped model with ``OOMRecovery`` and ``GPUOptReport(memory_history=True)`` runs
   into a limit halfway between its held memory and its peak. Checks: one record per OOM the allocator
   counted; each category within 1 % of the allocator's blocks at its storages (``memory_snapshot()``); the
   categories sum to ``allocated_bytes``; the snapshot pickle loads; fragmentation and memory outside the
   allocator recorded.
2. **The ring buffer's cost**: interleaved pairs of fits with ``memory_history`` off and on, CUDA-event
   step times; the median ratio over pairs (target ≤ 3 %).

In the dry run the OOM is SimulatedMemory's; the CUDA-only checks are skipped with their reason.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import figure, patched, spread

from gpu import device
from gpu.speed import MODEL_KEYS, gpt_fit, paired_fits
from lightning_gpuopt import GPUOptReport, OOMRecovery
from lightning_gpuopt.memory import forensics

CATEGORY_BAND = 0.01
COST_TARGET_PERCENT = 3.0


class HalfwayLimit(pl.Callback):
    """Measures the memory held between steps and the step's peak for ``warmup`` steps, then sets the limit
    halfway between them."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.held, self.peak, self.limit = warmup, 0, 0, None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        the_device = device.current()
        if trainer.global_step == self.warmup:
            self.limit = self.held + (self.peak - self.held) // 2
            the_device.set_limit(self.limit)
        elif trainer.global_step < self.warmup:
            self.held = max(self.held, the_device.allocated())
            the_device.reset_peak()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step <= self.warmup:
            self.peak = max(self.peak, device.current().peak())


def _blocks() -> dict[int, int]:
    """The caching allocator's live blocks now: address -> requested bytes."""
    out = {}
    for segment in torch.cuda.memory_snapshot():
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                out[block.get("address", address)] = block.get("requested_size", block["size"])
            address += block["size"]
    return out


def at_the_oom(moments: list[dict[str, int]]) -> contextlib.AbstractContextManager:
    """While entered, each breakdown the report takes at an OOM is also measured from the allocator's blocks."""
    original = forensics.categories_now

    def measured(allocated, device_, parameters=(), gradients=(), optimizer_state=(), activations=True):
        parameters, gradients, optimizer_state = list(parameters), list(gradients), list(optimizer_state)
        if activations and device_.type == "cuda":
            blocks, counted, moment = _blocks(), set(), {}
            kinds = dict(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state)
            for name, tensors in kinds.items():
                keys = set(forensics.storages(tensors, device_)) - counted
                counted |= keys
                moment[name] = sum(blocks.get(key[2], 0) for key in keys)
            saved = forensics.saved_activations(device_, counted)
            moment["activations"] = sum(blocks.get(key[2], 0) for key in saved)
            moment["allocated"] = torch.cuda.memory_allocated(device_)
            moments.append(moment)
        return original(allocated, device_, parameters, gradients, optimizer_state, activations)

    return patched((forensics, "categories_now", measured))


def _real_oom(sizes: dict[str, Any], out: Path) -> tuple[list[dict], dict[str, Any], dict[str, str]]:
    on_cuda = device.current().kind == "cuda"
    warmup, steps = sizes["warmup"], sizes["warmup"] + sizes["after"]
    folder = out / "forensics"
    report = GPUOptReport(dirpath=str(folder), table=False, plot="auto", memory_history=True)
    limit = HalfwayLimit(warmup)
    ooms_before = torch.cuda.memory_stats().get("num_ooms", 0) if on_cuda else 0
    moments: list[dict[str, int]] = []
    with at_the_oom(moments):
        try:
            gpt_fit(sizes, steps, [limit, OOMRecovery(verbose=False), report], precision=sizes["precision"])
        finally:
            device.current().set_limit(None)
    records = report.report.get("ooms", [])
    counted = (torch.cuda.memory_stats().get("num_ooms", 0) - ooms_before) if on_cuda else None
    figures = [figure("OOM records (one per OOM the allocator counted)", len(records), "", "= num_ooms" if on_cuda else None,
                      (len(records) == counted and counted > 0) if on_cuda else len(records) > 0)]  # fmt: skip
    sums = [abs(sum(r["categories"].values()) - r["allocated_bytes"]) / r["allocated_bytes"] for r in records]
    figures.append(figure("categories summing to allocated_bytes (worst)", max(sums, default=None), "", "<= 1 %",
                          bool(sums) and max(sums) <= 0.01))  # fmt: skip
    skipped: dict[str, str] = {}
    details: dict[str, Any] = {"limit_bytes": limit.limit, "held_bytes": limit.held, "peak_bytes": limit.peak}
    if on_cuda:
        worst = {}
        for record, moment in zip(records, moments):
            for name in ("parameters", "gradients", "optimizer_state", "activations"):
                gap = abs(record["categories"][name] - moment[name]) / max(moment[name], 1)
                worst[name] = max(worst.get(name, 0.0), gap)
        for name, gap in worst.items():
            figures.append(figure(f"{name} against the allocator's blocks at its storages (worst)", gap, "",
                                  f"<= {CATEGORY_BAND:.0%}", gap <= CATEGORY_BAND))  # fmt: skip
        pickles = [folder / r["snapshot"] for r in records if r.get("snapshot")]
        loaded = pickle.loads(pickles[0].read_bytes()) if pickles else {}
        events = sum(len(t) for t in loaded.get("device_traces", []))
        figures.append(figure("snapshot pickle written, with the ring buffer's events", events, "events", "> 0",
                              events > 0))  # fmt: skip
        details["moments"] = moments
        details["fragmentation"] = [r.get("fragmentation") for r in records]
        outside = [(r.get("outside_allocator_bytes"), r.get("outside_allocator_source")) for r in records]
        details["outside_allocator"] = outside
    else:
        skipped["against memory_snapshot"] = "the caching allocator's blocks exist on CUDA only"
        skipped["snapshot pickle"] = "torch.cuda.memory._dump_snapshot needs CUDA"
    keys = ("step", "stage", "phase", "requested_bytes", "allocated_bytes", "categories", "action")
    details["records"] = [{k: r.get(k) for k in keys} for r in records]
    return figures, details, skipped


def _ring_buffer_cost(sizes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    def report(name: str) -> list:  # first-use costs were paid by the OOM run
        return [GPUOptReport(plot=False, table=False, memory_history=name == "on", dirpath=sizes["out"])]

    per_fit, percent = paired_fits(sizes, ("off", "on"), report)
    on_cuda = device.current().kind == "cuda"
    name = (
        f"memory_history=True step-time cost (median of {percent['n']} interleaved pairs of fits; IQR "
        f"{percent['q1']:+.1f}..{percent['q3']:+.1f} %)"
    )
    met = percent["median"] <= COST_TARGET_PERCENT if on_cuda else None
    target = f"<= {COST_TARGET_PERCENT:.0f} %" if on_cuda else "reported (CPU: no ring buffer)"
    details = {"seconds_per_step": {k: spread(v) for k, v in per_fit.items()}, "cost_percent": percent}
    return figure(name, percent["median"], "%", target, met), details


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The OOM record against a real OOM and the allocator's snapshot; the history ring buffer's step-time cost."""
    out = Path(sizes["out"])
    figures, details, skipped = _real_oom(sizes, out)
    device.check()
    cost, cost_details = _ring_buffer_cost(sizes)
    figures.append(cost)
    details["ring_buffer"] = cost_details
    details["model"] = {k: sizes[k] for k in (*MODEL_KEYS, "precision")}
    return {"figures": figures, "details": details, "skipped": skipped}
