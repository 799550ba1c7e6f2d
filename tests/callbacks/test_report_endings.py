"""Every ending leaves a record: a give-up, an error of the user's code, a signal's stop and the end of fit.

After an error the report is written without allocating on the device: a callback ahead of GPUOptReport sets the
simulated device's limit to what is in use when the error reaches the callbacks, so that any allocation would
raise. A signal's stop writes the JSON and leaves the pictures to the next leg (or `gpuopt report`), whose report
covers both legs.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import ExactResume, GPUOptReport, MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.cli import main
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.report import JSON_NAME, PNG_NAME
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import TRAINER_QUIET

MiB = 2**20


class Regressor(pl.LightningModule):
    """A 64 -> 1024 -> 1 MLP; ``fail_at``: its training step raises a ValueError at that step."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1))
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise ValueError(f"a bug of the user's own at step {self.global_step}")
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class DeviceFull(pl.Callback):
    """When the error reaches the callbacks, the device is full: any allocation after this one raises."""

    def on_exception(self, trainer, pl_module, exception):
        probe = get_probe()
        probe.limit_bytes = probe.allocated_bytes


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g))


ENDINGS = ["give-up", "user-error"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_failed_fit_writes_its_report_and_oom_records_without_allocating(ending, tmp_path, capsys):
    """The give-up of docs/report.md: a dataset built inside SimulatedMemory holds 7.4 MiB of 8.15 MiB, so that not
    even one sample fits; and a ValueError of the user's training step at step 2."""
    report = GPUOptReport(dirpath=str(tmp_path), plot=False)
    model = Regressor(fail_at=2 if ending == "user-error" else None)
    limit = int(8.15 * MiB) if ending == "give-up" else None
    trainer = pl.Trainer(
        max_steps=4, callbacks=[DeviceFull(), OOMRecovery(verbose=False), report], **TRAINER_QUIET
    )
    error = MicroBatchOOMError if ending == "give-up" else ValueError
    with pytest.raises(error), SimulatedMemory(limit):
        data = _dataset(30_000 if ending == "give-up" else 256)  # on the simulated device, before fit
        trainer.fit(model, DataLoader(data, batch_size=64))
    saved = json.loads((tmp_path / JSON_NAME).read_text())
    assert saved["run"]["ended_by"] == "error"
    assert saved["run"]["stopped_by"].startswith(f"{error.__name__}: ")
    table = capsys.readouterr().out
    if ending == "give-up":
        ooms = saved["ooms"]
        assert len(ooms) >= 2 and ooms[-1]["action"].startswith("gave up: Out of memory at step 0")
        assert "gpuopt report" in table and "ended by" in table  # the table, as after any OOM: what and why
        main(["report", str(tmp_path), "--no-plot"])
        listed = capsys.readouterr().out
        assert f"#{len(ooms) - 1}  step 0 rank 0 train" in listed and "gave up" in listed
        main(["report", str(tmp_path), "--oom", str(len(ooms) - 1)])
        assert "held before the step" in capsys.readouterr().out
    else:
        assert [s["step"] for s in saved["steps"]] == [0, 1] and saved["ooms"] == []
        assert "gpuopt report" not in table  # after a bug of the user's, the traceback says what happened


class Signal(pl.Callback):
    """At the end of ``batch``, the stop signal arrives (what ExactResume's handler records)."""

    def __init__(self, exact: ExactResume, batch: int) -> None:
        self.exact, self.batch = exact, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch:
            self.exact.stop_signal = "SIGTERM"


def test_a_signal_stop_writes_the_json_and_the_next_leg_draws_the_whole_run(tmp_path, monkeypatch):
    import lightning_gpuopt.callbacks.report as report_module

    drawn: list[str] = []
    draw = report_module.render_png
    monkeypatch.setattr(report_module, "render_png", lambda r, path: drawn.append(path.name) or draw(r, path))

    def fit(callbacks, ckpt_path=None):
        quiet = {**TRAINER_QUIET, "enable_checkpointing": True}
        trainer = pl.Trainer(max_steps=8, callbacks=callbacks, default_root_dir=tmp_path, **quiet)
        trainer.fit(Regressor(), DataLoader(_dataset(512), batch_size=64), ckpt_path=ckpt_path)

    exact = ExactResume()
    first = GPUOptReport(dirpath=str(tmp_path / "report"), table=False)
    fit([first, exact, Signal(exact, batch=2)])  # gpuopt fit's order
    assert first.report["run"]["ended_by"] == "signal" and first.report["run"]["stopped_by"].startswith(
        "SIGTERM"
    )
    assert (tmp_path / "report" / JSON_NAME).is_file()
    assert drawn == [] and not (tmp_path / "report" / PNG_NAME).exists()  # the stop's time is short
    main(["report", str(tmp_path / "report"), "--no-plot"])  # the stopped run's record reads as any
    second = GPUOptReport(dirpath=str(tmp_path / "report"), table=False)
    fit([second, ExactResume()], ckpt_path=exact.stop_checkpoint)
    saved = json.loads((tmp_path / "report" / JSON_NAME).read_text())
    assert [s["step"] for s in saved["steps"]] == list(range(8))  # both legs
    (resume,) = saved["resumes"]
    assert (resume["step"], resume["steps_before"], resume["world_size"]) == (4, 4, 1)
    assert saved["run"]["ended_by"] == "fit end"
    assert drawn == [PNG_NAME] and (tmp_path / "report" / PNG_NAME).is_file()
