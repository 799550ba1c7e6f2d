"""The same command resumes (docs/resume.md, "The run's folder"): `gpuopt fit` stopped by SIGTERM in epoch 1 and
run again goes on in its own folder and ends where the uninterrupted run ends; one `metrics.csv` holds both legs,
with the uninterrupted run's validation rows; run once more it has nothing to do; with another seed it is another
run, in a folder of its own. With the shipped default config, and with a module on Lightning's default logger.

The runs call `main` in this process, in the test's own folder (so the command is the user's, relative paths
included), at one torch thread count: parameters are compared with `torch.equal`.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_gpuopt import GPUOptDataModule
from lightning_gpuopt.cli import main
from tests.helpers import REPO, IndexedRegression

pytestmark = pytest.mark.usefixtures("cli_argv", "one_thread")

DEFAULT_CONFIG = str(REPO / "examples" / "configs" / "default.yaml")
# The shipped config, shrunk for test time: a small torchvision model, 64 images (4 steps an epoch), 2 epochs.
DEFAULT_JOB = [
    "fit",
    "--config",
    DEFAULT_CONFIG,
    "--model.init_args.arch",
    "squeezenet1_1",
    "--data.init_args.train_size",
    "64",
    "--data.init_args.val_size",
    "32",
    "--data.init_args.batch_size",
    "16",
    "--trainer.max_epochs",
    "2",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]
# A module of the user's own on Lightning's default logger (no `trainer.logger`): dropout, so the random state
# matters; validation every epoch. 40 samples, batch 4: 10 steps an epoch.
OWN_MODULE = [
    "fit",
    "--model",
    "tests.test_cli_same_command.DropoutRegressor",
    "--data",
    "tests.test_cli_same_command.RegressionData",
    "--data.batch_size",
    "4",
    "--seed_everything",
    "3",
    "--trainer.max_epochs",
    "2",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]
SIGTERM_AT = {"default-config": 5, "default-logger": 13}  # a batch of epoch 1


class RegressionData(GPUOptDataModule):
    def train_dataset(self):
        return IndexedRegression(40)

    def val_dataset(self):
        return IndexedRegression(12, seed=1)


class DropoutRegressor(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Dropout(0.2), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpuopt fit:")]


def _run_folders(root: Path) -> list[Path]:
    return sorted(p.parent.parent for p in root.glob("**/checkpoints/last.ckpt"))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def _validation_rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [
        {k: v for k, v in row.items() if k == "epoch" or k == "step" or k.startswith("val")}
        for row in rows
        if row.get("val_loss")
    ]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("job", ["default-config", "default-logger"])
def test_the_same_command_resumes_its_run_and_ends_like_the_uninterrupted_one(
    job, tmp_path, monkeypatch, caplog
):
    command = DEFAULT_JOB if job == "default-config" else OWN_MODULE
    (tmp_path / "ref").mkdir()
    monkeypatch.chdir(tmp_path / "ref")
    main(command)
    (reference,) = _run_folders(tmp_path / "ref")

    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    term = [
        "--trainer.callbacks+=tests.resume_child.Fault",
        f"--trainer.callbacks.term_batch={SIGTERM_AT[job]}",
    ]
    with caplog.at_level(logging.INFO):
        main([*command, *term])  # ExactResume takes the SIGTERM: a checkpoint, fit returns
    stopped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ExactResume: stopped by")]
    assert len(stopped) == 1 and stopped[0].endswith("; the same command resumes.")
    (folder,) = _run_folders(tmp_path / "run")
    assert folder.name.startswith("run-") and folder.relative_to(tmp_path / "run") == reference.relative_to(
        tmp_path / "ref"
    )  # the folder is the config's, wherever the command runs
    caplog.clear()
    with caplog.at_level(logging.INFO):
        main(command)  # the same command
    (said,) = _said(caplog)
    checkpoint = folder.relative_to(Path.cwd()) / "checkpoints" / "last.ckpt"
    assert said.startswith("gpuopt fit: resuming from ") and f"{checkpoint} at step " in said
    assert ", epoch 1, " in said
    assert _run_folders(tmp_path / "run") == [folder]

    ref_weights, weights = _weights(reference), _weights(folder)
    assert ref_weights.keys() == weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights), (
        "the resumed run ended elsewhere"
    )
    assert list(folder.glob("**/metrics.csv")) == [folder / "metrics.csv"]  # one file, both legs
    assert _validation_rows(folder) == _validation_rows(reference)
    assert len(_validation_rows(reference)) == 2  # one each epoch

    before = _files(folder)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        main(command)  # once more: finished
    (said,) = _said(caplog)
    assert "finished at step" in said and ": nothing to do." in said and "--ckpt_path null" in said
    assert _files(folder) == before

    main([*command, "--seed_everything", "7"])  # another seed: another run, in its own folder
    folders = _run_folders(tmp_path / "run")
    assert len(folders) == 2 and folder in folders
    assert _files(folder) == before
