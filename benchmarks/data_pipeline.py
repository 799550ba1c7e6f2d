"""The data pipeline: how long training waits for data with naive loader settings vs GPUOptDataModule's defaults.

    python benchmarks/data_pipeline.py [--quick] [--device cuda]  # CPU: about 3 minutes on 2 cores

JPEG-encoded generated images, decoded and augmented per sample, feed a ResNet-18 and (on a CPU) a device
stand-in that waits ``--standin-ms`` per step. Configurations, interleaved: **naive** (the DataLoader's
defaults), GPUOptDataModule's **defaults**, on CUDA the defaults without device prefetch. Per configuration:
the data-wait fraction and samples/s, medians over repeats. Writes ``data_pipeline.json``; targets reported,
not enforced. How each figure is measured: docs/benchmarks.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import common
import lightning.pytorch as pl
import torch
import torchvision
from common import Classifier, Data, figure, spread
from torch import nn
from torch.utils.data import Dataset
from torchvision.transforms import v2

from lightning_gpuopt import DataStallMonitor
from lightning_gpuopt.data import available_cpus

IMAGE_SIZE = 96  # stored (encoded) images
CROP = 64  # what the model sees
NUM_CLASSES = 10
NAIVE = "num_workers=0, pin_memory=False, device_prefetch=False"


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
        jitter = v2.ColorJitter(brightness=0.3, contrast=0.3, saturation=0.3)
        crop = v2.RandomResizedCrop(CROP, scale=(0.6, 1.0), antialias=True)
        scale = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=[0.5] * 3, std=[0.25] * 3)]
        self.augment = v2.Compose([crop, v2.RandomHorizontalFlip(), jitter, *scale])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.augment(torchvision.io.decode_jpeg(self.encoded[i])), self.labels[i]


class DeviceStandIn(nn.Module):
    """A linear classifier whose forward also waits ``ms`` off the CPU: the host while a device computes."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.seconds = ms / 1e3
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(3 * 64, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)  # the device computing: the host waits, its CPUs are free
        return self.net(x)


def _network(standin_ms: float) -> nn.Module:
    return DeviceStandIn(standin_ms) if standin_ms else torchvision.models.resnet18(num_classes=NUM_CLASSES)


class Throughput(pl.Callback):
    """Wall clock from the end of the first step to the end of the epoch (the device synchronised there)."""

    def __init__(self) -> None:
        self.samples, self.start, self.end = 0, None, None

    def _now(self, trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        batch = args[2]
        self.samples += len(batch[1]) if self.start is not None else 0
        self.start = self.start or self._now(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.end = self._now(trainer)


@dataclass(frozen=True)
class Config:
    name: str
    loader: dict[str, Any]
    description: str


def configs(device: str) -> list[Config]:
    naive = {"num_workers": 0, "pin_memory": False, "device_prefetch": False, "persistent_workers": False}
    listed = [
        Config("naive", naive, f"{NAIVE} (the DataLoader's defaults)"),
        Config("defaults", {}, "GPUOptDataModule defaults (num_workers/pin_memory/device_prefetch 'auto')"),
    ]
    if device == "cuda":
        no_prefetch = "the defaults with device_prefetch=False"
        listed.append(Config("defaults, no device prefetch", {"device_prefetch": False}, no_prefetch))
    return listed


def fit_once(config: Config, dataset: EncodedImages, batch_size: int, device: str, standin_ms: float) -> dict:
    pl.seed_everything(0, verbose=False)
    data = Data(dataset, batch_size=batch_size, **config.loader)
    monitor, throughput = DataStallMonitor(window=10_000), Throughput()  # window: never warn mid-benchmark
    # One epoch: no step limit.
    trainer = common.trainer(-1, [monitor, throughput], device, max_epochs=1, precision="32-true")
    trainer.fit(Classifier(lambda: _network(standin_ms), lr=0.05), datamodule=data)
    epoch, steps = monitor.history[0], max(1, monitor.history[0].steps)
    result = {"samples_per_s": throughput.samples / (throughput.end - throughput.start)}
    result.update(wait_fraction=epoch.fraction, steps_measured=epoch.steps)
    result["wait_ms_per_step"] = 1e3 * epoch.wait_s / steps
    result["compute_ms_per_step"] = 1e3 * epoch.compute_s / steps
    result.update(num_workers=data.resolved_num_workers(), pin_memory=data.resolved_pin_memory())
    return {**result, "device_prefetch": data.resolved_device_prefetch()}


def measure(device: str, repeats: int, steps: int, batch_size: int, standin_ms: float = 0.0) -> dict:
    dataset, variants = EncodedImages(length=batch_size * steps), configs(device)
    warmup = EncodedImages(length=batch_size * 2)
    fit_once(variants[0], warmup, batch_size, device, standin_ms)  # untimed warm-up
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in variants}
    for r in range(repeats):
        for config in variants if r % 2 == 0 else variants[::-1]:
            print(f"  repeat {r + 1}/{repeats}: {config.name} ...", flush=True)
            runs[config.name].append(fit_once(config, dataset, batch_size, device, standin_ms))
    results: dict[str, Any] = {}
    for config in variants:
        fits = runs[config.name]
        speedup = [f["samples_per_s"] / n["samples_per_s"] for f, n in zip(fits, runs["naive"])]
        settings = {k: fits[0][k] for k in ("num_workers", "pin_memory", "device_prefetch")}
        result = {"description": config.description, "settings": settings}
        for key in ("samples_per_s", "wait_fraction", "wait_ms_per_step", "compute_ms_per_step"):
            result[key] = spread([f[key] for f in fits])
        results[config.name] = {**result, "speedup_vs_naive": spread(speedup), "fits": fits}
    return results


def gpu_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The GPU check's ``data`` section: the configurations on its device (the CPU in the dry run)."""
    from gpu import device

    on_cuda = device.current().kind == "cuda"
    runs = measure("cuda" if on_cuda else "cpu", sizes["repeats"], sizes["steps"], sizes["batch"])
    skipped, rate = {}, {name: r["samples_per_s"]["median"] for name, r in runs.items()}
    figures = [figure(f"data pipeline, {name}: samples/s", x, "samples/s") for name, x in rate.items()]
    speedup = runs["defaults"]["speedup_vs_naive"]["median"]
    met = speedup > 1 if on_cuda else None
    figures.append(figure("data pipeline: defaults over naive settings", speedup, "x", "> 1", met))
    if "defaults, no device prefetch" in runs:
        gain = rate["defaults"] / rate["defaults, no device prefetch"]
        what = "data pipeline: device prefetch gain (defaults over defaults without it)"
        figures.append(figure(what, gain, "x", "reported"))
    else:
        why = "device prefetch copies on a CUDA side stream; a CPU run has no device copy"
        skipped["device prefetch"] = why
    for r in runs.values():
        r.pop("fits", None)
    return {"figures": figures, "details": runs, "skipped": skipped}


def _span(s: dict[str, float], fmt: str, unit: str = "") -> str:
    return f"{s['median']:{fmt}}{unit} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def report(results: dict[str, Any]) -> None:
    header = "model|configuration|workers|pinned|dev. prefetch|samples/s (median, min-max)|data-wait fraction (median, min-max)|wait / compute ms per step|speed-up vs naive (median, min-max)"
    rows = [header.split("|")]
    for model, configurations in results["models"].items():
        for name, r in configurations.items():
            s, w, x, settings = r["samples_per_s"], r["wait_fraction"], r["speedup_vs_naive"], r["settings"]
            loader = (settings["num_workers"], settings["pin_memory"], settings["device_prefetch"])
            ms = f"{r['wait_ms_per_step']['median']:.0f} / {r['compute_ms_per_step']['median']:.0f}"
            cells = [_span(s, ".1f"), _span(w, ".0%"), ms, _span(x, ".2f", "x")]
            rows.append([model, name, *loader, *cells])
    common.print_table(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick = "smoke mode: one repeat of a few steps"
    parser = common.arguments(__doc__, "data_pipeline.json", quick=quick, repeats=(5, 1), device="cpu")
    parser.add_argument("--steps", type=common.positive_int, help="steps per fit (default 30; --quick: 8)")
    parser.add_argument("--batch-size", type=common.positive_int, default=32, help="samples per step")
    standin = "device time per step of the stand-in model (CPU runs)"
    parser.add_argument("--standin-ms", type=float, default=60.0, help=standin)
    args = parser.parse_args(argv)
    batch = args.batch_size
    repeats, steps = args.repeats or (1 if args.quick else 5), args.steps or (8 if args.quick else 30)
    common.quiet()
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "data_pipeline",
        **common.environment(torchvision=torchvision.__version__, available_cpus=available_cpus()),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "workload": f"JPEG {IMAGE_SIZE}x{IMAGE_SIZE} decode + RandomResizedCrop({CROP}) + flip + ColorJitter + "
        f"normalize per sample; torchvision ResNet-18 ({NUM_CLASSES} classes), SGD",
        **{"batch_size": args.batch_size, "steps": steps, "repeats": repeats, "models": {}},
    }
    print(f"data pipeline on {args.device}: {repeats} interleaved repeats of {steps} steps, batch {batch}")
    models = {"resnet18": 0.0}
    if args.device == "cpu":
        models[f"device stand-in ({args.standin_ms:g} ms)"] = args.standin_ms
    for model, standin_ms in models.items():
        print(f"{model}:", flush=True)
        results["models"][model] = measure(args.device, repeats, steps, args.batch_size, standin_ms)
    metric = "samples/s with the defaults over naive settings (median of per-repeat ratios)"
    speedups = {model: r["defaults"]["speedup_vs_naive"]["median"] for model, r in results["models"].items()}
    target = dict(metric=metric, threshold="> 1.0")
    results["targets"] = [dict(model=model, **target, value=x, met=x > 1.0) for model, x in speedups.items()]
    print()
    report(results)
    common.write_json(args.out, "data_pipeline.json", results, started)
    return results


if __name__ == "__main__":
    main()
