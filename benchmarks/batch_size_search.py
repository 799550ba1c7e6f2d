"""MemoryAwareBatchSize(mode="max") against Lightning's BatchSizeFinder (power and binsearch) on CPU.

    python benchmarks/batch_size_search.py                  # 3 models x 3 limits, 15-40 minutes on 2 busy cores
    python benchmarks/batch_size_search.py --quick          # the middle limit of each model only
    python benchmarks/batch_size_search.py --out DIR --models transformer superlinear

Per model (a torchvision ResNet-18 on 8x8 images, a 2-layer transformer encoder on 16 tokens, and an MLP
whose middle layer attends over the whole batch: memory grows with the batch's square) and per limit of a
:class:`~lightning_gpuopt.testing.SimulatedMemory` device, each method looks for the largest ``batch_size``
that trains, from 8: ``ours`` is ``MemoryAwareBatchSize(mode="max", target_fraction=1.0)``, ``power`` and
``binsearch`` are ``BatchSizeFinder(mode=...)`` with Lightning's defaults. Reported: the size found as a
fraction of the true maximum, whether 8 real training steps at that size then run under the limit
(``survives``), the training steps the search ran, and the search's own wall time. The true maximum comes
from a bisection over the steady-state peak (second step) of unlimited fits. Limits sit 20 %, 50 % and
80 % of the way from the peak at a small batch to the peak at a large one (``--quick``: 50 %). Targets: ours
within 90-100 % of the true maximum (exit 1 when missed, or when its size fails to train), its search at
most a third of binsearch's time. Writes ``batch_size_search.json``.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import lightning.pytorch.tuner.batch_size_scaling as bss
import torch
import torchvision
from common import QUIET, Classifier, arguments, environment, print_table, quiet, write_json
from lightning.pytorch.callbacks import BatchSizeFinder
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from lightning_gpuopt import GPUOptDataModule, MemoryAwareBatchSize
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.testing import SimulatedMemory

SPEEDUP_TARGET = 3.0
BAND = (0.9, 1.0)
START_BATCH_SIZE = 8
TRAIN_STEPS = 8
# BatchSizeFinder saves and restores the model through a `.scale_batch_size_*.ckpt` in the root directory: a
# scratch folder, never the caller's working directory.
TRAINER = {
    **QUIET,
    "accelerator": "cpu",
    "precision": "32-true",
    "default_root_dir": tempfile.mkdtemp("-bss"),
}


class Counted(Classifier):
    """The shared classifier, counting its ``training_step`` calls (a finder's trial steps are counted from them)."""

    calls = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        Counted.calls += 1
        return super().training_step(batch, batch_idx)


class Encoder(nn.Module):
    def __init__(self, vocab: int = 128, d_model: int = 32, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos))


class BatchAttention(nn.Module):
    """An MLP whose middle layer attends over the batch, masked to the diagonal: (n, n, heads) memory."""

    def __init__(self, dim: int = 32, hidden: int = 128, heads: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.inp = nn.Linear(dim, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        n, d = h.shape
        q, k, v = self.qkv(h).view(n, 3, self.heads, d // self.heads).unbind(1)
        scores = torch.einsum("ihd,jhd->ijh", q, k) / math.sqrt(d // self.heads)
        mask = torch.full((n, n, 1), float("-inf"), dtype=scores.dtype)
        mask.diagonal(dim1=0, dim2=1).zero_()
        mixed = torch.einsum("ijh,jhd->ihd", torch.softmax(scores + mask, dim=1), v).reshape(n, d)
        return self.out(h + mixed)


def _images(n: int, g: torch.Generator) -> Dataset:
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def _tokens(n: int, g: torch.Generator) -> Dataset:
    tokens = torch.randint(0, 128, (n, 16), generator=g)
    return TensorDataset(tokens, torch.roll(tokens, 1, dims=1))


def _features(n: int, g: torch.Generator) -> Dataset:
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    optimizer: str
    data: Callable[[int, torch.Generator], Dataset]
    #: Batch sizes whose peaks bound the limits (the true maxima lie between them).
    low: int
    high: int


_RESNET = "torchvision resnet18(num_classes=10) on 3x8x8 images, SGD momentum"
WORKLOADS = [
    Workload(
        "resnet18", _RESNET, lambda: torchvision.models.resnet18(num_classes=10), "sgd", _images, 32, 512
    ),
    Workload(
        "transformer",
        "2-layer TransformerEncoder, d_model 32, 16 tokens, dropout 0.1, Adam",
        Encoder,
        "adam",
        _tokens,
        32,
        1024,
    ),
    Workload(
        "superlinear",
        "MLP with a batch-wide attention (n x n x 64 scores), SGD momentum",
        BatchAttention,
        "sgd",
        _features,
        32,
        512,
    ),
]


class Data(GPUOptDataModule):
    """Whole batches only, so every step of a run has ``batch_size`` samples."""

    def __init__(self, dataset: Dataset, batch_size: int) -> None:
        super().__init__(batch_size=batch_size, num_workers=0, drop_last=True)
        self.dataset = dataset

    def train_dataset(self) -> Dataset:
        return self.dataset


class StepPeaks(pl.Callback):
    """Peaks of the training steps of the fit itself, after the search; the search's training steps."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.trial_steps = 0
        self._started = False
        self._calls_at_start = Counted.calls

    @property
    def started(self) -> bool:
        return self._started

    @started.setter
    def started(self, value: bool) -> None:
        if value and not self._started:  # every training_step so far was a trial
            self.trial_steps = Counted.calls - self._calls_at_start
        self._started = value

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.started:
            get_probe().reset_peak()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.started:
            self.peaks.append(get_probe().peak)


class TimedFinder(BatchSizeFinder):
    """Lightning's finder, its search timed (``scale_batch_size``); the fit's own steps follow it."""

    def __init__(self, peaks: StepPeaks, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.peaks, self.search_s = peaks, 0.0

    def scale_batch_size(self, *args: Any) -> None:
        started = time.perf_counter()
        super().scale_batch_size(*args)
        self.search_s, self.peaks.started = time.perf_counter() - started, True


class TimedOurs(MemoryAwareBatchSize):
    """Ours, its search timed (the fit-start search); the fit's own steps follow it."""

    def __init__(self, peaks: StepPeaks, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.peaks, self.search_s = peaks, 0.0

    def on_fit_start(self, *args: Any) -> None:
        started = time.perf_counter()
        super().on_fit_start(*args)
        self.search_s, self.peaks.started = time.perf_counter() - started, True


def _fit(
    workload: Workload, dataset: Dataset, batch_size: int, steps: int, callbacks: list, limit: int | None
):
    pl.seed_everything(0, verbose=False)
    data = Data(dataset, batch_size)
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, **TRAINER)
    with SimulatedMemory(limit):
        trainer.fit(Counted(workload.build, workload.optimizer), datamodule=data)
    return data


class TruePeaks:
    """Steady-state peak of real training at each batch size (the second step of an unlimited fit), cached."""

    def __init__(self, workload: Workload, dataset: Dataset) -> None:
        self.workload, self.dataset = workload, dataset
        self.peaks: dict[int, int] = {}

    def __call__(self, batch_size: int) -> int:
        if batch_size not in self.peaks:
            recorder = StepPeaks()
            recorder.started = True
            _fit(self.workload, self.dataset, batch_size, 2, [recorder], None)
            self.peaks[batch_size] = recorder.peaks[-1]
        return self.peaks[batch_size]

    def largest_within(self, limit: int, low: int, high: int) -> int:
        """Bisection: the largest batch size whose steady peak is within ``limit`` (``low`` fits, ``high`` does not)."""
        if self(low) > limit or self(high) <= limit:
            raise RuntimeError(
                f"{self.workload.name}: the true maximum for {limit} B is not in [{low}, {high})"
            )
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self(mid) <= limit else (low, mid)
        return low


def _run(method: str, workload: Workload, dataset: Dataset, limit: int) -> dict[str, Any]:
    peaks = StepPeaks()
    ours = TimedOurs(peaks, mode="max", target_fraction=1.0, verbose=False) if method == "ours" else None
    finder = ours or TimedFinder(peaks, mode=method)
    trials: list[tuple[int, str]] = []
    original = bss._try_loop_run

    def counting(trainer: pl.Trainer, params: dict[str, Any]) -> None:
        size = trainer.datamodule.batch_size
        try:
            original(trainer, params)
        except RuntimeError:
            trials.append((size, "OOM"))
            raise
        trials.append((size, "ok"))

    bss._try_loop_run = counting
    started = time.perf_counter()
    try:
        data = _fit(workload, dataset, START_BATCH_SIZE, TRAIN_STEPS, [finder, peaks], limit)
        error = None
    except Exception as err:  # an OOM in the real steps after the search: the found size does not survive
        data, error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        bss._try_loop_run = original
    ours = method == "ours"
    result = {"found": finder.micro_batch_size if ours else finder.optimal_batch_size}
    result.update(trained_at=data.batch_size if data is not None else None, error=error)
    result["survives"] = error is None and len(peaks.peaks) == TRAIN_STEPS
    # BatchSizeFinder's trials run the fit loop without callbacks: training_step calls count them
    result["trial_steps"] = peaks.trial_steps
    sizes = [m.size for m in finder.result.measurements] if ours and finder.result else [s for s, _ in trials]
    result.update(trial_sizes=sizes, trial_ooms=sum(1 for _, status in trials if status == "OOM"))
    return {**result, "search_s": finder.search_s, "fit_s": time.perf_counter() - started}


def report(results: dict[str, Any]) -> None:
    rows = [
        ("model", "limit", "true max", "method", "found", "of max", "survives", "trial steps", "search s")
    ]
    for name, entry in results["models"].items():
        for case in entry["limits"]:
            for method, run in case["runs"].items():
                fraction = f"{run['fraction']:.1%}" if run["fraction"] is not None else "-"
                limit = f"{case['limit_bytes'] / 2**20:.1f} MiB"
                survives = "yes" if run["survives"] else "NO"
                cells = (name, limit, case["true_max"], method, run["found"], fraction, survives)
                rows.append((*cells, run["trial_steps"], f"{run['search_s']:.1f}"))
    print_table(rows)
    for t in results["targets"]:
        print(
            f"target: {t['metric']}: {t['value']} (threshold {t['threshold']}) -> {'met' if t['met'] else 'NOT met'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "batch_size_search.json", quick="the middle limit of each model only")
    names = [w.name for w in WORKLOADS]
    parser.add_argument("--models", nargs="+", choices=names, default=names)
    args = parser.parse_args(argv)
    fractions = (0.5,) if args.quick else (0.2, 0.5, 0.8)
    quiet(logging.ERROR, every_warning=True)
    started = time.perf_counter()
    setup = {
        "quick": args.quick,
        "start_batch_size": START_BATCH_SIZE,
        "train_steps_after_search": TRAIN_STEPS,
    }
    results: dict[str, Any] = {"benchmark": "batch_size_search", **environment(**setup), "models": {}}
    for workload in (w for w in WORKLOADS if w.name in args.models):
        dataset = workload.data(
            4096, torch.Generator().manual_seed(0)
        )  # before any SimulatedMemory: host data
        truth = TruePeaks(workload, dataset)
        low, high = truth(workload.low), truth(workload.high)
        entry: dict[str, Any] = {"description": workload.description, "limits": []}
        for fraction in fractions:
            limit = int(low + fraction * (high - low))
            true_max = truth.largest_within(limit, workload.low, workload.high)
            print(f"{workload.name}: limit {limit / 2**20:.1f} MiB, true maximum {true_max} ...", flush=True)
            runs = {}
            for method in ("ours", "power", "binsearch"):
                run = runs[method] = _run(method, workload, dataset, limit)
                run["fraction"] = run["found"] / true_max if run["found"] else None
                found = f"found {run['found']} ({run['fraction'] or 0:.1%}), {run['trial_steps']} trial steps"
                print(f"  {method}: {found}, {run['search_s']:.1f} s, survives {run['survives']}", flush=True)
            case = {"fraction": fraction, "limit_bytes": limit, "true_max": true_max, "runs": runs}
            entry["limits"].append(case)
        entry["true_peaks"] = {str(k): v for k, v in sorted(truth.peaks.items())}
        results["models"][workload.name] = entry

    cases = [case["runs"] for e in results["models"].values() for case in e["limits"]]
    ours = [runs["ours"] for runs in cases]
    speedup = statistics.median(runs["binsearch"]["search_s"] / runs["ours"]["search_s"] for runs in cases)
    in_band = all(r["fraction"] is not None and BAND[0] <= r["fraction"] <= BAND[1] for r in ours)
    survive = all(r["survives"] for r in ours)
    targets = [
        (
            "ours: found / true maximum, every case",
            "90-100 %",
            [round(r["fraction"] or 0, 3) for r in ours],
            in_band,
        ),
        ("ours: trains 8 steps at the size found, every case", "yes", survive, survive),
        (
            "binsearch search time / ours, median over cases",
            f">= {SPEEDUP_TARGET}",
            round(speedup, 2),
            speedup >= SPEEDUP_TARGET,
        ),
    ]
    results["targets"] = [dict(zip(("metric", "threshold", "value", "met"), target)) for target in targets]
    print()
    report(results)
    write_json(args.out, "batch_size_search.json", results, started)
    return 0 if in_band and survive else 1


if __name__ == "__main__":
    sys.exit(main())
