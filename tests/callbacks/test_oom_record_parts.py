"""The OOM record splits what was held before the step from what the step allocated, and its advice fits the part
that is largest.

A run under SimulatedMemory holds memory of its own on the device (built after entering it, before fit) and runs
out of memory in a step's forward; what the step began with is counted independently of the pack: the parameters,
Adam's state, the held tensor and the batch.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt import GPUOptReport, MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.oom_record import (
    OOM_PARTS,
    describe_action,
    largest_part,
    oom_parts,
    part_advice,
    part_label,
    smaller_may_fit,
)
from lightning_gpuopt.report import format_oom
from lightning_gpuopt.report_plot import _oom_text
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.test_oom_record import BATCH, Measured, Pressure, _data
from tests.callbacks.test_report_endings import Regressor, _dataset
from tests.helpers import TRAINER_QUIET

MiB = 2**20


class AtStart(pl.Callback):
    """At each training batch's start: the bytes in use, and the previous step's gradients among them (which the
    engine drops before the step's first micro-batch)."""

    def __init__(self) -> None:
        self.in_use: list[int] = []
        self.gradients: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.in_use.append(get_probe().allocated)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.gradients.append(sum(g.untyped_storage().nbytes() for g in grads))


@pytest.mark.parametrize("held_mib", [0, 4], ids=["nothing-held", "4-MiB-held"])
def test_the_record_splits_what_was_held_before_the_step_from_what_it_allocated(held_mib, tmp_path):
    model = Measured("mlp")
    report, start = GPUOptReport(dirpath=str(tmp_path), table=False, plot=False), AtStart()
    trainer = pl.Trainer(
        max_steps=3,
        precision="64-true",
        callbacks=[start, Pressure("forward"), OOMRecovery(verbose=False), report],
        **TRAINER_QUIET,
    )
    with SimulatedMemory():
        held = torch.ones(held_mib * MiB // 8, dtype=torch.float64)  # on the simulated device, before fit
        trainer.fit(model, _data("mlp"))
    record = report.report["ooms"][0]
    assert (record["step"], record["phase"]) == (2, "forward")
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    state = trainer.optimizers[0].state.values()
    adam = sum(v.untyped_storage().nbytes() for s in state for v in s.values() if isinstance(v, torch.Tensor))
    before = record["held_before_step"]
    assert before["parameters"] == params and before["optimizer_state"] == adam
    assert before["activations"] == 0 and before["gradients"] == 0  # the forward of a step's first batch
    began_with = start.in_use[2] - start.gradients[2]
    assert abs(record["held_before_step_bytes"] - began_with) <= 0.01 * began_with, (before, began_with)
    assert before["other"] >= held.untyped_storage().nbytes() + BATCH * 9 * 8  # the held tensor, the batch
    assert (
        record["allocated_during_step_bytes"] == record["allocated_bytes"] - record["held_before_step_bytes"]
    )
    assert 0 < record["categories"]["activations"] <= record["allocated_during_step_bytes"]
    assert record["activations_measured"] is True  # the text splits them out of "other"
    text = format_oom(record)
    assert "held before the step" in text and "allocated during it" in text
    parts = oom_parts(record)
    assert sum(parts.values()) == record["allocated_bytes"]
    assert largest_part(parts) == ("other_held" if held_mib else "other")  # else the forward's 512 KiB output


def test_a_give_up_names_every_part_and_advises_on_the_largest(tmp_path):
    """The give-up of the issue: a dataset built on the device holds most of it; the error lists every part, and the
    advice is about that memory, not smaller batches (none fits)."""
    report = GPUOptReport(dirpath=str(tmp_path), table=False, plot=False)
    trainer = pl.Trainer(max_steps=2, callbacks=[OOMRecovery(verbose=False), report], **TRAINER_QUIET)
    with pytest.raises(MicroBatchOOMError) as info, SimulatedMemory(int(8.15 * MiB)):
        data = _dataset(30_000)
        trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=BATCH))
    text = str(info.value)
    for part in (
        "parameters ",
        "gradients ",
        "optimizer state ",
        "other memory held before the step ",
        "per sample",
    ):
        assert part in text, part
    assert "The largest part is other, held before the step (" in text and "keep on the CPU, or free" in text
    record = report.report["ooms"][-1]
    words = " ".join(_oom_text(record, None).split())
    assert "Largest part: other, held before the step" in words and "smaller micro-batches" not in words


def _record_with_largest(part: str, smaller: bool) -> dict:
    sizes = dict.fromkeys(OOM_PARTS, MiB)
    sizes[part] = 50 * MiB
    categories = {name: sizes[name] for name in OOM_PARTS if name != "other_held"}
    categories["other"] += sizes["other_held"]
    held = {
        "parameters": sizes["parameters"],
        "optimizer_state": sizes["optimizer_state"],
        "other": sizes["other_held"],
    }
    return {
        "step": 5, "rank": 0, "stage": "train", "phase": "backward", "requested_bytes": MiB,
        "allocated_bytes": sum(categories.values()), "reserved_bytes": None, "limit_bytes": 60 * MiB,
        "categories": categories, "held_before_step": held, "held_before_step_bytes": sum(held.values()),
        "allocated_during_step_bytes": sum(categories.values()) - sum(held.values()),
        "modules": {"how": "measured at the OOM", "top": []}, "k": 2, "batch_size": 8,
        "micro_batch_size": 4 if smaller else 1,
        "action": "micro-batch 4 → 2 (k 2 → 4)" if smaller else "gave up: Out of memory at step 5 (backward)",
    }  # fmt: skip


CASES = [(part, smaller) for part in OOM_PARTS for smaller in (True, False)]


@pytest.mark.parametrize(
    ("part", "smaller"), CASES, ids=[f"{p}-{'may-shrink' if s else 'gave-up'}" for p, s in CASES]
)
def test_the_advice_fits_the_largest_part(part, smaller):
    record = _record_with_largest(part, smaller)
    assert largest_part(oom_parts(record)) == part
    advice = part_advice(part, smaller, split=True)
    label = part_label(part, split=True)
    full = format_oom(record)
    assert f"largest    {label}, 50.00 MiB" in full and advice in full
    words = " ".join(_oom_text(record, None).split())
    assert f"Largest part: {label}, 50.00 MiB" in words and f"To cut it: {advice}" in words
    if not smaller:  # after a give-up at one sample, no advice of a smaller micro-batch
        assert "smaller micro-batches" not in advice
    others = {part_advice(p, smaller, split=True) for p in OOM_PARTS if p != part}
    assert advice not in others  # each part has advice of its own


@pytest.mark.parametrize(
    ("record", "parts"),
    [
        ({"categories": {"activations": 5}}, {"activations": 5}),  # no "other", nothing said held
        (
            {"categories": {"activations": 5, "other": 7}, "held_before_step": {}},
            {"activations": 5, "other_held": 0, "other": 7},
        ),
        ({"categories": {"other": 7}, "held_before_step": {"other": 3}}, {"other_held": 3, "other": 4}),
    ],
)
def test_a_record_missing_parts_counts_them_as_zero(record, parts):
    zero = {name: 0 for name in OOM_PARTS if name != "other_held"}
    assert oom_parts(record) == {**zero, **parts}


@pytest.mark.parametrize(
    ("record", "fits"),
    [
        ({"micro_batch_size": 2, "action": "micro-batch 2 → 1 (k 4 → 8)"}, True),
        ({"micro_batch_size": 1, "action": "activation checkpointing on; micro-batch 1 kept"}, False),
        ({"micro_batch_size": 4, "action": "gave up: out of memory at every split"}, False),
    ],
)
def test_a_smaller_micro_batch_may_fit_until_one_sample_or_a_give_up(record, fits):
    assert smaller_may_fit(record) is fits


def test_the_action_names_the_micro_batch_before_and_after():
    assert describe_action("train", n=64, k=2, new_k=5) == "micro-batch 32 → 13 (k 2 → 5)"
    assert describe_action("validation", n=10, k=1, new_k=3) == "validation batches in 3 chunks of 4"
