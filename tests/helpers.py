"""Small real LightningModules and datasets the tests train."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

TRAINER_QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "accelerator": "cpu",
    "devices": 1,
    "num_sanity_val_steps": 0,
}


class IndexedRegression(Dataset):
    """Sample i is (i, x_i, y_i) with y a fixed linear function of x: ids let tests count deliveries."""

    def __init__(self, length: int = 64, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, dim, generator=g)
        self.w = torch.randn(dim, 1, generator=g)
        self.y = self.x @ self.w

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class RecordingRegressor(pl.LightningModule):
    """A small MLP regressor that records the sample ids of every training and validation batch."""

    def __init__(self, dim: int = 8, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr = lr
        self.train_ids: list[list[int]] = []
        self.val_ids: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.train_ids.append(ids.tolist())
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        ids, x, y = batch
        self.val_ids.append(ids.tolist())
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class MetricsLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)`` in ``rows``."""

    name, version = "collect", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def experiment(self) -> None:
        return None

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))
