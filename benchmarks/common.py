"""What the benchmarks share: the quiet Trainer, a timed call, patched settings, the classifier module, random
batches, whole-batch datasets, a DataModule over a ready dataset, step clocks and peaks, statistics, the table
printer, the common command-line options and the JSON result.

``benchmarks/`` is the import root of the benchmark code: a script run as ``python benchmarks/X.py`` has it
first on ``sys.path``, and ``gpu_check.sh`` puts it on ``PYTHONPATH`` (with the repository root, for the
package) before ``python -m gpu.check``. So every benchmark imports this module as ``common`` and the GPU
check's modules as ``gpu.*``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import logging
import os
import platform
import resource
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from lightning_gpuopt import GPUOptDataModule
from lightning_gpuopt.memory import get_probe

#: A Trainer that prints nothing and writes nothing; callers add the accelerator, precision, steps, callbacks.
QUIET = dict(devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
QUIET.update(enable_model_summary=False, num_sanity_val_steps=0)


def trainer(steps: int, callbacks: list, accelerator: str = "cpu", **kwargs: Any) -> pl.Trainer:
    """A :data:`QUIET` Trainer of ``steps`` steps (``kwargs`` over the quiet settings)."""
    return pl.Trainer(max_steps=steps, accelerator=accelerator, callbacks=callbacks, **{**QUIET, **kwargs})


def clocked(work: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, float, Any]:
    """Wall and CPU seconds of ``work(*args, **kwargs)`` (this process's and its finished children's), its result."""
    cpu = lambda: time.process_time() + sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])  # noqa: E731
    used, wall = cpu(), time.perf_counter()
    result = work(*args, **kwargs)
    return time.perf_counter() - wall, cpu() - used, result


@contextlib.contextmanager
def patched(*settings: tuple[Any, str, Any]) -> Iterator[None]:
    """Each ``(object, name, value)`` set inside, the old values restored after (backend flags, a timed method)."""
    saved = [getattr(obj, name) for obj, name, _ in settings]
    for obj, name, value in settings:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for (obj, name, _), value in zip(settings, saved):
            setattr(obj, name, value)


_IGNORED = (
    ".*does not have many workers.*",
    ".*TF32.*",  # torch >= 2.9 prefers fp32_precision; the flags still work
    r".*isinstance\(treespec, LeafSpec\).*",
    # SimulatedMemory's global module hooks (the CPU stand-in for the device) make torch.compile say so.
    r".*torch.compile\(module\)` when there are global hooks.*",
)


def quiet(level: int = logging.WARNING, every_warning: bool = False) -> None:
    """Lightning's and the pack's chatter off: a benchmark prints its own lines."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gpuopt"):
        logging.getLogger(name).setLevel(level)
    if every_warning:
        warnings.filterwarnings("ignore")
    for message in _IGNORED:
        warnings.filterwarnings("ignore", message=message)
    os.environ.setdefault("LIGHTNING_DISABLE_TIPS", "1")


class Classifier(pl.LightningModule):
    """Cross-entropy over the last dimension of ``net(x)`` (uint8 images are scaled to [0, 1] first).

    The network is built under a fixed seed; the optimizer is SGD with momentum 0.9, Adam or AdamW.
    """

    LR = {"sgd": 0.01, "adam": 1e-3, "adamw": 1e-4}

    def __init__(
        self, build: Callable[[], nn.Module], optimizer: str = "sgd", lr: float | None = None
    ) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = build()
        self.optimizer, self.lr = optimizer, lr or self.LR[optimizer]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.net(x.float().div_(255) if x.dtype == torch.uint8 else x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        make = torch.optim.Adam if self.optimizer == "adam" else torch.optim.AdamW
        return make(self.parameters(), lr=self.lr)


def mlp(*widths: int) -> nn.Module:
    """Linear layers through ``widths`` with a ReLU between each two."""
    layers = [m for a, b in itertools.pairwise(widths[:-1]) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]))


def labelled(n: int, *shape: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """``n`` standard-normal inputs of ``shape`` and their labels of 10 classes (drawn in that order)."""
    return torch.randn(n, *shape, generator=generator), torch.randint(0, 10, (n,), generator=generator)


class Batches(Dataset):
    """``length`` whole batches (load with ``batch_size=None``), cycling over ready-made ``batches``.

    ``copy``: each batch is a fresh copy, so that its memory dies after its step as a collated batch's
    would (SimulatedMemory counts a tensor until its storage dies; the originals live with the dataset).
    """

    def __init__(
        self, batches: list[tuple[Tensor, ...]], length: int | None = None, copy: bool = False
    ) -> None:
        self.batches, self.length, self.copy = batches, length or len(batches), copy

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:
        batch = self.batches[i % len(self.batches)]
        return tuple(t.clone() for t in batch) if self.copy else batch


class Data(GPUOptDataModule):
    """A GPUOptDataModule over a ready-made ``dataset``; ``kwargs``: its loader settings (batch size, workers...)."""

    def __init__(self, dataset: Dataset, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataset = dataset

    def train_dataset(self) -> Dataset:
        return self.dataset


class StepClock(pl.Callback):
    """Per training batch: wall clock and this process's CPU time at its start and at its end.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each reading, so that a reading on a GPU
    covers the work queued before it.
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.starts: list[tuple[float, float]] = []
        self.ends: list[tuple[float, float]] = []

    def now(self) -> tuple[float, float]:
        if self.sync is not None:
            self.sync()
        return time.perf_counter(), time.process_time()

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(self.now())

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(self.now())

    def periods(self, clock: int = 0) -> list[float]:
        """From one batch's end to the next's (everything the loop runs per batch); ``clock`` 1: CPU time."""
        return [b[clock] - a[clock] for a, b in zip(self.ends, self.ends[1:])]

    def durations(self, clock: int = 0) -> list[float]:
        """From each batch's start to its end; ``clock`` 1: CPU time."""
        return [b[clock] - a[clock] for a, b in zip(self.starts, self.ends)]


class StepPeaks(pl.Callback):
    """The peak allocated memory of each training step, from the memory probe (the entered SimulatedMemory's,
    else CUDA's); nothing while ``recording`` is False."""

    def __init__(self, recording: bool = True) -> None:
        self.peaks: list[int] = []
        self.recording = recording

    def on_train_batch_start(self, *args: Any) -> None:
        if self.recording:
            get_probe().reset_peak()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.recording:
            self.peaks.append(get_probe().peak)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, quartiles, max, count) of some figures."""
    ordered = sorted(values)
    q1, q3 = statistics.quantiles(ordered, n=4, method="inclusive")[::2] if len(ordered) > 1 else ordered * 2
    median = statistics.median(ordered)
    return {"median": median, "min": ordered[0], "q1": q1, "q3": q3, "max": ordered[-1], "n": len(ordered)}


def figure(name: str, value: Any, unit: str = "", target: str | None = None, met: bool | None = None) -> dict:
    """One row of a check's table: a figure, its unit, its target (if any) and whether it was met."""
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met}


def print_table(rows: Sequence[Sequence[Any]]) -> None:
    """Columns padded to their widest cell, a rule under the first (header) row."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def markdown_row(*cells: Any) -> None:
    """One row of a markdown table, printed at once (rows of a long run appear as they are measured)."""
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def markdown_header(header: str) -> None:
    """A markdown table's header (``"a|b|c"``) and its rule."""
    markdown_row(*header.split("|"))
    print("|---" * (header.count("|") + 1) + "|")


def positive_int(text: str) -> int:
    """An argparse type: a positive int."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """Resolves ``--device auto`` (CUDA when available) and refuses ``--device cuda`` where there is none."""

    def parse_args(self, *args: Any) -> argparse.Namespace:  # type: ignore[override]
        parsed = super().parse_args(*args)
        if getattr(parsed, "device", None) == "auto":
            parsed.device = "cuda" if torch.cuda.is_available() else "cpu"
        if getattr(parsed, "device", None) == "cuda" and not torch.cuda.is_available():
            self.error("--device cuda: no CUDA device visible (torch.cuda.is_available() is False); use cpu")
        return parsed


def arguments(
    doc: str, result: str, out: str = "benchmarks/results", quick: str | None = None, **options: Any
) -> argparse.ArgumentParser:
    """A parser with the module's docstring as its help, ``--out`` (the folder for ``result``) and ``--quick``;
    ``repeats=(7, 2)`` adds ``--repeats`` (its default, and with ``--quick``), ``device="cpu"`` (or ``"auto"``)
    adds ``--device``, ``threads=1`` adds ``--threads`` (torch's intra-op threads, set by the script)."""
    parser = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(out), help=f"directory for {result} (default {out})")
    if quick:
        parser.add_argument("--quick", action="store_true", help=quick)
    if "repeats" in options:
        repeats = "interleaved repeats (default {}; --quick: {})".format(*options["repeats"])
        parser.add_argument("--repeats", type=positive_int, help=repeats)
    if "device" in options:
        device = options["device"]
        where = f"where to run (default {device}; auto: CUDA when available)"
        parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=device, help=where)
    if "threads" in options:
        threads = options["threads"]
        help_ = f"torch intra-op threads (default {threads}: threads on shared cores wait for each other)"
        parser.add_argument("--threads", type=positive_int, default=threads, help=help_)
    return parser


def environment(**extra: Any) -> dict[str, Any]:
    """Date and versions for a result's JSON."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = dict(date=date, torch=torch.__version__, lightning=lightning.__version__)
    result.update(python=platform.python_version(), platform=platform.platform(), cpu_count=os.cpu_count())
    return {**result, "torch_threads": torch.get_num_threads(), **extra}


def write_json(out: Path | str, name: str, result: Any, started: float | None = None) -> Path:
    """Write ``result`` to ``out/name`` and say so (with the seconds since ``started``)."""
    if started is not None and isinstance(result, dict):
        result.setdefault("wall_s", time.perf_counter() - started)
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {path}" + (f" ({time.perf_counter() - started:.0f} s)" if started is not None else ""))
    return path
