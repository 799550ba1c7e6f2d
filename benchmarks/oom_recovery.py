"""OOMRecovery on CPU: what it costs when healthy, with forced micro-batches, and when it recovers.

    python benchmarks/oom_recovery.py [--quick] [--out DIR] [--repeats 11]  # 2-4 minutes on 2 cores

Per model (SqueezeNet 1.1 on 32x32 images, a 4-layer MLP, a tiny MLP whose ~1 ms steps show the fixed cost):

1. **Overhead**: steady step time with ``OOMRecovery()`` (k=1, no OOM) over plain Lightning, target <= 1.02;
   forced k=2 reported (the price of micro-batching).
2. **DDP overhead** (``--no-ddp`` / ``--ddp-only``): 2 CPU processes over gloo, rank 0's step times, <= 1.05.
3. **Recovery** under SimulatedMemory: after unlimited warm-up the limit drops halfway between the steady
   peaks at k=1 and k=8; the next step runs out of memory and recovers. Where splitting does not lower the
   peak (the MLP at batch 256) the recovery run uses ``--mlp-recovery-batch-size``.

Step time: the period between consecutive ``on_train_batch_end`` calls; variants interleaved, per repeat a
ratio, the median over repeats. Writes ``oom_recovery.json``; exits 1 if a recovery run fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl
import torch
import torchvision
from common import Batches, Classifier, StepClock, StepPeaks, clocked, labelled, mlp
from common import spread as summary
from gpu.oom import forced
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.testing import SimulatedMemory

OVERHEAD_TARGET, DDP_OVERHEAD_TARGET = 1.02, 1.05
K1_OVER_PLAIN = "OOMRecovery() k=1 / plain"
CALIBRATION_K = 8
VARIANTS = ("plain", "k=1", "k=2")
FORCED_K = {"plain": None, "k=1": 1, "k=2": 2}


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int
    #: Batch size of the recovery run (activations must dominate memory for a split to help); ``None``: none.
    recovery_batch_size: int | None
    #: Timed steps relative to the other workloads (short steps need more of them).
    steps_factor: int = 1
    #: Whether the overhead target applies (False: reported for information).
    targeted: bool = True

    def loader(self, batch_size: int, count: int) -> DataLoader:
        """``count`` fresh batches (copies: SimulatedMemory counts a yielded batch until it dies)."""
        generator = torch.Generator().manual_seed(0)
        batches = [self.make_batch(batch_size, generator) for _ in range(count)]
        return DataLoader(Batches(batches, copy=True), batch_size=None, shuffle=False)


def workloads(mlp_recovery_batch_size: int) -> list[Workload]:
    squeezenet = lambda: torchvision.models.squeezenet1_1(num_classes=10)  # noqa: E731
    mlp4 = lambda: mlp(512, 1024, 1024, 1024, 10)  # noqa: E731
    squeezenet_name = "torchvision squeezenet1_1(num_classes=10) on 3x32x32"
    inputs = lambda *shape: lambda n, g: labelled(n, *shape, generator=g)  # noqa: E731
    tiny = "MLP 32-64-10 (steps of ~1 ms: the callback's fixed cost per step)"
    return [
        Workload("squeezenet", squeezenet_name, squeezenet, inputs(3, 32, 32), 32, 32),
        Workload("mlp", "MLP 512-1024-1024-1024-10, ReLU", mlp4, inputs(512), 256, mlp_recovery_batch_size),
        Workload("tiny", tiny, lambda: mlp(32, 64, 10), inputs(32), 32, None, 4, targeted=False),
    ]


class LimitedPeaks(StepPeaks):
    """Per batch, under SimulatedMemory: bytes allocated at its start and the peak of its whole step; the limit
    from batch ``limit_at`` on."""

    def __init__(self, memory: SimulatedMemory, limit_at: int | None = None, limit_bytes: int = 0) -> None:
        super().__init__()
        self.memory, self.starts, self.limit_at, self.limit_bytes = memory, [], limit_at, limit_bytes

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(self.memory.allocated_bytes)
        super().on_train_batch_start()
        if batch_idx == self.limit_at:  # the limit from this batch on, after the unlimited warm-up
            self.memory.limit_bytes = self.limit_bytes


def _recovery(k: int | None) -> list[pl.Callback]:
    """``[]`` for plain Lightning, else ``[OOMRecovery]`` at k micro-batches from the start (no OOM needed)."""
    return [forced(k)] if k else []


def fit(
    workload: Workload, callbacks: list, loader: DataLoader, memory: SimulatedMemory | None = None
) -> pl.Trainer:
    """One seeded fit of ``len(loader)`` steps, inside ``memory`` when given (the loader is made outside it:
    SimulatedMemory should count the batches it yields, not the whole dataset)."""
    pl.seed_everything(0, verbose=False)
    gc.collect()
    trainer, model = common.trainer(len(loader), callbacks, precision="32-true"), Classifier(workload.build)
    with memory if memory is not None else contextlib.nullcontext():
        trainer.fit(model, loader)
    return trainer


def _ratios(per_fit: dict[str, list[float]], variants: tuple[str, ...] = VARIANTS) -> dict[str, list[float]]:
    return {v: [a / b for a, b in zip(per_fit[v], per_fit["plain"])] for v in variants if v != "plain"}


def _target(metric: str, threshold: float, value: float) -> dict[str, Any]:
    return {"metric": metric, "threshold": threshold, "value": value, "met": value <= threshold}


def measure_overhead(workload: Workload, repeats: int, warmup: int, steps: int) -> dict[str, Any]:
    """Interleaved fits of plain / k=1 / k=2; per fit, the median and minimum of its steady steps."""
    steps *= workload.steps_factor
    loader = workload.loader(workload.batch_size, warmup + steps)
    fit(workload, [], loader)  # untimed: first-use costs of the process (kernels, allocator, imports)
    median_ms, min_ms, cpu_ms = ({v: [] for v in VARIANTS} for _ in range(3))
    for repeat in range(repeats):
        for variant in VARIANTS[:: 1 if repeat % 2 == 0 else -1]:
            clock, recovery = StepClock(), _recovery(FORCED_K[variant])
            fit(workload, [clock, *recovery], loader)
            if recovery and recovery[0].failures:
                raise RuntimeError(f"{workload.name} {variant}: out of memory without a limit")
            steady = clock.periods()[warmup - 1 :]  # from batch `warmup` on
            median_ms[variant].append(1e3 * statistics.median(steady))
            min_ms[variant].append(1e3 * min(steady))
            cpu_ms[variant].append(1e3 * statistics.median(clock.periods(1)[warmup - 1 :]))
    ratios, min_ratios, cpu_ratios = _ratios(median_ms), _ratios(min_ms), _ratios(cpu_ms)
    series = {
        "ratio_k1": ratios["k=1"],
        "ratio_k2": ratios["k=2"],
        "ratio_k1_of_min_steps": min_ratios["k=1"],
        "ratio_k1_cpu_time": cpu_ratios["k=1"],
        "overhead_k1_ms": [a - b for a, b in zip(median_ms["k=1"], median_ms["plain"])],
    }
    k1 = summary(ratios["k=1"])["median"]
    result = dict(batch_size=workload.batch_size, warmup_steps=warmup, timed_steps=steps)
    result.update(step_ms_median_per_fit=median_ms, step_ms_min_per_fit=min_ms, cpu_ms_median_per_fit=cpu_ms)
    result.update(step_ms={v: statistics.median(median_ms[v]) for v in VARIANTS}, **series)
    result.update({f"{name}_summary": summary(values) for name, values in series.items()})
    metric = f"median over repeats of step-time ratio {K1_OVER_PLAIN}"
    return {**result, "target": _target(metric, OVERHEAD_TARGET, k1)}


class RankZeroTimes(StepClock):
    """A StepClock that, in a spawned DDP process, writes rank 0's periods to ``path`` (the parent reads them)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps({"periods": self.periods(), "cpu_periods": self.periods(1)}))


def measure_ddp_overhead(workload: Workload, repeats: int, warmup: int, steps: int, folder: Path) -> dict:
    """Interleaved 2-process DDP fits (gloo, spawn): plain vs OOMRecovery() at k=1; rank 0's steady step times."""
    from lightning.pytorch.strategies import DDPStrategy

    loader = workload.loader(workload.batch_size, 2 * (warmup + steps))  # each rank gets half
    variants = ("plain", "k=1")
    median_ms: dict[str, list[float]] = {v: [] for v in variants}
    folder.mkdir(parents=True, exist_ok=True)
    for repeat in range(repeats):
        for variant in variants[:: 1 if repeat % 2 == 0 else -1]:
            path = folder / f"ddp_{repeat}_{variant}.json"
            pl.seed_everything(0, verbose=False)
            callbacks = [RankZeroTimes(path), *_recovery(FORCED_K[variant])]
            ddp = dict(devices=2, strategy=DDPStrategy(start_method="spawn"), precision="32-true")
            common.trainer(warmup + steps, callbacks, **ddp).fit(Classifier(workload.build), loader)
            periods = json.loads(path.read_text())["periods"]
            median_ms[variant].append(1e3 * statistics.median(periods[warmup - 1 :]))
    ratios = _ratios(median_ms, variants)["k=1"]
    metric = "median over repeats of rank 0's step-time ratio DDP+OOMRecovery() k=1 / plain DDP"
    result = dict(workload=workload.name, processes=2, backend="gloo")
    result["batch_size_per_rank"] = workload.batch_size
    result.update(warmup_steps=warmup, timed_steps=steps, step_ms_median_per_fit=median_ms)
    result.update(step_ms={v: statistics.median(median_ms[v]) for v in variants}, ratio_k1=ratios)
    result["ratio_k1_summary"] = summary(ratios)
    return {**result, "target": _target(metric, DDP_OVERHEAD_TARGET, result["ratio_k1_summary"]["median"])}


def calibrate(workload: Workload, batch_size: int, steps: int = 3) -> dict[str, Any]:
    """The recovery run's limit: halfway between the steady peaks at k=1 and at k=8, if they differ."""
    peaks, starts = {}, {}
    for k in (1, CALIBRATION_K):  # the last step of an unlimited run at k: its peak and what it starts with
        memory = SimulatedMemory()
        record = LimitedPeaks(memory)
        fit(workload, [record, *_recovery(k)], workload.loader(batch_size, steps), memory)
        peaks[k], starts[k] = record.peaks[-1], record.starts[-1]
    # Room either side: the full batch must fail, a split into <= 8 micro-batches must fit.
    limit = (peaks[1] + peaks[CALIBRATION_K]) // 2 if peaks[CALIBRATION_K] < 0.97 * peaks[1] else None
    result = {"batch_size": batch_size, "step_start_bytes": starts[1], "peak_k1_bytes": peaks[1]}
    result[f"peak_k{CALIBRATION_K}_bytes"] = peaks[CALIBRATION_K]
    return {**result, "limit_bytes": limit, "limit_fraction_of_peak": limit / peaks[1] if limit else None}


def measure_recovery(workload: Workload, warmup: int, steps_after: int) -> dict[str, Any]:
    """Warm up unlimited at k=1, then drop the limit: the next step runs out of memory and recovers."""
    batch_size = workload.recovery_batch_size
    result: dict[str, Any] = {"batch_size": batch_size, "calibration": calibrate(workload, batch_size)}
    if batch_size != workload.batch_size:
        result["calibration_at_overhead_batch_size"] = calibrate(workload, workload.batch_size)
    cal, limit = result["calibration"], result["calibration"]["limit_bytes"]
    if limit is None:
        peaks = (cal["peak_k1_bytes"] / 2**20, CALIBRATION_K, cal[f"peak_k{CALIBRATION_K}_bytes"] / 2**20)
        reason = "splitting does not lower the step's peak (k=1: {:.1f} MiB, k={}: {:.1f} MiB)".format(*peaks)
        return {**result, "status": "not possible", "recovered": False, "reason": reason}
    limit_at = warmup + 1  # batches 0..warmup run unlimited; from batch 2 on they are steady steps
    total_steps = limit_at + 1 + steps_after
    memory, clock, recovery = SimulatedMemory(), StepClock(), OOMRecovery()
    peaks = LimitedPeaks(memory, limit_at, limit)
    try:
        trainer = fit(workload, [clock, peaks, recovery], workload.loader(batch_size, total_steps), memory)
    except Exception as err:  # a failed recovery is a result: report it with what was measured
        error = f"{type(err).__name__}: {err}"
        result.update(status="failed", recovered=False, limit_bytes=limit, error=error)
        return {**result, "failures": [dataclasses.asdict(f) for f in recovery.failures]}
    # What free_memory() pays per failed attempt on CPU, on a heap like the run's.
    gc_ms = 1e3 * clocked(gc.collect)[0]
    failures = [dataclasses.asdict(f) for f in recovery.failures]
    periods = clock.periods()  # periods[i - 1] is batch i's
    steady, after, recovering = periods[1 : limit_at - 1], periods[limit_at + 1 :], periods[limit_at - 1]
    recovered = trainer.global_step == total_steps and bool(failures)
    result.update(status="recovered" if recovered else "failed", recovered=recovered, limit_bytes=limit)
    result.update(limit_at_batch=limit_at, failures=failures, retries=len(failures))
    result.update(oom_batches=sorted({f["batch_idx"] for f in failures}), final_k=recovery.k)
    result["final_micro_batch_size"] = -(-batch_size // recovery.k)
    result["peak_after_limit_bytes"] = max(peaks.peaks[limit_at:])
    result.update(step_start_bytes_before_oom=peaks.starts[limit_at], step_start_bytes_later=peaks.starts[-1])
    # after_step_ms: from the second step at the final k
    result.update(steady_step_ms=[1e3 * t for t in steady], after_step_ms=[1e3 * t for t in after])
    result["recovering_step_ms"] = 1e3 * recovering
    result["ratio_vs_steady_k1"] = recovering / statistics.median(steady)
    return {**result, "ratio_vs_final_k_step": recovering / statistics.median(after), "gc_collect_ms": gc_ms}


def _spread(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}; IQR {s['q1']:.3f}-{s['q3']:.3f}]"


def report(results: dict[str, Any]) -> None:
    header = "model|batch|plain ms|k=1 ms|k=1/plain median [min-max; IQR]|target|of min steps|of CPU time|k=1 extra ms|k=2/plain"
    rows = [header.split("|")]
    for name, r in results["models"].items():
        o = r["overhead"]
        met = ("met" if o["target"]["met"] else "NOT met") if r["targeted"] else "(info)"
        medians = [o[f"{key}_summary"]["median"] for key in ("ratio_k1_of_min_steps", "ratio_k1_cpu_time")]
        cells = [name, o["batch_size"], f"{o['step_ms']['plain']:.2f}", f"{o['step_ms']['k=1']:.2f}"]
        target = f"<= {OVERHEAD_TARGET} {met}"
        cells += [_spread(o["ratio_k1_summary"]), target, *(f"{m:.3f}" for m in medians)]
        extra, k2 = o["overhead_k1_ms_summary"]["median"], o["ratio_k2_summary"]["median"]
        rows.append([*cells, f"{extra:+.3f}", f"{k2:.3f}"])
    common.print_table(rows)
    print(
        "k=1/plain: median over repeats of the ratio of per-fit median step times; 'of min steps': of per-fit "
        "fastest steps; 'of CPU time': of per-fit median process CPU time per step (all medians over repeats)\n"
    )
    if results.get("ddp"):
        header = "DDP (2 processes, gloo)|batch per rank|plain DDP ms|DDP + OOMRecovery ms|ratio median [min-max; IQR]|target"
        rows = [header.split("|")]
        for d in results["ddp"].values():
            met, ms = "met" if d["target"]["met"] else "NOT met", d["step_ms"]
            rows.append([d["workload"], d["batch_size_per_rank"], f"{ms['plain']:.2f}", f"{ms['k=1']:.2f}"])
            rows[-1] += [_spread(d["ratio_k1_summary"]), f"<= {DDP_OVERHEAD_TARGET} {met}"]
        common.print_table(rows)
        print()
    header = "model|batch|limit (of k=1 peak)|status|retries|final k|steady ms|recovering ms|ratio|final-k step ms|ratio to it|gc.collect ms"
    rows = [header.split("|")]
    notes = []
    for name, r in results["models"].items():
        c = r.get("recovery")
        if c is None:
            continue
        if c["status"] != "recovered":
            rows.append([name, c["batch_size"], "-", c["status"], *["-"] * 8])
            notes.append(f"{name}: recovery {c['status']}: {c.get('reason') or c.get('error')}")
            continue
        limit = f"{c['limit_bytes'] / 2**20:.1f} MiB ({c['calibration']['limit_fraction_of_peak']:.0%})"
        rows.append([name, c["batch_size"], limit, c["status"], c["retries"], c["final_k"]])
        rows[-1] += [f"{statistics.median(c['steady_step_ms']):.1f}", f"{c['recovering_step_ms']:.1f}"]
        rows[-1] += [f"{c['ratio_vs_steady_k1']:.1f}", f"{statistics.median(c['after_step_ms']):.1f}"]
        rows[-1] += [f"{c['ratio_vs_final_k_step']:.1f}", f"{c['gc_collect_ms']:.0f}"]
        other = c.get("calibration_at_overhead_batch_size")
        if other is not None:
            peak_1, peak_k = other["peak_k1_bytes"] / 2**20, other[f"peak_k{CALIBRATION_K}_bytes"] / 2**20
            verdict = "splitting cannot recover an OOM there"
            verdict = "splitting lowers it" if other["limit_bytes"] else verdict
            notes.append(
                f"{name}: at batch {other['batch_size']} the step peaks at {peak_1:.1f} MiB with k=1 and "
                f"{peak_k:.1f} MiB with k={CALIBRATION_K}: {verdict}"
            )
    common.print_table(rows)
    for note in notes:
        print(note)


def main(argv: list[str] | None = None) -> int:
    quick = "smoke mode, few repeats and steps (CI, < 60 s)"
    parser = common.arguments(__doc__, "oom_recovery.json", quick=quick, repeats=(7, 2))
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process DDP overhead measurement")
    parser.add_argument("--ddp-only", action="store_true", help="only the 2-process DDP overhead measurement")
    ddp = "comma-separated workloads of the DDP runs"
    parser.add_argument("--ddp-workloads", default="mlp,squeezenet", help=ddp)
    mlp_batch = (
        "the MLP's batch in the recovery run (default 2048; at 256 parameters and optimizer state dominate)"
    )
    parser.add_argument("--mlp-recovery-batch-size", type=int, default=2048, help=mlp_batch)
    args = parser.parse_args(argv)
    if args.mlp_recovery_batch_size < 2:
        parser.error(f"--mlp-recovery-batch-size must be >= 2, got {args.mlp_recovery_batch_size}")
    repeats = args.repeats or (2 if args.quick else 7)
    (warmup, steps), (recovery_warmup, recovery_after) = ((2, 8), (2, 2)) if args.quick else ((4, 25), (4, 4))
    common.quiet()
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "oom_recovery",
        **common.environment(torchvision=torchvision.__version__, quick=args.quick, repeats=repeats),
        "step_time": "period between consecutive on_train_batch_end calls; per fit the median of steady steps",
        "models": {},
    }
    listed = workloads(args.mlp_recovery_batch_size)
    for workload in [] if args.ddp_only else listed:
        print(f"{workload.name}: overhead, {repeats} interleaved repeats ...", flush=True)
        phase = time.perf_counter()
        entry = {"description": workload.description, "targeted": workload.targeted}
        entry["overhead"] = measure_overhead(workload, repeats, warmup, steps)
        entry["overhead"]["wall_s"] = time.perf_counter() - phase
        if workload.recovery_batch_size is not None:
            print(f"{workload.name}: recovery under SimulatedMemory ...", flush=True)
            phase = time.perf_counter()
            recovery = measure_recovery(workload, recovery_warmup, recovery_after)
            entry["recovery"] = {**recovery, "wall_s": time.perf_counter() - phase}
        results["models"][workload.name] = entry
    if not args.no_ddp:
        results["ddp"] = {}
        for name in args.ddp_workloads.split(","):
            workload = next(w for w in listed if w.name == name.strip())
            print(
                f"{workload.name}: DDP overhead, 2 processes, {repeats} interleaved repeats ...", flush=True
            )
            phase, folder = time.perf_counter(), args.out / "ddp_times" / workload.name
            entry = measure_ddp_overhead(workload, repeats, warmup, steps, folder)
            results["ddp"][workload.name] = {**entry, "wall_s": time.perf_counter() - phase}
    models = results["models"].items()
    targets = [{"model": name, **r["overhead"]["target"]} for name, r in models if r["targeted"]]
    targets += [{"model": f"{name}, DDP x2", **d["target"]} for name, d in results.get("ddp", {}).items()]
    for name, r in models:
        if "recovery" in r:
            done = dict(threshold="recovered", value=r["recovery"]["status"], met=r["recovery"]["recovered"])
            targets.append({"model": name, "metric": "the run recovers from the OOM and completes", **done})
    results["targets"] = targets
    print()
    report(results)
    common.write_json(args.out, "oom_recovery.json", results, started)
    return int(any(r.get("recovery", {}).get("status") == "failed" for r in results["models"].values()))


if __name__ == "__main__":
    sys.exit(main())
