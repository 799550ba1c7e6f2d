"""A report field added from outside the pack, through its public API only: ``GPUOptReport(fields=[ReportField])``."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpuopt import GPUOptReport
from lightning_gpuopt.report import ReportField, format_table, load_report, summarize_values
from tests.helpers import TRAINER_QUIET


def weight_norm(trainer, pl_module) -> torch.Tensor:
    """The parameters' L2 norm after the step: a 0-d tensor, which the field turns into a float."""
    return torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]))


class Witness(Callback):
    """The same figure, taken independently at the end of every training batch."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.norms.append(float(weight_norm(trainer, pl_module)))


def _fit(report: GPUOptReport, steps: int = 4) -> Witness:
    pl.seed_everything(0, verbose=False)
    witness = Witness()
    trainer = pl.Trainer(max_steps=steps, callbacks=[report, witness], **TRAINER_QUIET)
    trainer.fit(BoringModel())
    return witness


def test_a_field_of_your_own_is_in_every_step_of_the_json_and_a_row_of_the_table(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "400")  # a wide terminal: the row stays on one line
    fields = [
        ReportField("weight_norm", weight_norm, label="weight norm"),
        ReportField("optimizer", lambda trainer, module: type(trainer.optimizers[0]).__name__),
    ]
    report = GPUOptReport(dirpath=str(tmp_path), plot=False, fields=fields)
    witness = _fit(report)

    written = json.loads((tmp_path / "gpuopt_report.json").read_text())
    assert [s["weight_norm"] for s in written["steps"]] == pytest.approx(witness.norms, rel=1e-6)
    assert len(set(witness.norms)) == 4  # the weights moved: four different values, in step order
    assert [s["optimizer"] for s in written["steps"]] == ["SGD"] * 4
    assert written["run"]["fields"] == [
        {"name": "weight_norm", "label": "weight norm"},
        {"name": "optimizer", "label": "optimizer"},
    ]

    printed = capsys.readouterr().out
    row = summarize_values(witness.norms)
    assert row.startswith(f"{witness.norms[-1]:.4g} at the last step")
    assert "weight norm" in printed and row in printed
    assert any("optimizer" in line and "SGD" in line for line in printed.splitlines())
    # `gpuopt report DIR` shows the same rows from the JSON alone (no callable needed).
    table = format_table(load_report(tmp_path))
    assert any(line.startswith("weight norm") and line.endswith(row) for line in table.splitlines()), table


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: ReportField("peak_bytes", weight_norm), ValueError, "records itself"),
        (lambda: ReportField("weight norm", weight_norm), ValueError, "identifier"),
        (lambda: ReportField("w", "not callable"), TypeError, "must be callable"),
        (
            lambda: GPUOptReport(fields=[ReportField("w", weight_norm), ReportField("w", weight_norm)]),
            ValueError,
            "distinct names",
        ),
    ],
    ids=["taken", "not-identifier", "not-callable", "twice"],
)
def test_a_bad_field_is_refused_when_it_is_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_value_json_cannot_hold_is_refused_with_the_field_named(tmp_path):
    report = GPUOptReport(
        dirpath=str(tmp_path), plot=False, table=False, fields=[ReportField("shape", _shape)]
    )
    with pytest.raises(TypeError, match=r"ReportField 'shape': `read` must return a number.*got list"):
        _fit(report, steps=1)


def _shape(trainer, pl_module) -> list[int]:
    return [1, 2]
