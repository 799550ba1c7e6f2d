"""The default job's parts: a learnable synthetic image dataset and a torchvision classifier.

Nothing is downloaded: every image is generated from its index, so the data is identical on every
machine, in every worker process and across runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torchmetrics
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from lightning_gpuopt._validate import positive_int
from lightning_gpuopt.data import GPUOptDataModule

__all__ = ["ImageClassifier", "SyntheticImageDataModule", "SyntheticImages"]


@dataclass(eq=False)  # compared and hashed by identity, as a Dataset
class SyntheticImages(Dataset):
    """Deterministic, learnable images: class ``c`` is a striped pattern at angle ``c·π/num_classes``.

    Each sample has a random phase, frequency, colour mix, brightness and Gaussian noise drawn from a
    generator seeded by ``(seed, index)``, so a model must learn the orientation, not memorise pixels.

    Args:
        length: number of samples.
        num_classes: number of classes (orientations).
        image_size: height and width in pixels.
        noise: standard deviation of the pixel noise.
        seed: base seed; datasets with different seeds hold different samples.

    Example:
        >>> ds = SyntheticImages(length=4, image_size=16)
        >>> x, y = ds[3]
        >>> tuple(x.shape), int(y)
        ((3, 16, 16), 3)
        >>> torch.equal(ds[3][0], x)
        True
    """

    length: int
    num_classes: int = 10
    image_size: int = 32
    noise: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("length", "num_classes", "image_size"):
            positive_int(name, getattr(self, name))
        if self.noise < 0:
            raise ValueError(f"`noise` must be >= 0, got {self.noise!r}")
        coords = torch.linspace(-1.0, 1.0, self.image_size)
        self._yy, self._xx = torch.meshgrid(coords, coords, indexing="ij")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % self.num_classes
        angle = math.pi * label / self.num_classes
        u = torch.rand(5, generator=g)
        freq = 3.0 + 3.0 * u[0].item()
        phase = 2 * math.pi * u[1].item()
        stripes = torch.sin(
            freq * math.pi * (self._xx * math.cos(angle) + self._yy * math.sin(angle)) + phase
        )
        colour = 0.5 + torch.rand(3, 1, 1, generator=g)
        image = colour * stripes * (0.6 + 0.8 * u[2].item()) + (u[3].item() - 0.5)
        image = image + self.noise * torch.randn(3, self.image_size, self.image_size, generator=g)
        return image, torch.tensor(label)


class SyntheticImageDataModule(GPUOptDataModule):
    """Training and validation splits of :class:`SyntheticImages` (different seeds, so no overlap).

    Args:
        train_size: training samples.
        val_size: validation samples.
        num_classes: number of classes.
        image_size: height and width in pixels.
        noise: pixel noise standard deviation.
        **loader_kwargs: :class:`~lightning_gpuopt.GPUOptDataModule` arguments (``batch_size``, ``num_workers``, ...).

    Example:
        >>> dm = SyntheticImageDataModule(train_size=8, val_size=4, batch_size=4, num_workers=0)
        >>> x, y = next(iter(dm.val_dataloader()))
        >>> tuple(x.shape)
        (4, 3, 32, 32)
    """

    def __init__(
        self,
        train_size: int = 4096,
        val_size: int = 1024,
        num_classes: int = 10,
        image_size: int = 32,
        noise: float = 2.0,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.save_hyperparameters()
        self.train_size = train_size
        self.val_size = val_size
        self.num_classes = num_classes
        self.image_size = image_size
        self.noise = noise

    def train_dataset(self) -> Dataset:
        return SyntheticImages(self.train_size, self.num_classes, self.image_size, self.noise, seed=1)

    def val_dataset(self) -> Dataset:
        return SyntheticImages(self.val_size, self.num_classes, self.image_size, self.noise, seed=2)


class ImageClassifier(pl.LightningModule):
    """A torchvision classifier (ResNet-18 by default) with cross-entropy, AdamW and a cosine schedule.

    Logs ``train_loss``, ``val_loss`` and ``val_acc`` (torchmetrics multiclass accuracy).

    Args:
        arch: a ``torchvision.models`` constructor name, e.g. ``"resnet18"`` or ``"resnet50"``.
        num_classes: number of classes.
        lr: peak learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = ImageClassifier(num_classes=10)
        >>> tuple(model(torch.zeros(2, 3, 32, 32)).shape)
        (2, 10)
    """

    def __init__(
        self, arch: str = "resnet18", num_classes: int = 10, lr: float = 2e-3, weight_decay: float = 0.05
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        builder = getattr(torchvision.models, arch, None)
        if not callable(builder):
            raise ValueError(
                f"`arch` must name a torchvision.models constructor such as 'resnet18', got {arch!r}"
            )
        self.net: nn.Module = builder(weights=None, num_classes=num_classes)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc.update(logits.detach(), y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        total = self.trainer.estimated_stepping_batches
        if not isinstance(total, int) or total <= 0 or total == float("inf"):
            return optimizer
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=total, pct_start=0.15
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
