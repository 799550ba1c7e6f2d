"""The data pipeline: how long training waits for data with naive loader settings vs GPUOptDataModule's defaults.

    python benchmarks/data_pipeline.py                  # CPU, about 3 minutes on 2 cores
    python benchmarks/data_pipeline.py --quick          # smoke run, under a minute
    python benchmarks/data_pipeline.py --device cuda    # adds "defaults without device prefetch" (GPU section `data`)

The workload is CPU-heavy on purpose, like an image pipeline that decodes and augments on the fly:
generated images are stored JPEG-encoded in memory (made once, deterministic, no downloads); each
sample is decoded (``torchvision.io.decode_jpeg``) and augmented (``RandomResizedCrop``, horizontal
flip, ``ColorJitter``, normalisation) when it is loaded. Two models consume it:

- **resnet18**: a torchvision ResNet-18 trained on the device. On a CPU-only machine its compute
  competes with the loader workers for the same cores, so this row shows the trade-off on CPU.
- **device stand-in** (CPU runs only): a linear classifier whose step also waits ``--standin-ms``
  (default 60 ms) without using a CPU, as the host does while a GPU computes a step. This is the
  situation the pipeline is built for: host CPUs are free to load the next batches during the step.

Configurations, interleaved (naive, defaults, ..., then the reverse order) so that drift on a
shared machine hits them alike:

- **naive**: ``num_workers=0``, ``pin_memory=False``, ``device_prefetch=False`` -- the DataLoader's
  own defaults: every batch is decoded and augmented in the training process, between steps;
- **defaults**: ``GPUOptDataModule``'s defaults (``num_workers="auto"``, ``pin_memory="auto"``,
  ``device_prefetch="auto"``, persistent workers, ``prefetch_factor=2``), resolved for this machine;
- **defaults, no device prefetch** (CUDA only): the defaults with ``device_prefetch=False``, to see
  what copying the next batch on a side stream adds.

Per fit: the data-wait fraction that :class:`~lightning_gpuopt.DataStallMonitor` measured over the
epoch (its first step excluded; on CUDA from CUDA events, on CPU from the wall clock) and samples/s
over the steady steps (wall clock from the end of the first step to the end of the last, the device
synchronised at both ends on CUDA). Reported: per configuration the median over repeats with the
spread (min-max), and the median per-repeat ratio of samples/s to naive.

Writes ``data_pipeline.json`` to ``--out``. Timing targets are reported, not enforced: CPU timings on
a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchvision.transforms import v2

from lightning_gpuopt import DataStallMonitor, GPUOptDataModule
from lightning_gpuopt.data import available_cpus

IMAGE_SIZE = 96  # stored (encoded) images
CROP = 64  # what the model sees
NUM_CLASSES = 10


class EncodedImages(Dataset):
    """``length`` generated images kept JPEG-encoded; each sample is decoded and augmented when loaded.

    Class ``c`` is a bright square in one of ``NUM_CLASSES`` positions over noise: learnable, so the
    model's steps are real training. The encoded bytes are made once, from a fixed seed.
    """

    def __init__(self, length: int, quality: int = 90) -> None:
        g = torch.Generator().manual_seed(0)
        self.labels = torch.randint(0, NUM_CLASSES, (length,), generator=g)
        self.encoded = []
        cell = IMAGE_SIZE // 4
        for label in self.labels.tolist():
            image = torch.randint(0, 96, (3, IMAGE_SIZE, IMAGE_SIZE), generator=g, dtype=torch.uint8)
            row, col = divmod(label, 4)
            image[:, row * cell : (row + 1) * cell, col * cell : (col + 1) * cell] = 230
            self.encoded.append(torchvision.io.encode_jpeg(image, quality=quality))
        self.augment = v2.Compose(
            [
                v2.RandomResizedCrop(CROP, scale=(0.6, 1.0), antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ColorJitter(brightness=0.3, contrast=0.3, saturation=0.3),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25]),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = torchvision.io.decode_jpeg(self.encoded[i])
        return self.augment(image), self.labels[i]


class ImageData(GPUOptDataModule):
    """The benchmark's datamodule: a GPUOptDataModule over :class:`EncodedImages`."""

    def __init__(self, dataset: EncodedImages, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._train = dataset

    def train_dataset(self) -> Dataset:
        return self._train


class Classifier(pl.LightningModule):
    """ResNet-18 (``standin_ms=0``), or a linear classifier whose step also waits ``standin_ms`` off the CPU."""

    def __init__(self, standin_ms: float = 0.0) -> None:
        super().__init__()
        if standin_ms:
            self.net = nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(3 * 64, NUM_CLASSES))
        else:
            self.net = torchvision.models.resnet18(num_classes=NUM_CLASSES)
        self.standin_s = standin_ms / 1e3

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.standin_s:
            time.sleep(self.standin_s)  # the device computing: the host waits, its CPUs are free
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Throughput(pl.Callback):
    """Wall-clock samples/s from the end of the first step to the end of the last (device synchronised there)."""

    def __init__(self) -> None:
        self.samples = 0
        self.start: float | None = None
        self.end: float | None = None

    def _now(self, trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.start is None:
            self.start = self._now(trainer)
        else:
            self.samples += len(batch[1])

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: nn.Module) -> None:
        self.end = self._now(trainer)

    @property
    def samples_per_s(self) -> float:
        return (
            self.samples / (self.end - self.start)
            if self.start and self.end and self.end > self.start
            else 0.0
        )


@dataclass(frozen=True)
class Config:
    name: str
    loader: dict[str, Any]
    description: str


def configs(device: str) -> list[Config]:
    naive = Config(
        "naive",
        {"num_workers": 0, "pin_memory": False, "device_prefetch": False, "persistent_workers": False},
        "num_workers=0, pin_memory=False, device_prefetch=False (the DataLoader's defaults)",
    )
    defaults = Config(
        "defaults", {}, "GPUOptDataModule defaults (num_workers/pin_memory/device_prefetch 'auto')"
    )
    out = [naive, defaults]
    if device == "cuda":
        out.append(
            Config(
                "defaults, no device prefetch",
                {"device_prefetch": False},
                "the defaults with device_prefetch=False",
            )
        )
    return out


def fit_once(
    config: Config, dataset: EncodedImages, batch_size: int, device: str, standin_ms: float
) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    data = ImageData(dataset, batch_size=batch_size, **config.loader)
    monitor, throughput = DataStallMonitor(window=10_000), Throughput()  # window: never warn mid-benchmark
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        max_epochs=1,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor, throughput],
    )
    trainer.fit(Classifier(standin_ms), datamodule=data)
    epoch = monitor.history[0]
    return {
        "samples_per_s": throughput.samples_per_s,
        "wait_fraction": epoch.fraction,
        "steps_measured": epoch.steps,
        "wait_ms_per_step": 1e3 * epoch.wait_s / max(1, epoch.steps),
        "compute_ms_per_step": 1e3 * epoch.compute_s / max(1, epoch.steps),
        "num_workers": data.resolved_num_workers(),
        "pin_memory": data.resolved_pin_memory(),
        "device_prefetch": data.resolved_device_prefetch(),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(
    device: str, repeats: int, steps: int, batch_size: int, standin_ms: float = 0.0
) -> dict[str, Any]:
    dataset = EncodedImages(length=batch_size * steps)
    variants = configs(device)
    fit_once(
        variants[0], EncodedImages(length=batch_size * 2), batch_size, device, standin_ms
    )  # untimed warm-up
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in variants}
    for r in range(repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for config in order:
            print(f"  repeat {r + 1}/{repeats}: {config.name} ...", flush=True)
            runs[config.name].append(fit_once(config, dataset, batch_size, device, standin_ms))
    naive = runs["naive"]
    results: dict[str, Any] = {}
    for config in variants:
        fits = runs[config.name]
        results[config.name] = {
            "description": config.description,
            "settings": {k: fits[0][k] for k in ("num_workers", "pin_memory", "device_prefetch")},
            "samples_per_s": _spread([f["samples_per_s"] for f in fits]),
            "wait_fraction": _spread([f["wait_fraction"] for f in fits]),
            "wait_ms_per_step": _spread([f["wait_ms_per_step"] for f in fits]),
            "compute_ms_per_step": _spread([f["compute_ms_per_step"] for f in fits]),
            "speedup_vs_naive": _spread(
                [f["samples_per_s"] / n["samples_per_s"] for f, n in zip(fits, naive)]
            ),
            "fits": fits,
        }
    return results


def print_table(results: dict[str, Any]) -> None:
    rows = [
        (
            "model",
            "configuration",
            "workers",
            "pinned",
            "dev. prefetch",
            "samples/s (median, min-max)",
            "data-wait fraction (median, min-max)",
            "wait / compute ms per step",
            "speed-up vs naive (median, min-max)",
        )
    ]
    for model, configurations in results["models"].items():
        for name, r in configurations.items():
            s, w, x = r["samples_per_s"], r["wait_fraction"], r["speedup_vs_naive"]
            rows.append(
                (
                    model,
                    name,
                    str(r["settings"]["num_workers"]),
                    str(r["settings"]["pin_memory"]),
                    str(r["settings"]["device_prefetch"]),
                    f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})",
                    f"{w['median']:.0%} ({w['min']:.0%}-{w['max']:.0%})",
                    f"{r['wait_ms_per_step']['median']:.0f} / {r['compute_ms_per_step']['median']:.0f}",
                    f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for data_pipeline.json"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved repeats (default 5; --quick: 1)"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per fit (default 30; --quick: 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument(
        "--standin-ms",
        type=float,
        default=60.0,
        help="device time per step of the stand-in model (CPU runs; default 60 ms)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke mode: one repeat of a few steps")
    args = parser.parse_args(argv)
    for name in ("repeats", "steps", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    steps = args.steps or (8 if args.quick else 30)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gpuopt"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "data_pipeline",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "available_cpus": available_cpus(),
        "torch_threads": torch.get_num_threads(),
        "workload": f"JPEG {IMAGE_SIZE}x{IMAGE_SIZE} decode + RandomResizedCrop({CROP}) + flip + ColorJitter + normalize "
        f"per sample; torchvision ResNet-18 ({NUM_CLASSES} classes), SGD",
        "batch_size": args.batch_size,
        "steps": steps,
        "repeats": repeats,
    }
    print(
        f"data pipeline on {args.device}: {repeats} interleaved repeats of {steps} steps, batch {args.batch_size}",
        flush=True,
    )
    models = {"resnet18": 0.0}
    if args.device == "cpu":
        models[f"device stand-in ({args.standin_ms:g} ms)"] = args.standin_ms
    results["models"] = {}
    for model, standin_ms in models.items():
        print(f"{model}:", flush=True)
        results["models"][model] = measure(args.device, repeats, steps, args.batch_size, standin_ms)
    results["targets"] = [
        {
            "model": model,
            "metric": "samples/s with the defaults over naive settings (median of per-repeat ratios)",
            "threshold": "> 1.0",
            "value": (v := r["defaults"]["speedup_vs_naive"]["median"]),
            "met": v > 1.0,
        }
        for model, r in results["models"].items()
    ]
    results["wall_s"] = time.perf_counter() - started
    print()
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "data_pipeline.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {path} ({results['wall_s']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
