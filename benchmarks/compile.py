"""torch.compile with OOMRecovery: step time compiled over eager at k = 1 and after a split, and what a split costs in compilation.

    python benchmarks/compile.py                        # CPU: a CNN and a small transformer, aot_eager, both forms
    python benchmarks/compile.py --quick                # smoke run, one repeat, few steps
    python benchmarks/compile.py --backend inductor     # inductor on a CPU (needs a C++ compiler; slower to compile)
    python benchmarks/compile.py --device cuda          # the default where CUDA is available: inductor, real OOM
    python benchmarks/compile.py --out DIR --repeats 5 --models transformer --forms module

For each workload (a small CNN with BatchNorm, and a small causal transformer LM, the models of the
OOM benchmarks) and each compiled form:

- ``submodule``: the network inside the LightningModule is compiled (``model.net = torch.compile(model.net)``;
  for the transformer, its ``nn.TransformerEncoder``), the form that always worked with OOMRecovery;
- ``module``: the LightningModule itself, ``trainer.fit(torch.compile(model))``, the way Lightning
  documents it. Where OOMRecovery refuses it at setup, the form is recorded as ``refused`` with its
  reason and skipped;

one fit runs eager and one compiled (``backend``, default ``aot_eager`` on a CPU and ``inductor`` on
CUDA), both with ``OOMRecovery()`` in the Trainer, each the same schedule of batches:

1. ``warmup`` batches at k = 1 (the compiled fit compiles on the first);
2. ``steady`` timed batches at k = 1;
3. one batch that runs out of memory: at its start the device's limit drops so that the full batch
   cannot fit and a split can (on a CPU :class:`~lightning_gpuopt.testing.SimulatedMemory`'s limit,
   on CUDA ``set_per_process_memory_fraction``). OOMRecovery retries it with more micro-batches,
   which the compiled fit must compile for;
4. ``after`` timed batches at the split's k.

The limit is calibrated, not guessed: two short eager fits at k = 1 and k = 4 (forced) give where
halfway between their peaks sits, as a fraction of the k = 1 step's activations (peak minus what a
step starts with). Each fit then sets its limit at that fraction of its own steady k = 1 step, so a
compiled step that needs less memory than the eager one (inductor fuses) still runs out.

Reported per workload and form, as ratios of the two fits of one repeat (interleaved: eager first,
then compiled, then the other way round), median over repeats:

- **step time** compiled / eager at k = 1 (the median steady step of each fit) and after the split
  (the median step at the split's k);
- **compile time** from dynamo's own records (``torch._dynamo.utils.get_compilation_metrics()``: every
  frame compiled, forward and backward, with its seconds): the first compilation, and each
  recompilation the split caused, with its seconds; and by timing, as a check on those: the split
  batch's extra time compiled over eager, less the compiled fit's extra time on a batch at the
  split's k (the retry's step itself);
- **recompilations the split caused**: frames dynamo compiled in the split batch and after, against
  those in the steady batches (none: the same compiled run without an OOM compiles nothing there).
  The pack's budget is one per split (docs/oom-recovery.md).

Step time is the wall clock from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
backward and optimizer step; the device synchronised at both ends). ``torch._dynamo.reset()`` runs
before every fit, so each compiled fit compiles from scratch (inductor's on-disk caches may still
make later repeats compile faster: the first repeat's compile times are reported too). On a CPU
it runs with one intra-op thread: other jobs on shared cores make more threads spin against each
other. Writes ``compile.json`` to ``--out``; exits 1 when a fit fails (a refused form is not a
failure). No timing target is enforced: CPU timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The GPU sections' device layer and models (gpu/device.py, gpu/oom.py), after what is on the path already.
for _path in (str(HERE / "gpu"), str(HERE)):
    if _path not in sys.path:
        sys.path.append(_path)

import device  # noqa: E402
import lightning  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from oom import CausalLM, Classifier, Cycle, LimitAt, StepRecord, _forced, _image_batches, _token_batches  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_gpuopt import OOMRecovery  # noqa: E402
from lightning_gpuopt.decisions import decisions  # noqa: E402

FORMS = ("submodule", "module")
CALIBRATION_K = 4
CALIBRATION_STEPS = 3

QUIET = {
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], pl.LightningModule]
    batches: Callable[[], list[tuple[Tensor, ...]]]
    batch_size: int
    #: The attribute holding the network that the ``submodule`` form compiles.
    submodule: str


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


def cnn(image_size: int, batch_size: int, arch: str = "tiny", num_classes: int = 10) -> Workload:
    name = "2-conv CNN with BatchNorm" if arch == "tiny" else f"torchvision {arch}"
    return Workload(
        "cnn",
        f"{name} on 3x{image_size}x{image_size}, {num_classes} classes, SGD momentum",
        lambda: Classifier(arch, num_classes),
        lambda: _image_batches(batch_size, size=image_size, num_classes=num_classes),
        batch_size,
        "net",
    )


def transformer(width: int, layers: int, heads: int, seq_len: int, vocab: int, batch_size: int) -> Workload:
    return Workload(
        "transformer",
        f"causal LM: nn.TransformerEncoder {layers} x {width} wide, {heads} heads, {seq_len} tokens, "
        f"vocab {vocab}, AdamW",
        lambda: CausalLM(vocab=vocab, width=width, heads=heads, layers=layers, seq_len=seq_len),
        lambda: _token_batches(batch_size, seq_len=seq_len, vocab=vocab),
        batch_size,
        "encoder",
    )


def workloads(device_kind: str) -> dict[str, Workload]:
    """Small on a CPU (steps of tens of milliseconds); on CUDA big enough for compiled kernels to matter."""
    if device_kind == "cuda":
        listed = [
            cnn(64, 128, arch="resnet18", num_classes=100),
            transformer(width=512, layers=4, heads=8, seq_len=256, vocab=8192, batch_size=32),
        ]
    else:
        listed = [
            cnn(32, 32),
            transformer(width=128, layers=2, heads=4, seq_len=64, vocab=512, batch_size=16),
        ]
    return {w.name: w for w in listed}


# ----------------------------------------------------------------------------- dynamo's records


def _compilation_metrics() -> list[Any]:
    from torch._dynamo.utils import get_compilation_metrics

    return list(get_compilation_metrics())


def _key(metrics: Any) -> tuple[Any, ...]:
    return (
        str(getattr(metrics, "compile_id", None)),
        getattr(metrics, "is_forward", None),
        getattr(metrics, "start_time_us", None) or getattr(metrics, "start_time", None),
    )


def compilation(metrics: Any) -> dict[str, Any]:
    """One of dynamo's compilation records as plain figures: which frame, forward or backward, seconds."""
    compile_id = getattr(metrics, "compile_id", None)
    seconds = getattr(metrics, "duration_us", None)
    seconds = seconds / 1e6 if seconds is not None else getattr(metrics, "entire_frame_compile_time_s", None)
    forward = getattr(metrics, "is_forward", None) is not False
    frame_compile_id = getattr(compile_id, "frame_compile_id", None)
    return {
        "compile_id": str(compile_id),
        "frame": getattr(metrics, "co_name", None),
        "forward": forward,
        #: A forward frame compiled again (its cache already held another graph): dynamo's recompilation.
        "recompile": forward and frame_compile_id is not None and frame_compile_id > 0,
        "seconds": seconds,
        "graph_ops": getattr(metrics, "graph_op_count", None),
        "failed": getattr(metrics, "fail_type", None),
    }


class CompileLog(pl.Callback):
    """Per batch, what dynamo compiled during it, read from its own compilation records."""

    def __init__(self) -> None:
        self.per_batch: list[list[dict[str, Any]]] = []
        self._seen: set[tuple[Any, ...]] = set()

    def on_train_start(self, *args: Any) -> None:
        self._seen = {_key(m) for m in _compilation_metrics()}

    def on_train_batch_end(self, *args: Any) -> None:
        new = [m for m in _compilation_metrics() if _key(m) not in self._seen]
        self._seen.update(_key(m) for m in new)
        self.per_batch.append([compilation(m) for m in new])


class LimitAtFraction(LimitAt):
    """At one batch, confines the device to a fraction of the way from a steady step's start to its peak.

    Both figures come from this fit's own steady k = 1 steps (``record``), so the limit follows the
    compiled step's memory when it differs from the eager one's.
    """

    def __init__(self, record: StepRecord, batch_idx: int, fraction: float, steady_from: int) -> None:
        super().__init__(batch_idx, 0)
        self.record, self.fraction, self.steady_from = record, fraction, steady_from

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch_idx:
            start = self.record.starts[-1]
            peak = max(self.record.peaks[self.steady_from :])
            self.limit_bytes = int(start + self.fraction * (peak - start))
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


# ----------------------------------------------------------------------------- fits


class Refused(Exception):
    """OOMRecovery refused the compiled form at setup (its message is the reason)."""


def _is_refusal(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and "torch.compile'd LightningModule" in str(err)


def _fit(
    workload: Workload,
    batches: list[tuple[Tensor, ...]],
    steps: int,
    callbacks: list[pl.Callback],
    precision: str,
    form: str | None = None,
    backend: str = "aot_eager",
) -> pl.Trainer:
    """One seeded fit, eager (``form=None``) or compiled in ``form``; raises :class:`Refused` on the refusal."""
    device.current().set_limit(None)
    torch._dynamo.reset()
    pl.seed_everything(0, verbose=False)
    model = workload.build()
    if form == "submodule":
        setattr(model, workload.submodule, torch.compile(getattr(model, workload.submodule), backend=backend))
    fitted = torch.compile(model, backend=backend) if form == "module" else model
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator=device.current().accelerator,
        callbacks=[device.Deadline(), *callbacks],
        precision=precision,
        **QUIET,
    )
    try:
        trainer.fit(fitted, DataLoader(Cycle(batches, steps), batch_size=None))
    except RuntimeError as err:
        if _is_refusal(err):
            raise Refused(str(err)) from err
        raise
    finally:
        device.current().set_limit(None)
    return trainer


def calibrate(workload: Workload, batches: list[tuple[Tensor, ...]], precision: str) -> dict[str, Any]:
    """Eager peaks at k = 1 and k = CALIBRATION_K, and where halfway between sits in a k = 1 step's activations."""
    peaks, starts = {}, {}
    for k in (1, CALIBRATION_K):
        record = StepRecord(collect_at=(CALIBRATION_STEPS - 1,))
        _fit(workload, batches, CALIBRATION_STEPS, [record, _forced(k)], precision)
        peaks[k], starts[k] = record.peaks[-1], record.starts[-1]
    start, peak_1, peak_k = starts[1], peaks[1], peaks[CALIBRATION_K]
    lowers = peak_k < 0.97 * peak_1
    return {
        "start_bytes": start,
        "peak_k1_bytes": peak_1,
        f"peak_k{CALIBRATION_K}_bytes": peak_k,
        "splitting_lowers_peak": lowers,
        "limit_fraction_of_activations": ((peak_1 + peak_k) / 2 - start) / (peak_1 - start)
        if lowers
        else None,
    }


def run(
    workload: Workload,
    batches: list[tuple[Tensor, ...]],
    schedule: Schedule,
    fraction: float | None,
    precision: str,
    form: str | None = None,
    backend: str = "aot_eager",
) -> dict[str, Any]:
    """One fit with OOMRecovery and its OOM at ``schedule.split_at`` (none when ``fraction`` is None)."""
    recovery = OOMRecovery(verbose=False)
    record, compiles = StepRecord(recovery), CompileLog()
    limit = (
        [LimitAtFraction(record, schedule.split_at, fraction, steady_from=schedule.warmup)]
        if fraction is not None
        else []
    )
    started = time.perf_counter()
    error, recompiled = None, []
    try:
        # The limit first: its gc and empty_cache are not part of the failing batch's time.
        trainer = _fit(
            workload, batches, schedule.steps, [*limit, record, compiles, recovery], precision, form, backend
        )
        recompiled = [d for d in decisions(trainer) if d.kind == "recompilation"]
    except Refused as err:
        return {"status": "refused", "reason": str(err)}
    except Exception as err:  # a failed fit is a result: report it, keep the other fits
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}"
    ms = [1e3 * s for s in record.seconds]
    split = schedule.split_at
    completed = error is None and len(ms) == schedule.steps
    result: dict[str, Any] = {
        "status": "ran" if completed else "failed",
        "error": error,
        "step_ms": ms,
        "k_per_batch": record.ks,
        "failures": len(recovery.failures),
        "failure_batches": [f.batch_idx for f in recovery.failures],
        "final_k": recovery.k,
        "limit_bytes": limit[0].limit_bytes if limit else None,
        "compilations_per_batch": compiles.per_batch,
        # What the pack itself counted (its decisions, read from dynamo's counters), beside dynamo's records above.
        "pack_recompilations": sum(int(d.data.get("frames", 1)) for d in recompiled),
        "pack_decisions": [f"batch {d.step}: {d.message}" for d in recompiled],
        "wall_s": time.perf_counter() - started,
    }
    if not completed:
        return result
    result.update(
        first_ms=ms[0],
        steady_ms=statistics.median(ms[schedule.warmup : split]),
        split_ms=ms[split],
        after_ms=statistics.median(ms[split + 1 :]),
        split_happened=bool(recovery.failures) and recovery.failures[0].batch_idx == split and recovery.k > 1,
    )
    phases = {
        "first batch": compiles.per_batch[:1],
        "warm-up after the first": compiles.per_batch[1 : schedule.warmup],
        "steady": compiles.per_batch[schedule.warmup : split],
        "split batch": compiles.per_batch[split : split + 1],
        "after the split": compiles.per_batch[split + 1 :],
    }
    result["compilations"] = {
        phase: {
            "frames": sum(c["forward"] for batch in batches_ for c in batch),
            "recompiles": sum(c["recompile"] for batch in batches_ for c in batch),
            "seconds": sum(c["seconds"] or 0.0 for batch in batches_ for c in batch),
        }
        for phase, batches_ in phases.items()
    }
    return result


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(
    workload: Workload,
    forms: list[str],
    backend: str,
    repeats: int,
    schedule: Schedule,
    precision: str,
) -> dict[str, Any]:
    """Eager and compiled fits of one workload, interleaved over repeats; ratios per repeat, medians over them."""
    started = time.perf_counter()
    batches = workload.batches()
    calibration = calibrate(workload, batches, precision)
    fraction = calibration["limit_fraction_of_activations"]
    fits: dict[str, list[dict[str, Any]]] = {"eager": [], **{form: [] for form in forms}}
    refused: dict[str, str] = {}
    longest = 0.0  # the longest fit so far: inside a GPU check section, a fit that would not fit its slice is left out
    for repeat in range(repeats):
        order = ["eager", *forms]
        for variant in order if repeat % 2 == 0 else order[::-1]:
            if variant in refused:
                continue
            left = device.remaining()
            if left is not None and left < 1.5 * longest:
                print(f"  {workload.name}, {variant}: left out, {left:.0f} s left in the slice", flush=True)
                continue
            device.check()
            r = run(
                workload,
                batches,
                schedule,
                fraction,
                precision,
                None if variant == "eager" else variant,
                backend,
            )
            if r["status"] == "refused":
                refused[variant] = r["reason"]
                print(
                    f"  {workload.name}, {variant}: skipped, OOMRecovery refuses it: {r['reason']}",
                    flush=True,
                )
                continue
            fits[variant].append(r)
            longest = max(longest, r["wall_s"])
            print(f"  {workload.name}, {variant}: {_fit_line(r)}", flush=True)
    result: dict[str, Any] = {
        "description": workload.description,
        "batch_size": workload.batch_size,
        "calibration": calibration,
        "eager": {"fits": fits["eager"]},
        "forms": {},
    }
    for form in forms:
        if form in refused:
            result["forms"][form] = {"status": "refused", "reason": refused[form]}
            continue
        if not fits[form]:
            result["forms"][form] = {
                "status": "left out",
                "reason": "the time slice ran out before its first fit",
            }
            continue
        result["forms"][form] = compare(fits["eager"], fits[form])
    result["wall_s"] = time.perf_counter() - started
    return result


def compare(eager: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one form: compiled over eager per repeat (pairs of fits that both ran), and dynamo's records."""
    pairs = [(e, c) for e, c in zip(eager, compiled) if e["status"] == c["status"] == "ran"]
    if not pairs:
        errors = [f["error"] for f in [*eager, *compiled] if f["status"] != "ran"]
        return {"status": "failed", "errors": errors, "fits": compiled}

    def ratios(key: str) -> list[float]:
        return [c[key] / e[key] for e, c in pairs]

    def per_fit(phase: str, what: str) -> list[float]:
        return [c["compilations"][phase][what] for _, c in pairs]

    # The split batch's extra time over eager, less the compiled fit's extra time on a batch at the split's k:
    # what is left is the recompilation (and the failed attempt's own compiled-vs-eager difference).
    recompile_by_timing = [
        1e-3 * ((c["split_ms"] - e["split_ms"]) - (c["after_ms"] - e["after_ms"])) for e, c in pairs
    ]
    first_by_timing = [
        1e-3 * ((c["first_ms"] - c["steady_ms"]) - (e["first_ms"] - e["steady_ms"])) for e, c in pairs
    ]
    split_frames = per_fit("split batch", "frames")
    after_frames = per_fit("after the split", "frames")
    split_seconds = per_fit("split batch", "seconds")
    return {
        "status": "ran",
        "repeats": len(pairs),
        "split_happened": all(c["split_happened"] and e["split_happened"] for e, c in pairs),
        "final_k": {"eager": [e["final_k"] for e, _ in pairs], "compiled": [c["final_k"] for _, c in pairs]},
        "step_ms": {
            "eager_k1": _median([e["steady_ms"] for e, _ in pairs]),
            "compiled_k1": _median([c["steady_ms"] for _, c in pairs]),
            "eager_after_split": _median([e["after_ms"] for e, _ in pairs]),
            "compiled_after_split": _median([c["after_ms"] for _, c in pairs]),
        },
        "ratio_k1": ratios("steady_ms"),
        "ratio_k1_median": _median(ratios("steady_ms")),
        "ratio_after_split": ratios("after_ms"),
        "ratio_after_split_median": _median(ratios("after_ms")),
        "ratio_split_batch": ratios("split_ms"),
        "first_compile_s": {
            "dynamo": per_fit("first batch", "seconds"),
            "dynamo_median": _median(per_fit("first batch", "seconds")),
            "frames": per_fit("first batch", "frames"),
            "by_timing": first_by_timing,
        },
        "recompilations": {
            "at_split": split_frames,
            "after_split": after_frames,
            "steady_before_split": per_fit("steady", "frames"),
            "counted_by_the_pack": [c["pack_recompilations"] for _, c in pairs],
            "caused_by_split_median": _median([s + a for s, a in zip(split_frames, after_frames)]),
            "seconds_per_recompilation": [s / n for s, n in zip(split_seconds, split_frames) if n],
            "seconds_per_recompilation_median": _median(
                [s / n for s, n in zip(split_seconds, split_frames) if n]
            ),
            "split_batch_dynamo_s": split_seconds,
            "split_batch_by_timing_s": recompile_by_timing,
            "split_batch_by_timing_s_median": _median(recompile_by_timing),
        },
        "fits": compiled,
    }


# ----------------------------------------------------------------------------- report


def _fit_line(r: dict[str, Any]) -> str:
    if r["status"] != "ran":
        return f"{r['status']}: {r.get('error')}"
    c = r["compilations"]
    return (
        f"k=1 {r['steady_ms']:.1f} ms, split batch {r['split_ms']:.0f} ms, after {r['after_ms']:.1f} ms "
        f"(k {r['final_k']}, {r['failures']} OOM); compiled frames: first batch {c['first batch']['frames']} "
        f"({c['first batch']['seconds']:.1f} s), split batch {c['split batch']['frames']} "
        f"({c['split batch']['seconds']:.1f} s)"
    )


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def table_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [
        (
            "model",
            "form",
            "eager k=1 ms",
            "compiled/eager k=1",
            "eager after split ms",
            "compiled/eager after split",
            "k",
            "first compile s",
            "recompiles (split)",
            "pack counted",
            "s per recompile",
            "split extra s (timing)",
        )
    ]
    for name, w in results["models"].items():
        for form, f in w["forms"].items():
            if f["status"] != "ran":
                rows.append((name, form, f["status"], *["-"] * 9))
                continue
            r = f["recompilations"]
            rows.append(
                (
                    name,
                    form,
                    f"{f['step_ms']['eager_k1']:.1f}",
                    _spread(f["ratio_k1"]),
                    f"{f['step_ms']['eager_after_split']:.1f}",
                    _spread(f["ratio_after_split"]),
                    "/".join(str(k) for k in sorted(set(f["final_k"]["compiled"]))),
                    _spread(f["first_compile_s"]["dynamo"]),
                    "/".join(str(a + b) for a, b in zip(r["at_split"], r["after_split"])),
                    "/".join(str(n) for n in r["counted_by_the_pack"]),
                    _spread(r["seconds_per_recompilation"]),
                    _spread(r["split_batch_by_timing_s"]),
                )
            )
    return rows


def print_table(results: dict[str, Any]) -> None:
    print(
        f"torch.compile ({results['backend']}) with OOMRecovery on {results['device']}, torch {results['torch']}, "
        f"Lightning {results['lightning']}; {results['repeats']} repeat(s), median [min-max]"
    )
    rows = table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    notes: dict[str, list[str]] = {}
    for name, w in results["models"].items():
        for form, f in w["forms"].items():
            if f["status"] in ("refused", "left out"):
                what = "OOMRecovery refuses it at setup" if f["status"] == "refused" else "left out"
                notes.setdefault(f"not measured, {what}: {f['reason']}", []).append(f"{name} {form}")
            elif f["status"] == "failed":
                print(f"{name}, {form}: FAILED: {'; '.join(str(e) for e in f['errors'])}")
            elif not f["split_happened"]:
                print(f"{name}, {form}: no split happened at the limit (see calibration in the JSON)")
            elif any(f["recompilations"]["steady_before_split"]):
                print(f"{name}, {form}: dynamo compiled during the steady batches too (before the split)")
    for note, cases in notes.items():
        print(f"{', '.join(cases)}: {note}")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for compile.json"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu (SimulatedMemory forces the OOM) or cuda (a real OOM); default cuda where available",
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend: aot_eager (default on a CPU), inductor (default on CUDA), eager, ...",
    )
    parser.add_argument("--models", default="cnn,transformer", help="comma-separated: cnn, transformer")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated: {', '.join(FORMS)}")
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved repeats (default 3; --quick: 1)"
    )
    parser.add_argument("--quick", action="store_true", help="one repeat, few steps (a smoke run)")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = [m for m in args.models if m not in ("cnn", "transformer")]
    if unknown or not args.models:
        parser.error(f"--models must name cnn and/or transformer, got {','.join(args.models)}")
    if not args.forms or any(f not in FORMS for f in args.forms):
        parser.error(f"--forms must name {' and/or '.join(FORMS)}, got {','.join(args.forms)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be a positive int, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: no CUDA device visible (torch.cuda.is_available() is False); use --device cpu"
        )
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    return args


def quiet() -> None:
    """Lightning's and dynamo's chatter off (the benchmark prints its own lines)."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gpuopt"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*TF32.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # SimulatedMemory's global module hooks (the CPU stand-in for the device) make torch.compile say so.
    warnings.filterwarnings("ignore", message=r".*torch.compile\(module\)` when there are global hooks.*")
    os.environ.setdefault("LIGHTNING_DISABLE_TIPS", "1")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    repeats = args.repeats or (1 if args.quick else 3)
    schedule = Schedule(warmup=2, steady=3, after=3) if args.quick else Schedule(warmup=3, steady=6, after=6)
    on_cuda = args.device == "cuda"
    if not on_cuda:
        torch.set_num_threads(1)
    precision = "bf16-mixed" if on_cuda else "32-true"
    started = time.perf_counter()
    the_device = device.CudaDevice() if on_cuda else device.SimulatedDevice()
    results: dict[str, Any] = {
        "benchmark": "compile",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if on_cuda else "cpu (SimulatedMemory)",
        "backend": args.backend,
        "precision": precision,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "repeats": repeats,
        "schedule": {"warmup": schedule.warmup, "steady": schedule.steady, "after": schedule.after},
        "step_time": "on_train_batch_start to on_train_batch_end, synchronised; per fit the median of its batches",
        "models": {},
    }
    listed = workloads(args.device)
    with device.use(the_device):
        for name in args.models:
            print(f"{name}: calibration, then eager and compiled fits ({repeats} repeat(s)) ...", flush=True)
            results["models"][name] = measure(
                listed[name], args.forms, args.backend, repeats, schedule, precision
            )
    results["wall_s"] = time.perf_counter() - started
    print()
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "compile.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {path} ({results['wall_s']:.0f} s)")
    failed = any(f["status"] == "failed" for w in results["models"].values() for f in w["forms"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
