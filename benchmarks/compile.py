"""torch.compile with OOMRecovery: step time compiled over eager at k = 1 and after a split, and what a split costs in compilation.

    python benchmarks/compile.py [--quick] [--backend inductor] [--device cuda] [--models M] [--forms F]

Per workload (a small CNN with BatchNorm, a small causal transformer LM) and compiled form (``submodule``:
the network compiled; ``module``: ``trainer.fit(torch.compile(model))``), an eager and a compiled fit with
``OOMRecovery()`` run warm-up and steady batches at k = 1, one batch under a limit (halfway between the eager
peaks at k = 1 and k = 4) that makes it split, then batches at the split's k. Reported, median over
interleaved repeats: compiled / eager step time at k = 1 and after the split; dynamo's compilations (by
compile id) at the first batch and caused by the split, with their seconds. The pack's budget is one
recompilation per split (docs/oom-recovery.md). Writes ``compile.json``; exits 1 when a fit fails.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import common
import lightning.pytorch as pl
import torch
from common import figure, quiet
from gpu import device
from gpu.oom import LimitAt, StepRecord, Workload, cnn_workload, lm_workload, steady_step, train
from torch import Tensor

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.decisions import decisions

FORMS = ("submodule", "module")
VARIANTS = ("eager", "compiled")
CALIBRATION_K = 4


@dataclass(frozen=True)
class Schedule:
    """The batches of one fit: warm-up and steady at k = 1, the batch that runs out of memory, then after it."""

    warmup: int
    steady: int
    after: int

    @property
    def split_at(self) -> int:
        return self.warmup + self.steady

    @property
    def steps(self) -> int:
        return self.split_at + 1 + self.after


def workloads(device_kind: str) -> dict[str, Workload]:
    """Small on a CPU (steps of tens of milliseconds); on CUDA big enough for compiled kernels to matter."""
    if device_kind == "cuda":
        listed = [cnn_workload(64, 128, "resnet18", 100), lm_workload(512, 4, 8, 256, 8192, 32)]
    else:
        listed = [cnn_workload(32, 32), lm_workload(128, 2, 4, 64, 512, 16)]
    return {w.name: w for w in listed}


def compilation(metrics: Any) -> dict[str, Any]:
    """One of dynamo's compilation records as plain figures: which compilation, frame, forward or backward, seconds."""
    seconds = getattr(metrics, "duration_us", None)
    seconds = seconds / 1e6 if seconds is not None else getattr(metrics, "entire_frame_compile_time_s", None)
    return {
        "compile_id": str(getattr(metrics, "compile_id", None)),
        "frame": getattr(metrics, "co_name", None),
        "forward": getattr(metrics, "is_forward", None) is not False,
        "seconds": seconds,
        "graph_ops": getattr(metrics, "graph_op_count", None),
        "failed": getattr(metrics, "fail_type", None),
    }


class CompileLog(pl.Callback):
    """Per batch, what dynamo compiled during it, read from its own compilation records."""

    def __init__(self) -> None:
        self.per_batch: list[list[dict[str, Any]]] = []
        self._seen: set[tuple[Any, ...]] = set()

    @staticmethod
    def _records() -> list[tuple[tuple[Any, ...], Any]]:
        from torch._dynamo.utils import get_compilation_metrics

        def key(m: Any) -> tuple[Any, ...]:
            start = getattr(m, "start_time_us", None) or getattr(m, "start_time", None)
            return str(getattr(m, "compile_id", None)), getattr(m, "is_forward", None), start

        return [(key(m), m) for m in get_compilation_metrics()]

    def on_train_start(self, *args: Any) -> None:
        self._seen = {k for k, _ in self._records()}

    def on_train_batch_end(self, *args: Any) -> None:
        new = [(k, m) for k, m in self._records() if k not in self._seen]
        self._seen.update(k for k, _ in new)
        self.per_batch.append([compilation(m) for _, m in new])


class LimitAtFraction(LimitAt):
    """At one batch, confines the device to a fraction of the way from a steady step's start to its peak.

    Both figures come from this fit's own steady k = 1 steps (``record``), so the limit follows the
    compiled step's memory when it differs from the eager one's.
    """

    def __init__(self, record: StepRecord, batch_idx: int, fraction: float, steady_from: int) -> None:
        super().__init__(batch_idx, 0)
        self.record, self.fraction, self.steady_from = record, fraction, steady_from

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx:
            start, peak = self.record.starts[-1], max(self.record.peaks[self.steady_from :])
            self.limit_bytes = int(start + self.fraction * (peak - start))
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def calibrate(workload: Workload, batches: list[tuple[Tensor, ...]], precision: str) -> dict[str, Any]:
    """Eager peaks at k = 1 and k = CALIBRATION_K, and where halfway between sits in a k = 1 step's activations."""
    (start, peak_1), (_, peak_k) = (steady_step(workload, batches, k, precision) for k in (1, CALIBRATION_K))
    lowers = peak_k < 0.97 * peak_1
    fraction = ((peak_1 + peak_k) / 2 - start) / (peak_1 - start) if lowers else None
    result = {"start_bytes": start, "peak_k1_bytes": peak_1, f"peak_k{CALIBRATION_K}_bytes": peak_k}
    return {**result, "splitting_lowers_peak": lowers, "limit_fraction_of_activations": fraction}


def run(workload: Workload, batches: list, schedule: Schedule, fraction, precision: str, form, backend: str):
    """One seeded fit with OOMRecovery and its OOM at ``schedule.split_at`` (none when ``fraction`` is None),
    compiled in ``form`` (``None``: eager)."""

    def compiled(model: pl.LightningModule) -> pl.LightningModule:
        torch._dynamo.reset()
        if form == "submodule":
            net = getattr(model, workload.submodule)
            setattr(model, workload.submodule, torch.compile(net, backend=backend))
        return torch.compile(model, backend=backend) if form == "module" else model

    recovery = OOMRecovery(verbose=False)
    record, compiles = StepRecord(), CompileLog()
    limit = [LimitAtFraction(record, schedule.split_at, fraction, schedule.warmup)] if fraction else []
    started = time.perf_counter()
    error, recompiled = None, []
    try:  # the limit first: its gc and empty_cache are not part of the failing batch's time
        callbacks = [*limit, record, compiles, recovery]
        trainer = train(workload, batches, schedule.steps, callbacks, precision, compiled)
        recompiled = [d for d in decisions(trainer) if d.kind == "recompilation"]
    except Exception as err:  # a failed fit is a result: report it, keep the other fits
        if isinstance(err, RuntimeError) and "torch.compile'd LightningModule" in str(err):
            return {"status": "refused", "reason": str(err)}  # OOMRecovery refused the form at setup
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}"
    ms, split = [1e3 * s for s in record.seconds], schedule.split_at
    completed = error is None and len(ms) == schedule.steps
    failures = recovery.failures
    result: dict[str, Any] = {"status": "ran" if completed else "failed", "error": error, "step_ms": ms}
    result.update(k_per_batch=record.ks, failures=len(failures))
    result["failure_batches"] = [f.batch_idx for f in failures]
    result.update(final_k=recovery.k, limit_bytes=limit[0].limit_bytes if limit else None)
    result["compilations_per_batch"] = compiles.per_batch
    # What the pack itself counted (its decisions, read from dynamo's counters), beside dynamo's records above.
    result["pack_recompilations"] = sum(int(d.data.get("frames", 1)) for d in recompiled)
    result["pack_decisions"] = [f"batch {d.step}: {d.message}" for d in recompiled]
    result["wall_s"] = time.perf_counter() - started
    if not completed:
        return result
    steady, after = statistics.median(ms[schedule.warmup : split]), statistics.median(ms[split + 1 :])
    result.update(first_ms=ms[0], steady_ms=steady, split_ms=ms[split], after_ms=after)
    result["split_happened"] = bool(failures) and failures[0].batch_idx == split and recovery.k > 1
    result["splits"] = sum(f.batch_idx == split for f in failures)
    per_batch, warmup = compiles.per_batch, schedule.warmup
    phases = {"first batch": per_batch[:1], "warm-up after the first": per_batch[1:warmup]}
    phases.update({"steady": per_batch[warmup:split], "split batch": per_batch[split : split + 1]})
    phases["after the split"] = per_batch[split + 1 :]
    # One frame compilation, whatever records dynamo keeps of it (forward, backward, aot): its compile id.
    frames = lambda records: len({c["compile_id"] for batch in records for c in batch})  # noqa: E731
    seconds = lambda records: sum(c["seconds"] or 0.0 for batch in records for c in batch)  # noqa: E731
    result["compilations"] = {p: {"frames": frames(r), "seconds": seconds(r)} for p, r in phases.items()}
    return result


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(workload: Workload, forms: list, backend: str, repeats: int, schedule: Schedule, precision: str):
    """Eager and compiled fits of one workload, interleaved over repeats; ratios per repeat, medians over them."""
    started, batches = time.perf_counter(), workload.batches()
    calibration = calibrate(workload, batches, precision)
    fraction = calibration["limit_fraction_of_activations"]
    fits: dict[str, list[dict[str, Any]]] = {"eager": [], **{form: [] for form in forms}}
    refused: dict[str, str] = {}
    longest = 0.0  # in a GPU check section, a fit that would not fit its slice is left out
    for repeat in range(repeats):
        for variant in ["eager", *forms][:: 1 if repeat % 2 == 0 else -1]:
            left = device.remaining()
            if variant in refused:
                continue
            if left is not None and left < 1.5 * longest:
                print(f"  {workload.name}, {variant}: left out, {left:.0f} s left in the slice", flush=True)
                continue
            device.check()
            form = None if variant == "eager" else variant
            r = run(workload, batches, schedule, fraction, precision, form, backend)
            if r["status"] == "refused":
                refused[variant] = r["reason"]
                why = f"skipped, OOMRecovery refuses it: {r['reason']}"
                print(f"  {workload.name}, {variant}: {why}", flush=True)
                continue
            fits[variant].append(r)
            longest = max(longest, r["wall_s"])
            print(f"  {workload.name}, {variant}: {_fit_line(r)}", flush=True)
    result = dict(description=workload.description, batch_size=workload.batch_size, calibration=calibration)
    result.update(eager={"fits": fits["eager"]}, forms={})
    for form in forms:
        if form in refused:
            result["forms"][form] = {"status": "refused", "reason": refused[form]}
        elif not fits[form]:
            why = "the time slice ran out before its first fit"
            result["forms"][form] = {"status": "left out", "reason": why}
        else:
            result["forms"][form] = compare(fits["eager"], fits[form])
    result["wall_s"] = time.perf_counter() - started
    return result


def compare(eager: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one form: compiled over eager per repeat (pairs of fits that both ran), and dynamo's records."""
    pairs = [(e, c) for e, c in zip(eager, compiled) if e["status"] == c["status"] == "ran"]
    if not pairs:
        return dict(status="failed", errors=[f["error"] for f in [*eager, *compiled] if f["status"] != "ran"])

    def ratios(key: str) -> list[float]:
        return [c[key] / e[key] for e, c in pairs]

    def per_fit(phase: str, what: str) -> list[float]:
        return [c["compilations"][phase][what] for _, c in pairs]

    def extra_s(key: str, base: str) -> list[float]:
        """Seconds compiled takes over eager at batch ``key``, less its extra time at ``base``."""
        return [1e-3 * ((c[key] - e[key]) - (c[base] - e[base])) for e, c in pairs]

    split_frames, after_frames = per_fit("split batch", "frames"), per_fit("after the split", "frames")
    split_seconds = per_fit("split batch", "seconds")
    caused = [s + a for s, a in zip(split_frames, after_frames)]
    per_split = [n / c["splits"] for n, (_, c) in zip(caused, pairs) if c["splits"]]
    per_recompilation = [s / n for s, n in zip(split_seconds, split_frames) if n]
    # The split batch's extra time over eager, less the compiled fit's extra time on a batch at the split's k:
    # what is left is the recompilation (and the failed attempt's own compiled-vs-eager difference).
    by_timing = extra_s("split_ms", "after_ms")
    phases = (("k1", "steady_ms"), ("after_split", "after_ms"))
    medians = ((f"{v}_{k}", [p[i][key] for p in pairs]) for i, v in enumerate(VARIANTS) for k, key in phases)
    step_ms = {name: _median(values) for name, values in medians}
    recompilations = {"at_split": split_frames, "after_split": after_frames}
    recompilations["steady_before_split"] = per_fit("steady", "frames")
    recompilations["counted_by_the_pack"] = [c["pack_recompilations"] for _, c in pairs]
    recompilations["splits"] = [c["splits"] for _, c in pairs]
    recompilations.update(caused_by_split_median=_median(caused), per_split_median=_median(per_split))
    recompilations.update(seconds_per_recompilation=per_recompilation, split_batch_dynamo_s=split_seconds)
    recompilations["seconds_per_recompilation_median"] = _median(per_recompilation)
    recompilations["split_batch_by_timing_s"] = by_timing
    recompilations["split_batch_by_timing_s_median"] = _median(by_timing)
    first_s = per_fit("first batch", "seconds")
    first = dict(dynamo=first_s, dynamo_median=_median(first_s), frames=per_fit("first batch", "frames"))
    first["by_timing"] = extra_s("first_ms", "steady_ms")
    result = {"status": "ran", "repeats": len(pairs), "step_ms": step_ms}
    result["split_happened"] = all(c["split_happened"] and e["split_happened"] for e, c in pairs)
    result["final_k"] = {"eager": [e["final_k"] for e, _ in pairs]}
    result["final_k"]["compiled"] = [c["final_k"] for _, c in pairs]
    for name, key in (("ratio_k1", "steady_ms"), ("ratio_after_split", "after_ms")):
        result.update({name: ratios(key), f"{name}_median": _median(ratios(key))})
    result["ratio_split_batch"] = ratios("split_ms")
    return {**result, "first_compile_s": first, "recompilations": recompilations, "fits": compiled}


def _fit_line(r: dict[str, Any]) -> str:
    if r["status"] != "ran":
        return f"{r['status']}: {r.get('error')}"
    first, split = r["compilations"]["first batch"], r["compilations"]["split batch"]
    return (
        f"k=1 {r['steady_ms']:.1f} ms, split batch {r['split_ms']:.0f} ms, after {r['after_ms']:.1f} ms "
        f"(k {r['final_k']}, {r['failures']} OOM); compiled frames: first batch {first['frames']} "
        f"({first['seconds']:.1f} s), split batch {split['frames']} ({split['seconds']:.1f} s)"
    )


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}" if values else "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def _slash(values: list[Any]) -> str:
    return "/".join(map(str, values))


def report(results: dict[str, Any]) -> None:
    print(
        f"torch.compile ({results['backend']}) with OOMRecovery on {results['device']}, torch {results['torch']}, "
        f"Lightning {results['lightning']}; {results['repeats']} repeat(s), median [min-max]"
    )
    header = "model|form|eager k=1 ms|compiled/eager k=1|eager after split ms|compiled/eager after split|k|first compile s|recompiles (split)|pack counted|s per recompile|split extra s (timing)"
    rows = [header.split("|")]
    notes: dict[str, list[str]] = {}
    messages = []
    for name, w in results["models"].items():
        for form, f in w["forms"].items():
            if f["status"] == "failed":
                messages.append(f"{name}, {form}: FAILED: {'; '.join(str(e) for e in f['errors'])}")
            elif f["status"] != "ran":
                what = "OOMRecovery refuses it at setup" if f["status"] == "refused" else "left out"
                notes.setdefault(f"not measured, {what}: {f['reason']}", []).append(f"{name} {form}")
            if f["status"] != "ran":
                rows.append([name, form, f["status"], *["-"] * 9])
                continue
            r, ms = f["recompilations"], f["step_ms"]
            cells = [name, form, f"{ms['eager_k1']:.1f}", _spread(f["ratio_k1"])]
            cells += [f"{ms['eager_after_split']:.1f}", _spread(f["ratio_after_split"])]
            split = _slash(a + b for a, b in zip(r["at_split"], r["after_split"]))
            cells += [_slash(sorted(set(f["final_k"]["compiled"]))), _spread(f["first_compile_s"]["dynamo"])]
            cells += [split, _slash(r["counted_by_the_pack"]), _spread(r["seconds_per_recompilation"])]
            rows.append([*cells, _spread(r["split_batch_by_timing_s"])])
            if not f["split_happened"]:
                messages.append(f"{name}, {form}: {NO_SPLIT}")
            elif any(r["steady_before_split"]):
                messages.append(f"{name}, {form}: {STEADY_COMPILES}")
    common.print_table(rows)
    for message in [*messages, *(f"{', '.join(cases)}: {note}" for note, cases in notes.items())]:
        print(message)


NO_SPLIT = "no split happened at the limit (see calibration in the JSON)"
STEADY_COMPILES = "dynamo compiled during the steady batches too (before the split)"
FORM_NAMES = {"module": "compiled LightningModule", "submodule": "compiled submodule"}


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The check's ``compile`` section: one workload, eager and compiled in each form, an OOM forced mid-run."""
    quiet()
    name, schedule = sizes["model"], Schedule(**sizes["schedule"])
    workload = (cnn_workload if name == "cnn" else lm_workload)(**sizes[name])
    forms, backend = sizes["forms"], sizes["backend"]
    result = measure(workload, forms, backend, sizes["repeats"], schedule, sizes["precision"])
    figures, skipped = [], {}
    for form, f in result["forms"].items():
        label = f"{name}, {FORM_NAMES[form]} ({sizes['backend']})"
        if f["status"] in ("refused", "left out"):
            skipped[label] = f"{f['status']}: {f['reason']}"
            continue
        if f["status"] != "ran":
            what = f"{label}: eager and compiled fits"
            figures.append(figure(what, _slash(f["errors"]), "", "both run", False))
            continue
        r = f["recompilations"]
        per_split, by_timing = r["per_split_median"], r["split_batch_by_timing_s_median"]
        counts = (
            f"{r['caused_by_split_median']} for {_slash(r['splits'])} split(s) of the OOM batch; "
            f"{max(r['steady_before_split'])} in the steady batches before it; "
            f"the pack counted {_slash(r['counted_by_the_pack'])}"
        )
        k_after, met = _slash(sorted(set(f["final_k"]["compiled"]))), per_split is not None and per_split <= 1
        names = {
            "split": f"{label}: OOM at its batch, split and recovered (k after the split)",
            "k1": f"{label}: step time compiled / eager at k = 1",
            "after": f"{label}: step time compiled / eager after the split",
            "per split": f"{label}: recompilations the split caused, per split (dynamo's frame compilations: {counts})",
            "first": f"{label}: first compilation (dynamo)",
            "seconds": f"{label}: seconds per recompilation (dynamo; the split batch's extra time over eager: "
            f"{by_timing:.1f} s)",
        }
        figures += [
            figure(names["split"], k_after, "", "k > 1, run completes", f["split_happened"]),
            figure(names["k1"], f["ratio_k1_median"], "x", "reported"),
            figure(names["after"], f["ratio_after_split_median"], "x", "reported"),
            figure(names["per split"], per_split, "", "<= 1 per split", met),
            figure(names["first"], f["first_compile_s"]["dynamo_median"], "s", "reported"),
            figure(names["seconds"], r["seconds_per_recompilation_median"], "s", "reported"),
        ]
    return {"figures": figures, "details": result, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    quick = "one repeat, few steps (a smoke run)"
    parser = common.arguments(__doc__, "compile.json", quick=quick, repeats=(3, 1), device="auto")
    backend_help = "torch.compile backend: aot_eager (default on a CPU), inductor (CUDA)"
    parser.add_argument("--backend", help=backend_help)
    parser.add_argument("--models", default="cnn,transformer", help="comma-separated: cnn, transformer")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated: {', '.join(FORMS)}")
    args = parser.parse_args(argv)
    models, forms = ([x.strip() for x in text.split(",") if x.strip()] for text in (args.models, args.forms))
    if not models or any(m not in ("cnn", "transformer") for m in models):
        parser.error(f"--models must name cnn and/or transformer, got {','.join(models)}")
    if not forms or any(f not in FORMS for f in forms):
        parser.error(f"--forms must name {' and/or '.join(FORMS)}, got {','.join(forms)}")
    on_cuda = args.device == "cuda"
    backend = args.backend or ("inductor" if on_cuda else "aot_eager")
    precision = "bf16-mixed" if on_cuda else "32-true"
    quiet()
    repeats = args.repeats or (1 if args.quick else 3)
    schedule = Schedule(2, 3, 3) if args.quick else Schedule(3, 6, 6)
    if not on_cuda:
        torch.set_num_threads(1)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "compile",
        **common.environment(backend=backend, precision=precision, quick=args.quick, repeats=repeats),
        "device": torch.cuda.get_device_name(0) if on_cuda else "cpu (SimulatedMemory)",
        "schedule": {"warmup": schedule.warmup, "steady": schedule.steady, "after": schedule.after},
        "step_time": "on_train_batch_start to on_train_batch_end, synchronised; per fit the median of its batches",
        "models": {},
    }
    listed = workloads(args.device)
    with device.use(device.CudaDevice() if on_cuda else device.SimulatedDevice()):
        for name in models:
            print(f"{name}: calibration, then eager and compiled fits ({repeats} repeat(s)) ...", flush=True)
            results["models"][name] = measure(listed[name], forms, backend, repeats, schedule, precision)
    print()
    report(results)
    common.write_json(args.out, "compile.json", results, started)
    return int(any(f["status"] == "failed" for w in results["models"].values() for f in w["forms"].values()))


if __name__ == "__main__":
    sys.exit(main())
