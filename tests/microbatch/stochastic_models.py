"""Training steps that draw random numbers inside ``training_step`` or skip batches by returning ``None``, and a
runner that trains them under SimulatedMemory with a limit that makes OOMRecovery split every batch."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import GPUOptWarning
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import TRAINER_QUIET, parameters_of

DIM = 6


class Points(Dataset):
    """Sample i is (i, x_i): targets of a generative model, and the id that seeds a sample's own noise."""

    def __init__(self, n: int = 64, dim: int = DIM, poisoned: tuple[int, ...] = ()) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g) * 0.5 + 1.0
        for i in poisoned:
            self.x[i, 0] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i]


class Wide(pl.LightningModule):
    """A wide MLP whose activations dominate memory, as in the models OOM recovery is for."""

    def __init__(self, width: int = 512, inputs: int = DIM + 1, outputs: int = DIM, lr: float = 0.05) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(inputs, width), nn.Tanh(), nn.Linear(width, outputs))
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class FlowMatching(Wide):
    """Rectified flow: noise and a time per sample drawn inside the step, the velocity regressed.

    ``reduction``: ``"mean"`` (a per-element mean) or ``"sum"``; ``seeded``: each sample's noise and time come
    from a generator seeded with its id, so that a split draws exactly what the whole batch draws.
    """

    def __init__(self, reduction: str = "mean", seeded: bool = False) -> None:
        super().__init__()
        self.reduction, self.seeded = reduction, seeded

    def draw(self, ids: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.seeded:
            return torch.randn_like(x1), torch.rand(len(x1), 1, dtype=x1.dtype, device=x1.device)
        noise, times = [], []
        for i in ids.tolist():
            g = torch.Generator().manual_seed(int(i))
            noise.append(torch.randn(x1.shape[1:], generator=g, dtype=x1.dtype))
            times.append(torch.rand(1, generator=g, dtype=x1.dtype))
        return torch.stack(noise).to(x1.device), torch.stack(times).to(x1.device)

    def training_step(self, batch, batch_idx):
        ids, x1 = batch
        x0, t = self.draw(ids, x1)
        xt = (1 - t) * x0 + t * x1
        error = (self.net(torch.cat([xt, t], 1)) - (x1 - x0)).square()
        return error.mean() if self.reduction == "mean" else error.sum()


class NoisyInfoNCE(Wide):
    """SimCLR-style: two views of each sample by noise drawn in the step, InfoNCE over the batch's views."""

    def __init__(self) -> None:
        super().__init__(inputs=DIM, outputs=16)

    def training_step(self, batch, batch_idx):
        _, x = batch
        a = F.normalize(self.net(x + 0.1 * torch.randn_like(x)), dim=1)
        b = F.normalize(self.net(x + 0.1 * torch.randn_like(x)), dim=1)
        return F.cross_entropy(a @ b.T / 0.1, torch.arange(len(x), device=x.device))


VOCAB, LENGTH, MASK_ID = 32, 16, 31


class Tokens(Dataset):
    """Token sequences, no labels: a masked LM that masks inside its step."""

    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(0, MASK_ID, (n, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i]}


class MaskingInStep(pl.LightningModule):
    """BERT-style masking drawn inside ``training_step``: the loss is a mean over the tokens it chose."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, 256)
            self.head = nn.Linear(256, VOCAB)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        chosen = torch.rand(ids.shape, device=ids.device) < 0.5
        labels = ids.masked_fill(~chosen, -100)
        logits = self.head(torch.tanh(self.embed(ids.masked_fill(chosen, MASK_ID))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Diffusion(pl.LightningModule):
    """diffusers' standard DDPM loop on a tiny ``UNet2DModel`` built from its config (no weights)."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DDPMScheduler, UNet2DModel

        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.unet = UNet2DModel(
                sample_size=8,
                in_channels=1,
                out_channels=1,
                layers_per_block=1,
                block_out_channels=(8, 16),
                down_block_types=("DownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "UpBlock2D"),
                norm_num_groups=4,
            )
        self.scheduler = DDPMScheduler(num_train_timesteps=100)

    def training_step(self, batch, batch_idx):
        _, images = batch
        noise = torch.randn_like(images)
        steps = self.scheduler.config.num_train_timesteps
        t = torch.randint(0, steps, (len(images),), device=images.device)
        noisy = self.scheduler.add_noise(images, noise, t)
        return F.mse_loss(self.unet(noisy, t).sample, noise)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Images(Dataset):
    def __init__(self, n: int = 32) -> None:
        self.x = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i]


# ----------------------------------------------------------------------------- skipped batches


class SkipsEveryThird(Wide):
    """Returns ``None`` on every third batch (after logging), with a step-wise LR schedule."""

    def __init__(self) -> None:
        super().__init__(inputs=DIM, outputs=1)

    def training_step(self, batch, batch_idx):
        _, x = batch
        loss = F.mse_loss(self.net(x), x.sum(1, keepdim=True).sin())
        self.log("train_loss", loss)
        return None if batch_idx % 3 == 2 else loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SkipsNonFinite(SkipsEveryThird):
    """The common guard: ``return None`` when the loss is not finite (a poisoned sample in the batch)."""

    def training_step(self, batch, batch_idx):
        _, x = batch
        loss = F.mse_loss(self.net(x), x.sum(1, keepdim=True).sin())
        return loss if torch.isfinite(loss) else None


# ----------------------------------------------------------------------------- runs


@dataclass
class Run:
    model: pl.LightningModule
    trainer: pl.Trainer
    theta0: dict[str, torch.Tensor]
    theta: dict[str, torch.Tensor]
    warnings: list[warnings.WarningMessage]
    memory: SimulatedMemory | None = None

    @property
    def pack_warnings(self) -> list[str]:
        return [str(w.message) for w in self.warnings if issubclass(w.category, GPUOptWarning)]


def train(
    model: pl.LightningModule,
    dataset: Dataset,
    callbacks: list | None = None,
    limit: int | None = None,
    simulate: bool = True,
    steps: int = 4,
    batch_size: int = 16,
    precision: str = "32-true",
    **trainer_kwargs,
) -> Run:
    """Fit ``model`` (under SimulatedMemory with ``limit`` unless ``simulate=False``), warnings collected."""
    pl.seed_everything(0, verbose=False)
    theta0 = parameters_of(model)
    trainer = pl.Trainer(
        max_steps=steps,
        precision=precision,
        callbacks=list(callbacks or []),
        **{**TRAINER_QUIET, **trainer_kwargs},
    )
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    memory = SimulatedMemory(limit) if simulate else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GPUOptWarning)
        if memory is None:
            trainer.fit(model, loader)
        else:
            with memory:
                trainer.fit(model, loader)
    return Run(model, trainer, theta0, parameters_of(model), list(caught), memory)


def limit_forcing_split(make, dataset: Dataset, batch_size: int = 16, precision: str = "32-true") -> int:
    """A SimulatedMemory limit under which half a batch trains and a whole one does not: OOMRecovery splits.

    Measured over two steps, so that the optimizer state made at the first step counts."""
    peaks = []
    for size in (batch_size, batch_size // 2):
        run = train(make(), dataset, limit=None, steps=2, batch_size=size, precision=precision)
        peaks.append(run.memory.peak)
    whole, half = peaks
    assert half < whole, (half, whole)
    return (whole + half) // 2
