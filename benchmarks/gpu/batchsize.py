"""GPU section ``batchsize``: MemoryAwareBatchSize against real CUDA memory under a per-process fraction.

    bash benchmarks/gpu_check.sh batchsize OUT_DIR     # runs: python benchmarks/gpu/batchsize.py --out OUT_DIR

Written without a GPU at hand (the sessions that built it had none): it has not run yet. It fails
loudly without CUDA, so a skipped check cannot pass.

For a torchvision ResNet-50 (224x224, fp32, SGD momentum) and a small causal transformer LM (512
tokens, AdamW), trained from a ``GPUOptDataModule`` (so device prefetch is on, as on any CUDA run):

1. **Calibrate**: unlimited runs measure the steady-state peak (``max_memory_allocated`` over steps
   2-3) at two batch sizes; the limit sits 60 % of the way from the smaller to the larger.
2. **mode="max"** under that limit (``torch.cuda.set_per_process_memory_fraction``, which the probe
   honours; ``target_fraction=1.0``): the batch size found, the predicted peak, and the measured
   steady-state peak of the training steps that follow at that size.
3. **True maximum**: bisection over real runs at each batch size under the same limit (a run fits
   when 3 steps finish without a CUDA OOM), from the size found upward.
4. **mode="micro"** with a batch of twice the true maximum: the micro-batch found, its predicted
   peak, and the measured peak of the training steps (now split into k micro-batches).

Checks, per workload: predicted vs measured peak within 5 % (both modes); the size found within
90-100 % of the true maximum; every run after a search trains without OOM. Writes ``batchsize.json``
with every figure and a pass flag per check; exits 1 when a check fails or no CUDA device is present.
Meant to take 2-4 minutes on an H200.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import device
import lightning
import lightning.pytorch as pl
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from lightning_gpuopt import GPUOptDataModule, MemoryAwareBatchSize
from lightning_gpuopt.memory import is_oom_error

PEAK_TOLERANCE = 0.05
BAND = (0.9, 1.0)
STEPS = 3  # per run: the first creates the optimizer state, the others are steady
LIMIT_POSITION = 0.6
TRAINER = {
    "devices": 1,
    "precision": "32-true",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


# ----------------------------------------------------------------------------- models and data


class Classifier(pl.LightningModule):
    def __init__(self, build: Callable[[], nn.Module], optimizer: str) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = build()
        self.optimizer = optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-4)
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class CausalLM(nn.Module):
    def __init__(self, vocab: int = 16384, d_model: int = 512, layers: int = 8, seq: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=8, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.pos, mask=self.mask, is_causal=True))


def _images(n: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 224, 224, generator=g), torch.randint(0, 1000, (n,), generator=g))


def _tokens(n: int, vocab: int = 16384, seq: int = 512) -> Dataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    return TensorDataset(tokens, torch.roll(tokens, -1, dims=1))


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    optimizer: str
    data: Callable[[int], Dataset]
    samples: int
    #: Batch sizes of the calibration runs (the limit lies between their peaks).
    low: int
    high: int


WORKLOADS = {
    "resnet50": Workload(
        "resnet50",
        "torchvision resnet50 on 3x224x224, fp32, SGD momentum",
        lambda: torchvision.models.resnet50(),
        "sgd",
        _images,
        2048,
        low=32,
        high=128,
    ),
    "lm": Workload(
        "lm",
        "causal transformer LM: 8 layers, d_model 512, 512 tokens, vocab 16384, AdamW",
        CausalLM,
        "adamw",
        _tokens,
        2048,
        low=8,
        high=48,
    ),
}

#: The dry run's stand-in (CPU under SimulatedMemory): the same code paths, tiny sizes.
DRY_WORKLOADS = {
    "lm": Workload(
        "lm",
        "dry run: causal transformer LM 2 layers, d_model 32, 32 tokens, vocab 256, AdamW",
        lambda: CausalLM(vocab=256, d_model=32, layers=2, seq=32),
        "adamw",
        lambda n: _tokens(n, vocab=256, seq=32),
        512,
        low=4,
        high=24,
    ),
}
#: DataLoader workers per run (the dry run uses 0: each fit would start its own worker processes).
NUM_WORKERS = {"cuda": 2, "simulated": 0}


class Data(GPUOptDataModule):
    def __init__(self, dataset: Dataset, batch_size: int) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=NUM_WORKERS.get(device.current().kind, 0), drop_last=True
        )
        self.dataset = dataset

    def train_dataset(self) -> Dataset:
        return self.dataset


# ----------------------------------------------------------------------------- the device
# Every CUDA memory call of this script goes through these few functions.


def device_total() -> int:
    return device.current().total()


def set_limit(limit_bytes: int | None) -> None:
    """Confine this process to ``limit_bytes`` (``None``: the section's cap) and drop cached blocks."""
    device.current().set_limit(limit_bytes)


class SteadyPeak(pl.Callback):
    """The largest ``max_memory_allocated`` over the training steps after the first."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        device.current().reset_peak()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.peaks.append(device.current().peak())

    @property
    def steady(self) -> int:
        return max(self.peaks[1:])


def run(
    workload: Workload, dataset: Dataset, batch_size: int, callbacks: list, limit: int | None
) -> dict[str, Any]:
    """Train ``STEPS`` steps; returns the steady peak, or the OOM when it ran out of memory."""
    set_limit(limit)
    recorder = SteadyPeak()
    data = Data(dataset, batch_size)
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=[device.Deadline(), *callbacks, recorder],
        accelerator=device.current().accelerator,
        **TRAINER,
    )
    failed = None
    try:
        trainer.fit(Classifier(workload.build, workload.optimizer), datamodule=data)
    except Exception as err:
        if not is_oom_error(err):
            raise
        failed = str(err).splitlines()[0][:300]
    del trainer
    set_limit(None)
    ok = failed is None and len(recorder.peaks) == STEPS
    return {
        "batch_size": data.batch_size,
        "fits": ok,
        "steady_peak": recorder.steady if ok else None,
        "oom": failed,
    }


def check_workload(workload: Workload) -> dict[str, Any]:
    dataset = workload.data(workload.samples)
    low, high = (run(workload, dataset, n, [], None)["steady_peak"] for n in (workload.low, workload.high))
    limit = int(low + LIMIT_POSITION * (high - low))
    result: dict[str, Any] = {
        "description": workload.description,
        "limit_bytes": limit,
        "calibration": {workload.low: low, workload.high: high},
    }

    finder = MemoryAwareBatchSize(mode="max", target_fraction=1.0)
    started = time.perf_counter()
    found = run(workload, dataset, 8, [finder], limit)
    result["max_mode"] = {
        **found,
        "found": finder.micro_batch_size,
        "trials": finder.trials,
        "predicted_peak": finder.predicted_peak_bytes,
        "wall_s": time.perf_counter() - started,
        "trial_sizes": [m.size for m in finder.result.measurements],
    }

    fits, fails, runs = (finder.micro_batch_size if found["fits"] else 0), None, {}
    step = max(1, fits)
    while fails is None:  # double up from the answer until a run does not fit
        size = fits + step
        runs[size] = run(workload, dataset, size, [], limit)["fits"]
        fits, fails, step = (size, None, 2 * step) if runs[size] else (fits, size, step)
    while fails - fits > 1:
        mid = (fits + fails) // 2
        runs[mid] = run(workload, dataset, mid, [], limit)["fits"]
        fits, fails = (mid, fails) if runs[mid] else (fits, mid)
    result["true_max"] = fits
    result["bisection_runs"] = {str(k): v for k, v in sorted(runs.items())}

    micro = MemoryAwareBatchSize(target_fraction=1.0)
    micro_run = run(workload, dataset, 2 * fits, [micro], limit)
    result["micro_mode"] = {
        **micro_run,
        "found": micro.micro_batch_size,
        "k": micro.k,
        "trials": micro.trials,
        "predicted_peak": micro.predicted_peak_bytes,
    }

    checks = {}
    for mode in ("max_mode", "micro_mode"):
        r = result[mode]
        error = abs(r["predicted_peak"] - r["steady_peak"]) / r["steady_peak"] if r["fits"] else None
        r["peak_error"] = error
        checks[f"{mode}: trains without OOM after the search"] = r["fits"]
        checks[f"{mode}: predicted peak within {PEAK_TOLERANCE:.0%} of measured"] = (
            error is not None and error <= PEAK_TOLERANCE
        )
    fraction = finder.micro_batch_size / fits if fits else 0.0
    result["found_fraction"] = fraction
    checks["max_mode: found within 90-100 % of the true maximum"] = BAND[0] <= fraction <= BAND[1]
    checks["micro_mode: k > 1 (the batch had to be split)"] = micro.k > 1
    result["checks"] = checks
    result["passed"] = all(checks.values())
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for batchsize.json")
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu/batchsize.py: no CUDA device visible (torch.cuda.is_available() is False); "
            "this check needs a real GPU and cannot pass without one",
            file=sys.stderr,
        )
        return 1
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    properties = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "section": "batchsize",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "device": properties.name,
        "device_total_bytes": device_total(),
        "models": {},
    }
    started = time.perf_counter()
    for name in args.models:
        print(f"batchsize: {name} ...", flush=True)
        try:
            results["models"][name] = check_workload(WORKLOADS[name])
        except Exception as err:  # keep going: the other workload's figures are still worth having
            traceback.print_exc()
            results["models"][name] = {"passed": False, "error": f"{type(err).__name__}: {err}"}
        r = results["models"][name]
        if "checks" in r:
            for check, ok in r["checks"].items():
                print(f"  {'ok  ' if ok else 'FAIL'} {check}")
            print(
                f"  found {r['max_mode']['found']} of true max {r['true_max']} ({r['found_fraction']:.1%}); "
                f"peak error max mode {r['max_mode']['peak_error']}, micro mode {r['micro_mode']['peak_error']}"
            )
    results["passed"] = all(r["passed"] for r in results["models"].values())
    results["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "batchsize.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"batchsize: {'PASS' if results['passed'] else 'FAIL'} ({results['wall_s']:.0f} s); wrote {path}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
