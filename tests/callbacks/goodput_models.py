"""A quadratic problem whose noise scale is known in closed form, for the goodput tests and benchmarks.

The loss of a sample ``x`` is ``|theta - x|^2 / 2``: its gradient is ``theta - x``. With ``x ~ N(mu, s^2 I)`` in
``d`` dimensions the true gradient is ``G = theta - mu`` and the per-sample covariance ``Sigma = s^2 I``, so
``B_simple = d s^2 / |G|^2``. ``theta`` starts at ``|G|^2 = 1``; with the learning rate at 0 it stays there.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Quadratic(pl.LightningModule):
    def __init__(self, d: int = 64, lr: float = 0.0, optimizer: str = "sgd") -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.full((d,), 1.0 / d**0.5, dtype=torch.float64))
        self.lr, self.optimizer = lr, optimizer

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return 0.5 * (self.theta - x).square().sum(dim=1).mean()

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DroppedQuadratic(Quadratic):
    """Quadratic with dropout in its step: random numbers the noise-scale measurement cannot replay."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = torch.nn.Dropout(0.1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return 0.5 * self.drop(self.theta - x).square().sum(dim=1).mean()


def quadratic_loader(b_simple: float, *, d: int = 64, batch_size: int = 64, steps: int = 300, seed: int = 0):
    """Samples ``x ~ N(0, s^2 I)`` with ``s^2 = b_simple / d`` (so that ``B_simple = b_simple`` at the start)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * batch_size, d, generator=generator, dtype=torch.float64) * (b_simple / d) ** 0.5
    return DataLoader(TensorDataset(x), batch_size=batch_size)


class TokenQuadratic(Quadratic):
    """The quadratic per token: a sample is a padded sequence of ``x`` vectors, the loss the mean over the batch's
    real tokens (labels -100 on the padding), so ``B_simple`` is ``b_simple`` tokens."""

    def training_step(self, batch, batch_idx):
        real = batch["labels"] != -100
        per_token = 0.5 * (self.theta - batch["x"]).square().sum(dim=2)
        return per_token[real].sum() / real.sum()


def token_quadratic_loader(
    b_simple: float, *, d: int = 64, batch_size: int = 16, steps: int = 600, length: int = 16
):
    generator = torch.Generator().manual_seed(0)
    n = steps * batch_size
    x = torch.randn(n, length, d, generator=generator, dtype=torch.float64) * (b_simple / d) ** 0.5
    lengths = torch.randint(1, length + 1, (n,), generator=generator)
    labels = torch.where(torch.arange(length)[None, :] < lengths[:, None], 1, -100)
    samples = [{"x": x[i], "labels": labels[i]} for i in range(n)]
    return DataLoader(samples, batch_size=batch_size)


def synthetic_measurements(
    b_simple: float, count: int, *, batch: int = 64, d: int = 64, seed: int = 0
) -> list[tuple[float, float]]:
    """``count`` one-measurement estimates ``(|G|^2, tr(Sigma))`` with ``|G|^2 = 1`` and ``tr(Sigma) = b_simple``.

    Each is what GradientNoiseScale takes from a step: the mean gradient of half a batch against the whole batch,
    per-sample gradients ``G + e`` with ``e ~ N(0, b_simple / d I)`` in ``d`` dimensions.
    """
    from lightning_gpuopt.goodput import noise_scale_terms

    generator = torch.Generator().manual_seed(seed)
    true = torch.zeros(d, dtype=torch.float64)
    true[0] = 1.0
    half, sd = batch // 2, (b_simple / d) ** 0.5
    out = []
    for _ in range(count):
        first = true + torch.randn(d, generator=generator, dtype=torch.float64) * sd / half**0.5
        second = true + torch.randn(d, generator=generator, dtype=torch.float64) * sd / (batch - half) ** 0.5
        whole = (half * first + (batch - half) * second) / batch
        out.append(noise_scale_terms(float(first @ first), half, float(whole @ whole), batch))
    return out
