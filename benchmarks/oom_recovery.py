"""OOMRecovery on CPU: what it costs when healthy, with forced micro-batches, and when it recovers.

    python benchmarks/oom_recovery.py                       # full run, 2-4 minutes on 2 cores (more when they are busy)
    python benchmarks/oom_recovery.py --quick               # smoke run for CI, under a minute
    python benchmarks/oom_recovery.py --out DIR --repeats 11

Measured per model (a SqueezeNet 1.1 on 32x32 images, a 4-layer MLP, and a tiny MLP whose steps are
so short that the callback's fixed cost per step shows):

1. **Overhead**: steady-state step time with ``OOMRecovery()`` installed (k=1, no OOM, no limit)
   over plain Lightning (no callback). Target: median ratio <= 1.02 (silent when healthy; docs/benchmarks.md).
2. **Forced k=2** (no OOM) over plain Lightning, for information: the price of micro-batching itself.
3. **DDP overhead** (``--no-ddp`` skips it): two CPU processes over gloo (``ddp_spawn``), the MLP,
   plain DDP vs DDP with ``OOMRecovery()`` (k=1, no OOM): the pack runs every backward under
   ``no_sync``, votes once per batch and averages gradients itself at the optimizer step, where plain
   DDP overlaps its all-reduce with the backward. Rank 0's step times, interleaved repeats. Target:
   median ratio <= 1.05.
4. **Recovery** under :class:`~lightning_gpuopt.testing.SimulatedMemory`: after a few unlimited
   warm-up steps the limit drops below the full batch's peak, so the next step runs out of memory and
   is retried with more micro-batches. Reported: that step's time over a steady k=1 step's and over a
   step at the final k, the failed attempts (``len(cb.failures)``) and the final k.

Step time is the wall-clock period between consecutive ``on_train_batch_end`` calls, so it covers
everything the loop runs per batch (data fetch, every hook, forward, backward, optimizer step). The
variants of (1) and (2) run interleaved (plain, k=1, k=2, then the reverse order, ...) after one
untimed fit, so drift on a shared machine hits them alike. Each fit yields the median (and the
minimum) of its steady steps, each repeat a ratio per variant, and the report gives the median ratio
over repeats with its spread (min-max and interquartile range).

The memory limit of (3) is calibrated, not guessed: two unlimited runs measure the steady-state peak
at k=1 and at k=8, and the limit sits halfway between, so the full batch must fail and a split into
at most 8 micro-batches fits, the optimizer step included. Where splitting does not lower the peak
(memory dominated by parameters, gradients and optimizer state, as for the MLP at batch 256), no
such limit exists: the MLP's recovery run uses a larger batch (``--mlp-recovery-batch-size``), and
the calibration at batch 256 is recorded to show why.

Writes ``oom_recovery.json`` to ``--out``. Exits 1 if a recovery run fails; the timing target is
reported (``met``), not enforced, as CPU timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.oom_policy import OOMFailure
from lightning_gpuopt.testing import SimulatedMemory

OVERHEAD_TARGET = 1.02
DDP_OVERHEAD_TARGET = 1.05
CALIBRATION_K = 8
VARIANTS = ("plain", "k=1", "k=2")
FORCED_K = {"plain": None, "k=1": 1, "k=2": 2}

TRAINER_QUIET = {
    "accelerator": "cpu",
    "devices": 1,
    "precision": "32-true",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}

MakeBatch = Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- workloads


class Classifier(pl.LightningModule):
    """Cross-entropy classification with SGD + momentum; the network is built under a fixed seed."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = build()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Batches(Dataset):
    """``count`` ready-made batches, yielded whole (``batch_size=None``) as fresh copies.

    Copies, so that a batch's memory dies after its step as a collated batch's would: SimulatedMemory
    counts a yielded tensor until its storage dies, and the originals live as long as the dataset.
    """

    def __init__(self, make: MakeBatch, batch_size: int, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.batches = [make(batch_size, generator) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in self.batches[i])


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: MakeBatch
    batch_size: int
    #: Batch size of the recovery run (activations must dominate memory for a split to help);
    #: ``None``: overhead only.
    recovery_batch_size: int | None
    #: Timed steps relative to the other workloads (short steps need more of them).
    steps_factor: int = 1
    #: Whether the overhead target applies (False: reported for information).
    targeted: bool = True

    def loader(self, batch_size: int, count: int) -> DataLoader:
        return DataLoader(Batches(self.make_batch, batch_size, count), batch_size=None, shuffle=False)


def _images(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _features(width: int) -> MakeBatch:
    def make(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)

    return make


def _squeezenet() -> nn.Module:
    return torchvision.models.squeezenet1_1(num_classes=10)


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(512, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def workloads(mlp_recovery_batch_size: int) -> list[Workload]:
    return [
        Workload(
            "squeezenet",
            "torchvision squeezenet1_1(num_classes=10) on 3x32x32",
            _squeezenet,
            _images,
            batch_size=32,
            recovery_batch_size=32,
        ),
        Workload(
            "mlp",
            "MLP 512-1024-1024-1024-10, ReLU",
            _mlp,
            _features(512),
            batch_size=256,
            recovery_batch_size=mlp_recovery_batch_size,
        ),
        Workload(
            "tiny",
            "MLP 32-64-10 (steps of ~1 ms: the callback's fixed cost per step)",
            _tiny,
            _features(32),
            batch_size=32,
            recovery_batch_size=None,
            steps_factor=4,
            targeted=False,
        ),
    ]


# ----------------------------------------------------------------------------- instruments


class StepTimer(pl.Callback):
    """Period of every batch, from the previous ``on_train_batch_end`` to this one: wall clock and CPU time.

    The process's CPU time (all its threads) is less sensitive than wall time to other work on the
    machine taking the cores, though not immune (waiting threads spin).
    """

    def __init__(self) -> None:
        self.periods: list[float] = []  # periods[i] belongs to batch i + 1
        self.cpu_periods: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_train_batch_end(self, *args: Any) -> None:
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.periods.append(now[0] - self._last[0])
            self.cpu_periods.append(now[1] - self._last[1])
        self._last = now

    def step(self, batch_idx: int) -> float:
        """Seconds of the step of ``batch_idx`` (>= 1)."""
        return self.periods[batch_idx - 1]


class StepPeaks(pl.Callback):
    """Per batch, under SimulatedMemory: bytes allocated at its start and the peak of its whole step."""

    def __init__(self, memory: SimulatedMemory) -> None:
        self.memory = memory
        self.starts: list[int] = []
        self.peaks: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(self.memory.allocated_bytes)
        self.memory.reset_peak()

    def on_train_batch_end(self, *args: Any) -> None:
        self.peaks.append(self.memory.peak_bytes)


class LimitAt(pl.Callback):
    """Sets the simulated device's limit at the start of one batch, after the unlimited warm-up."""

    def __init__(self, memory: SimulatedMemory, batch_idx: int, limit_bytes: int) -> None:
        self.memory, self.batch_idx, self.limit_bytes = memory, batch_idx, limit_bytes

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch_idx:
            self.memory.limit_bytes = self.limit_bytes


def _recovery(k: int | None) -> list[pl.Callback]:
    """``[]`` for plain Lightning, else ``[OOMRecovery()]`` with k forced (no OOM needed) when k > 1."""
    if k is None:
        return []
    callback = OOMRecovery()
    if k > 1:
        callback.load_state_dict({"k": k})
    return [callback]


def fit(
    workload: Workload,
    callbacks: list[pl.Callback],
    loader: DataLoader,
    memory: SimulatedMemory | None = None,
) -> pl.Trainer:
    """One seeded fit of ``len(loader)`` steps, inside ``memory`` when given.

    The loader is built before entering ``memory``: a dataset lives in host memory, and SimulatedMemory
    should count the batches it yields, not the whole dataset.
    """
    pl.seed_everything(0, verbose=False)
    gc.collect()
    trainer = pl.Trainer(max_steps=len(loader), callbacks=callbacks, **TRAINER_QUIET)
    model = Classifier(workload.build)
    if memory is None:
        trainer.fit(model, loader)
    else:
        with memory:
            trainer.fit(model, loader)
    return trainer


# ----------------------------------------------------------------------------- statistics


def summary(values: list[float]) -> dict[str, float]:
    """Median and spread (min, quartiles, max) of some figures."""
    ordered = sorted(values)
    q1, q3 = (
        statistics.quantiles(ordered, n=4, method="inclusive")[::2]
        if len(ordered) > 1
        else (ordered[0], ordered[0])
    )
    return {"median": statistics.median(ordered), "min": ordered[0], "q1": q1, "q3": q3, "max": ordered[-1]}


def _ratios(per_fit: dict[str, list[float]]) -> dict[str, list[float]]:
    return {v: [a / b for a, b in zip(per_fit[v], per_fit["plain"])] for v in VARIANTS if v != "plain"}


# ----------------------------------------------------------------------------- measurements


def measure_overhead(workload: Workload, repeats: int, warmup: int, steps: int) -> dict[str, Any]:
    """Interleaved fits of plain / k=1 / k=2; per fit, the median and minimum of its steady steps."""
    steps *= workload.steps_factor
    loader = workload.loader(workload.batch_size, warmup + steps)
    fit(workload, [], loader)  # untimed: first-use costs of the process (kernels, allocator, imports)
    median_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    min_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for repeat in range(repeats):
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            timer, recovery = StepTimer(), _recovery(FORCED_K[variant])
            fit(workload, [timer, *recovery], loader)
            if recovery and recovery[0].failures:
                raise RuntimeError(f"{workload.name} {variant}: out of memory without a limit")
            steady = timer.periods[warmup - 1 :]  # from batch `warmup` on
            median_ms[variant].append(1e3 * statistics.median(steady))
            min_ms[variant].append(1e3 * min(steady))
            cpu_ms[variant].append(1e3 * statistics.median(timer.cpu_periods[warmup - 1 :]))
    ratios, min_ratios, cpu_ratios = _ratios(median_ms), _ratios(min_ms), _ratios(cpu_ms)
    overhead_ms = [a - b for a, b in zip(median_ms["k=1"], median_ms["plain"])]
    k1 = summary(ratios["k=1"])
    return {
        "batch_size": workload.batch_size,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "step_ms_median_per_fit": median_ms,
        "step_ms_min_per_fit": min_ms,
        "step_ms": {v: statistics.median(median_ms[v]) for v in VARIANTS},
        "ratio_k1": ratios["k=1"],
        "ratio_k1_summary": k1,
        "ratio_k2": ratios["k=2"],
        "ratio_k2_summary": summary(ratios["k=2"]),
        "ratio_k1_of_min_steps": min_ratios["k=1"],
        "ratio_k1_of_min_steps_summary": summary(min_ratios["k=1"]),
        "cpu_ms_median_per_fit": cpu_ms,
        "ratio_k1_cpu_time": cpu_ratios["k=1"],
        "ratio_k1_cpu_time_summary": summary(cpu_ratios["k=1"]),
        "overhead_k1_ms": overhead_ms,
        "overhead_k1_ms_summary": summary(overhead_ms),
        "target": {
            "metric": "median over repeats of step-time ratio OOMRecovery() k=1 / plain",
            "threshold": OVERHEAD_TARGET,
            "value": k1["median"],
            "met": k1["median"] <= OVERHEAD_TARGET,
        },
    }


class RankZeroTimes(StepTimer):
    """A StepTimer that, in a spawned DDP process, writes rank 0's periods to ``path`` (the parent reads them)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps({"periods": self.periods, "cpu_periods": self.cpu_periods}))


def measure_ddp_overhead(
    workload: Workload, repeats: int, warmup: int, steps: int, folder: Path
) -> dict[str, Any]:
    """Interleaved 2-process DDP fits (gloo, spawn): plain vs OOMRecovery() at k=1; rank 0's steady step times."""
    from lightning.pytorch.strategies import DDPStrategy

    loader = workload.loader(workload.batch_size, 2 * (warmup + steps))  # each rank gets half
    variants = ("plain", "k=1")
    median_ms: dict[str, list[float]] = {v: [] for v in variants}
    folder.mkdir(parents=True, exist_ok=True)
    for repeat in range(repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            path = folder / f"ddp_{repeat}_{variant}.json"
            pl.seed_everything(0, verbose=False)
            trainer = pl.Trainer(
                max_steps=warmup + steps,
                callbacks=[RankZeroTimes(str(path)), *_recovery(FORCED_K[variant])],
                **{**TRAINER_QUIET, "devices": 2, "strategy": DDPStrategy(start_method="spawn")},
            )
            trainer.fit(Classifier(workload.build), loader)
            periods = json.loads(path.read_text())["periods"]
            median_ms[variant].append(1e3 * statistics.median(periods[warmup - 1 :]))
    ratios = [a / b for a, b in zip(median_ms["k=1"], median_ms["plain"])]
    s = summary(ratios)
    return {
        "workload": workload.name,
        "processes": 2,
        "backend": "gloo",
        "batch_size_per_rank": workload.batch_size,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "step_ms_median_per_fit": median_ms,
        "step_ms": {v: statistics.median(median_ms[v]) for v in variants},
        "ratio_k1": ratios,
        "ratio_k1_summary": s,
        "target": {
            "metric": "median over repeats of rank 0's step-time ratio DDP+OOMRecovery() k=1 / plain DDP",
            "threshold": DDP_OVERHEAD_TARGET,
            "value": s["median"],
            "met": s["median"] <= DDP_OVERHEAD_TARGET,
        },
    }


def _steady_peak(workload: Workload, k: int, batch_size: int, steps: int) -> tuple[int, int]:
    """(peak of the whole step, bytes at its start) of the last step of an unlimited run at k."""
    memory = SimulatedMemory()
    peaks = StepPeaks(memory)
    fit(workload, [peaks, *_recovery(k)], workload.loader(batch_size, steps), memory)
    return peaks.peaks[-1], peaks.starts[-1]


def calibrate(workload: Workload, batch_size: int, steps: int = 3) -> dict[str, Any]:
    """The recovery run's limit: halfway between the steady peaks at k=1 and at k=8, if they differ."""
    peak_1, start = _steady_peak(workload, 1, batch_size, steps)
    peak_k, _ = _steady_peak(workload, CALIBRATION_K, batch_size, steps)
    # Room either side: the full batch must fail, a split into <= 8 micro-batches must fit.
    limit = (peak_1 + peak_k) // 2 if peak_k < 0.97 * peak_1 else None
    return {
        "batch_size": batch_size,
        "step_start_bytes": start,
        "peak_k1_bytes": peak_1,
        f"peak_k{CALIBRATION_K}_bytes": peak_k,
        "limit_bytes": limit,
        "limit_fraction_of_peak": limit / peak_1 if limit else None,
    }


def measure_recovery(workload: Workload, warmup: int, steps_after: int) -> dict[str, Any]:
    """Warm up unlimited at k=1, then drop the limit: the next step runs out of memory and recovers."""
    batch_size = workload.recovery_batch_size
    result: dict[str, Any] = {"batch_size": batch_size, "calibration": calibrate(workload, batch_size)}
    if batch_size != workload.batch_size:
        result["calibration_at_overhead_batch_size"] = calibrate(workload, workload.batch_size)
    limit = result["calibration"]["limit_bytes"]
    if limit is None:
        cal = result["calibration"]
        result.update(
            status="not possible",
            recovered=False,
            reason=(
                f"splitting does not lower the step's peak (k=1: {cal['peak_k1_bytes'] / 2**20:.1f} MiB, "
                f"k={CALIBRATION_K}: {cal[f'peak_k{CALIBRATION_K}_bytes'] / 2**20:.1f} MiB)"
            ),
        )
        return result

    limit_at = warmup + 1  # batches 0..warmup run unlimited; from batch 2 on they are steady steps
    total_steps = limit_at + 1 + steps_after
    memory, timer = SimulatedMemory(), StepTimer()
    peaks, recovery = StepPeaks(memory), OOMRecovery()
    try:
        trainer = fit(
            workload,
            [timer, peaks, LimitAt(memory, limit_at, limit), recovery],
            workload.loader(batch_size, total_steps),
            memory,
        )
    except Exception as err:  # a failed recovery is a result: report it with what was measured
        result.update(
            status="failed",
            recovered=False,
            limit_bytes=limit,
            error=f"{type(err).__name__}: {err}",
            failures=[_failure(f) for f in recovery.failures],
        )
        return result
    gc_started = time.perf_counter()
    gc.collect()  # what free_memory() pays per failed attempt on CPU, on a heap like the run's
    gc_ms = 1e3 * (time.perf_counter() - gc_started)

    failures = [_failure(f) for f in recovery.failures]
    steady = [timer.step(i) for i in range(2, limit_at)]
    after = [timer.step(i) for i in range(limit_at + 2, total_steps)]  # from the second step at the final k
    recovering = timer.step(limit_at)
    recovered = trainer.global_step == total_steps and bool(failures)
    result.update(
        status="recovered" if recovered else "failed",
        recovered=recovered,
        limit_bytes=limit,
        limit_at_batch=limit_at,
        failures=failures,
        retries=len(failures),
        oom_batches=sorted({f["batch_idx"] for f in failures}),
        final_k=recovery.k,
        final_micro_batch_size=-(-batch_size // recovery.k),
        peak_after_limit_bytes=max(peaks.peaks[limit_at:]),
        step_start_bytes_before_oom=peaks.starts[limit_at],
        step_start_bytes_later=peaks.starts[-1],
        steady_step_ms=[1e3 * t for t in steady],
        after_step_ms=[1e3 * t for t in after],
        recovering_step_ms=1e3 * recovering,
        ratio_vs_steady_k1=recovering / statistics.median(steady),
        ratio_vs_final_k_step=recovering / statistics.median(after),
        gc_collect_ms=gc_ms,
    )
    return result


def _failure(failure: OOMFailure) -> dict[str, Any]:
    return dataclasses.asdict(failure)


# ----------------------------------------------------------------------------- report


def _spread(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}; IQR {s['q1']:.3f}-{s['q3']:.3f}]"


def print_table(results: dict[str, Any]) -> None:
    rows = [
        (
            "model",
            "batch",
            "plain ms",
            "k=1 ms",
            "k=1/plain median [min-max; IQR]",
            "target",
            "of min steps",
            "of CPU time",
            "k=1 extra ms",
            "k=2/plain",
        )
    ]
    for name, r in results["models"].items():
        o = r["overhead"]
        met = ("met" if o["target"]["met"] else "NOT met") if r["targeted"] else "(info)"
        rows.append(
            (
                name,
                str(o["batch_size"]),
                f"{o['step_ms']['plain']:.2f}",
                f"{o['step_ms']['k=1']:.2f}",
                _spread(o["ratio_k1_summary"]),
                f"<= {OVERHEAD_TARGET} {met}",
                f"{o['ratio_k1_of_min_steps_summary']['median']:.3f}",
                f"{o['ratio_k1_cpu_time_summary']['median']:.3f}",
                f"{o['overhead_k1_ms_summary']['median']:+.3f}",
                f"{o['ratio_k2_summary']['median']:.3f}",
            )
        )
    _print_rows(rows)
    print(
        "k=1/plain: median over repeats of the ratio of per-fit median step times; 'of min steps': of per-fit "
        "fastest steps; 'of CPU time': of per-fit median process CPU time per step (all medians over repeats)"
    )
    print()
    if results.get("ddp"):
        rows = [
            (
                "DDP (2 processes, gloo)",
                "batch per rank",
                "plain DDP ms",
                "DDP + OOMRecovery ms",
                "ratio median [min-max; IQR]",
                "target",
            )
        ]
        for d in results["ddp"].values():
            met = "met" if d["target"]["met"] else "NOT met"
            rows.append(
                (
                    d["workload"],
                    str(d["batch_size_per_rank"]),
                    f"{d['step_ms']['plain']:.2f}",
                    f"{d['step_ms']['k=1']:.2f}",
                    _spread(d["ratio_k1_summary"]),
                    f"<= {DDP_OVERHEAD_TARGET} {met}",
                )
            )
        _print_rows(rows)
        print()
    rows = [
        (
            "model",
            "batch",
            "limit (of k=1 peak)",
            "status",
            "retries",
            "final k",
            "steady ms",
            "recovering ms",
            "ratio",
            "final-k step ms",
            "ratio to it",
            "gc.collect ms",
        )
    ]
    notes = []
    for name, r in results["models"].items():
        c = r.get("recovery")
        if c is None:
            continue
        if c["status"] != "recovered":
            rows.append((name, str(c["batch_size"]), "-", c["status"], *["-"] * 8))
            notes.append(f"{name}: recovery {c['status']}: {c.get('reason') or c.get('error')}")
            continue
        fraction = c["calibration"]["limit_fraction_of_peak"]
        after = statistics.median(c["after_step_ms"])
        rows.append(
            (
                name,
                str(c["batch_size"]),
                f"{c['limit_bytes'] / 2**20:.1f} MiB ({fraction:.0%})",
                c["status"],
                str(c["retries"]),
                str(c["final_k"]),
                f"{statistics.median(c['steady_step_ms']):.1f}",
                f"{c['recovering_step_ms']:.1f}",
                f"{c['ratio_vs_steady_k1']:.1f}",
                f"{after:.1f}",
                f"{c['ratio_vs_final_k_step']:.1f}",
                f"{c['gc_collect_ms']:.0f}",
            )
        )
        other = c.get("calibration_at_overhead_batch_size")
        if other is not None:
            peak_1, peak_k = other["peak_k1_bytes"] / 2**20, other[f"peak_k{CALIBRATION_K}_bytes"] / 2**20
            notes.append(
                f"{name}: at batch {other['batch_size']} the step peaks at {peak_1:.1f} MiB with k=1 and "
                f"{peak_k:.1f} MiB with k={CALIBRATION_K}: "
                + ("splitting lowers it" if other["limit_bytes"] else "splitting cannot recover an OOM there")
            )
    _print_rows(rows)
    for note in notes:
        print(note)


def _print_rows(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for oom_recovery.json"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved repeats of the overhead fits (default 7; --quick: 2)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke mode, few repeats and steps (CI, < 60 s)")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process DDP overhead measurement")
    parser.add_argument("--ddp-only", action="store_true", help="only the 2-process DDP overhead measurement")
    parser.add_argument(
        "--ddp-workloads",
        default="mlp,squeezenet",
        help="comma-separated workloads of the DDP measurement (default: mlp,squeezenet)",
    )
    parser.add_argument(
        "--mlp-recovery-batch-size",
        type=int,
        default=2048,
        help="the MLP's batch size in the recovery run (default 2048; at 256 its memory is "
        "dominated by parameters, gradients and optimizer state)",
    )
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be a positive int, got {args.repeats}")
    if args.mlp_recovery_batch_size < 2:
        parser.error(f"--mlp-recovery-batch-size must be >= 2, got {args.mlp_recovery_batch_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 7)
    warmup, steps = (2, 8) if args.quick else (4, 25)
    recovery_warmup, recovery_after = (2, 2) if args.quick else (4, 4)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")

    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "oom_recovery",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "repeats": repeats,
        "step_time": "period between consecutive on_train_batch_end calls; per fit the median of steady steps",
        "models": {},
    }
    for workload in [] if args.ddp_only else workloads(args.mlp_recovery_batch_size):
        print(f"{workload.name}: overhead, {repeats} interleaved repeats ...", flush=True)
        phase_started = time.perf_counter()
        entry = {
            "description": workload.description,
            "targeted": workload.targeted,
            "overhead": measure_overhead(workload, repeats, warmup, steps),
        }
        entry["overhead"]["wall_s"] = time.perf_counter() - phase_started
        if workload.recovery_batch_size is not None:
            print(f"{workload.name}: recovery under SimulatedMemory ...", flush=True)
            phase_started = time.perf_counter()
            entry["recovery"] = measure_recovery(workload, recovery_warmup, recovery_after)
            entry["recovery"]["wall_s"] = time.perf_counter() - phase_started
        results["models"][workload.name] = entry
    if not args.no_ddp:
        results["ddp"] = {}
        for name in args.ddp_workloads.split(","):
            workload = next(w for w in workloads(args.mlp_recovery_batch_size) if w.name == name.strip())
            print(
                f"{workload.name}: DDP overhead, 2 processes, {repeats} interleaved repeats ...", flush=True
            )
            phase_started = time.perf_counter()
            entry = measure_ddp_overhead(
                workload, repeats, warmup, steps, args.out / "ddp_times" / workload.name
            )
            entry["wall_s"] = time.perf_counter() - phase_started
            results["ddp"][workload.name] = entry
    results["targets"] = [
        {"model": name, **r["overhead"]["target"]} for name, r in results["models"].items() if r["targeted"]
    ]
    for name, entry in results.get("ddp", {}).items():
        results["targets"].append({"model": f"{name}, DDP x2", **entry["target"]})
    results["targets"] += [
        {
            "model": name,
            "metric": "the run recovers from the OOM and completes",
            "threshold": "recovered",
            "value": r["recovery"]["status"],
            "met": r["recovery"]["recovered"],
        }
        for name, r in results["models"].items()
        if "recovery" in r
    ]
    results["wall_s"] = time.perf_counter() - started

    print()
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "oom_recovery.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {path} ({results['wall_s']:.0f} s)")
    failed = any(r.get("recovery", {}).get("status") == "failed" for r in results["models"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
