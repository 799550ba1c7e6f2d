"""Precision: speed and final loss per precision, PrecisionSwitch's cost when healthy, its automatic choice.

    python benchmarks/precision.py [--quick] [--device cuda] [--repeats 5]  # 2-3 minutes on 2 CPU cores

For a small MLP and a small causal transformer LM, at the same batch: samples/s and the final loss per
precision (``32-true``, ``bf16-mixed``, ``16-mixed``, on CUDA ``tf32``); PrecisionSwitch's cost when healthy
(target <= 1.02) and its automatic choice against the fastest stable configuration (within 5 %). Writes
``precision.json``; targets reported, not enforced. How each figure is measured: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import common
import lightning.pytorch as pl
import torch
from common import Batches, Classifier, StepClock, labelled, mlp
from common import spread as summary
from gpu.oom import Workload, lm_workload
from gpu.speed import tf32
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_gpuopt import PrecisionSwitch

OVERHEAD_TARGET = 1.02
CPU_FAST_STEPS = 5
AUTO_TARGET = 0.95
LOSS_TAIL = 3  # the final loss: mean of the last few steps' losses


def _feature_batches(n: int, count: int = 4) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [labelled(n, 256, generator=g) for _ in range(count)]


def cpu_workloads() -> list[Workload]:
    """Small, because float16/bfloat16 autocast on a CPU without AVX512-BF16/AMX is about 10x slower than float32."""
    small = lambda: Classifier(lambda: mlp(256, 512, 512, 10))  # noqa: E731
    batches = lambda: _feature_batches(128)  # noqa: E731
    mlp_workload = Workload("mlp", "MLP 256-512-512-10, ReLU, SGD momentum", small, batches, 128)
    return [mlp_workload, lm_workload(64, 1, 2, 32, 512, 16, count=4)]


@dataclass(frozen=True)
class Config:
    """How one fit is set up: the Trainer's precision (or a plugin), TF32, and a PrecisionSwitch."""

    name: str
    precision: str | None
    fp16_plugin: bool = False
    tf32: bool = False
    switch: Callable[[], PrecisionSwitch] | None = None
    #: On CUDA, set float32 math explicitly (TF32 per ``tf32``); ``False``: torch's defaults, as a user's run.
    explicit_fp32_math: bool = True
    #: Runs in float32 on a CPU: its steps are about 10x shorter, so it gets CPU_FAST_STEPS x the timed steps.
    fp32_on_cpu: bool = False

    def trainer_kwargs(self, device: str) -> dict[str, Any]:
        if self.fp16_plugin:
            return {"precision": None, "plugins": [MixedPrecision("16-mixed", device)]}
        return {"precision": self.precision}


def configs(device: str) -> list[Config]:
    cpu = device == "cpu"  # on a CPU only the plugin gives real float16
    auto = lambda: PrecisionSwitch(verbose=False)  # noqa: E731
    keep = lambda **kwargs: lambda: PrecisionSwitch(initial="keep", verbose=False, **kwargs)  # noqa: E731
    listed = [
        Config("32-true", "32-true", fp32_on_cpu=True),
        Config("bf16-mixed", "bf16-mixed"),
        Config("16-mixed", "16-mixed", fp16_plugin=cpu),
        Config("switch 32-true", "32-true", fp32_on_cpu=True, switch=keep(tf32=False)),
        Config("switch 16-mixed", "16-mixed", fp16_plugin=cpu, switch=keep()),
        Config("auto", None, switch=auto, explicit_fp32_math=False, fp32_on_cpu=True),  # 32-true on a CPU
    ]
    if not cpu:
        listed.insert(1, Config("tf32", "32-true", tf32=True))
    return listed


PRECISIONS = ("32-true", "tf32", "bf16-mixed", "16-mixed")
OVERHEAD_PAIRS = {"switch 32-true": "32-true", "switch 16-mixed": "16-mixed"}


class Window(StepClock):
    """Step time after ``warmup`` batches, and the loss of every step.

    On CUDA: the wall time from the end of batch ``warmup - 1`` to the end of the last batch, synchronised
    at both ends only (a sync per step would hide the cost of the ones a callback adds). On a CPU, where
    nothing runs ahead: the median over steps of this process's CPU time per step (one intra-op thread),
    which other jobs on shared cores disturb far less than wall time; the wall-time median is kept too.
    """

    def __init__(self, warmup: int, sync: bool) -> None:
        super().__init__()
        self.warmup, self.cuda = warmup, sync
        self.losses: list[Tensor] = []  # kept on the device: read after the fit, no sync per step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(outputs["loss"].detach())
        if self.cuda and batch_idx in (self.warmup - 1, trainer.max_steps - 1):
            torch.cuda.synchronize()
        super().on_train_batch_end()

    def step_seconds(self, clock: int = 0) -> float:
        """Seconds per step: ``clock`` 0 wall time, 1 this process's CPU time."""
        periods = self.periods(clock)[self.warmup - 1 :]
        return statistics.fmean(periods) if self.cuda else statistics.median(periods)


def fit(
    workload: Workload, config: Config, batches: list, device: str, warmup: int, steps: int, loss_at: int
) -> dict:
    """One seeded fit; the final loss is the mean over the ``LOSS_TAIL`` steps before ``loss_at``."""
    pl.seed_everything(0, verbose=False)
    gc.collect()
    window = Window(warmup, sync=device == "cuda")
    switch = config.switch() if config.switch else None
    callbacks = [window] + ([switch] if switch else [])
    trainer = common.trainer(warmup + steps, callbacks, device, **config.trainer_kwargs(device))
    explicit = device == "cuda" and config.explicit_fp32_math
    with tf32(config.tf32) if explicit else contextlib.nullcontext():
        trainer.fit(workload.build(), DataLoader(Batches(batches, warmup + steps), batch_size=None))
    losses = [float(v) for v in window.losses]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = float(scaler.get_scale()) if scaler is not None else None
    tail, compared = losses[-LOSS_TAIL:], losses[loss_at - LOSS_TAIL : loss_at]
    result = {"samples_per_s": workload.batch_size / window.step_seconds(1 if device == "cpu" else 0)}
    result["wall_samples_per_s"] = workload.batch_size / window.step_seconds(0)
    result["final_loss"] = statistics.fmean(compared)
    result["stable"] = all(math.isfinite(v) for v in tail + compared) and (scale is None or scale >= 1.0)
    switches = [] if switch is None else [[c.step, c.before, c.after] for c in switch.switches]
    return {**result, "precision": trainer.precision, "scale": scale, "switches": switches}


def measure(workload: Workload, device: str, repeats: int, warmup: int, steps: int) -> dict[str, Any]:
    listed = configs(device)
    batches = [tuple(t.to(device) for t in b) for b in workload.batches()]
    fit(workload, listed[0], batches, device, warmup, 2, warmup + 2)  # untimed: the process's first-use costs
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in listed}
    for repeat in range(repeats):
        for config in listed if repeat % 2 == 0 else listed[::-1]:
            timed = steps * CPU_FAST_STEPS if device == "cpu" and config.fp32_on_cpu else steps
            # every configuration's loss is compared at the same step
            runs[config.name].append(fit(workload, config, batches, device, warmup, timed, warmup + steps))
    rates = {name: [r["samples_per_s"] for r in rs] for name, rs in runs.items()}
    per_config = {}
    for name, rs in runs.items():  # medians over the repeats; the precision, scale and switches of the last
        rate = rates[name]
        config = {"samples_per_s": statistics.median(rate), "samples_per_s_summary": summary(rate)}
        for key in ("wall_samples_per_s", "final_loss"):
            config[key] = statistics.median(r[key] for r in rs)
        config["stable"] = all(r["stable"] for r in rs)
        per_config[name] = {**config, **{key: rs[-1][key] for key in ("precision", "scale", "switches")}}
    overhead = {}
    for name, base in OVERHEAD_PAIRS.items():
        ratios = [b / a for a, b in zip(rates[name], rates[base])]  # time ratio = inverse rate ratio
        added_ms = [1e3 * workload.batch_size * (1 / a - 1 / b) for a, b in zip(rates[name], rates[base])]
        overhead[name] = {"ratio": statistics.median(ratios), "ratio_summary": summary(ratios)}
        overhead[name]["added_ms_per_step"] = statistics.median(added_ms)
        overhead[name]["added_ms_summary"] = summary(added_ms)
        overhead[name]["met"] = statistics.median(ratios) <= OVERHEAD_TARGET
    stable = {n: v for n, v in per_config.items() if n in PRECISIONS and v["stable"]}
    fastest = max(stable, key=lambda n: stable[n]["samples_per_s"]) if stable else None
    auto = per_config["auto"]
    auto_ratio = auto["samples_per_s"] / stable[fastest]["samples_per_s"] if fastest else None
    met = auto_ratio is not None and auto_ratio >= AUTO_TARGET
    result = {"description": workload.description, "batch_size": workload.batch_size, "warmup_steps": warmup}
    fp32_steps = steps * (CPU_FAST_STEPS if device == "cpu" else 1)
    result.update(timed_steps=steps, timed_steps_fp32_on_cpu=fp32_steps)
    result.update(configs=per_config, overhead=overhead, fastest_stable=fastest)
    return {**result, "auto": {"chose": auto["precision"], "ratio_to_fastest_stable": auto_ratio, "met": met}}


def print_report(results: dict[str, Any]) -> None:
    for name, r in results["models"].items():
        clock = "CPU time per step" if results["device_kind"] == "cpu" else "wall time"
        print(
            f"\n{name}: {r['description']}, batch {r['batch_size']}, {r['timed_steps']} timed steps, "
            f"{results['repeats']} repeats; samples/s from {clock}"
        )
        rows = [["configuration", "samples/s", "spread (min-max)", "final loss", "stable"]]
        for config, v in r["configs"].items():
            s, label = v["samples_per_s_summary"], config if config != "auto" else f"auto ({v['precision']})"
            spread = f"{s['min']:.1f} - {s['max']:.1f}"
            rate, stable = f"{v['samples_per_s']:.1f}", "yes" if v["stable"] else "NO"
            rows.append([label, rate, spread, f"{v['final_loss']:.4f}", stable])
        common.print_table(rows)
        for config, o in r["overhead"].items():
            print(
                f"  {config} / plain: step-time ratio {o['ratio']:.3f} (IQR {o['ratio_summary']['q1']:.3f}-"
                f"{o['ratio_summary']['q3']:.3f}), {o['added_ms_per_step']:+.2f} ms per step; target <= "
                f"{OVERHEAD_TARGET}: {'met' if o['met'] else 'not met'}"
            )
        a = r["auto"]
        ratio = f"{a['ratio_to_fastest_stable']:.3f}" if a["ratio_to_fastest_stable"] is not None else "n/a"
        print(
            f"  auto chose {a['chose']}; fastest stable: {r['fastest_stable']}; auto / fastest = {ratio}, "
            f"target >= {AUTO_TARGET}: {'met' if a['met'] else 'not met'}"
        )


def run(workloads: list[Workload], device: str, repeats: int, warmup: int, steps: int) -> dict[str, Any]:
    """Measure every workload; the results with their targets (what ``main`` writes)."""
    started = time.perf_counter()
    results: dict[str, Any] = {"benchmark": "precision", **common.environment(repeats=repeats)}
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    results.update(device=name, device_kind=device, models={})
    for workload in workloads:
        count = len(configs(device))
        print(f"{workload.name}: {count} configurations x {repeats} interleaved repeats ...", flush=True)
        phase = time.perf_counter()
        results["models"][workload.name] = measure(workload, device, repeats, warmup, steps)
        results["models"][workload.name]["wall_s"] = time.perf_counter() - phase
    targets = []
    for name, r in results["models"].items():
        for config, o in r["overhead"].items():
            ratio = {"threshold": OVERHEAD_TARGET, "value": o["ratio"], "met": o["met"]}
            targets.append({"model": name, "metric": f"{config} / plain step time", **ratio})
    for name, r in results["models"].items():
        auto = dict(threshold=AUTO_TARGET, value=r["auto"]["ratio_to_fastest_stable"], met=r["auto"]["met"])
        targets.append({"model": name, "metric": "auto samples/s / fastest stable", **auto})
    results["targets"] = targets
    results["wall_s"] = time.perf_counter() - started
    return results


def main(argv: list[str] | None = None) -> int:
    quick = "smoke mode, few repeats and steps (CI, about a minute)"
    parser = common.arguments(
        __doc__, "precision.json", quick=quick, repeats=(7, 2), device="auto", threads=1
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 7)
    warmup, steps = (2, 4) if args.quick else (3, 20)
    common.quiet()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    results = {**run(cpu_workloads(), args.device, repeats, warmup, steps), "quick": args.quick}
    print_report(results)
    common.write_json(args.out, "precision.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
