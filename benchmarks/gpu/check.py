"""Every GPU check in one budgeted call: one process, one CUDA start-up, one table of time slices.

    bash benchmarks/gpu_check.sh all OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]

(which runs ``python -m gpu.check OUT_DIR ...`` with the repository root and ``benchmarks/`` on
``PYTHONPATH``). :data:`SECTIONS` gives each section its time slice (of the default 300 s budget, scaled to
``--budget``), its sizes on the GPU and its tiny sizes for ``--dry-run`` (the same code on the CPU with
SimulatedMemory; what only CUDA can run is skipped with its reason). A section runs under a memory cap of
at most 16 GiB and stops at its next batch or loop boundary once past its slice (``over_slice``; a watchdog
interrupts one that reaches none). Writes ``gpu_check.json`` and ``gpu_check.md``. Exit status: 0 when every
section ran (targets met or not: the table says), 1 when one did not, 2 on bad usage or no CUDA device.
"""

from __future__ import annotations

import argparse
import os
import pkgutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import environment, figure, quiet, write_json

from gpu import device

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BUDGET_S = 300.0
GRACE_S = 20.0


@dataclass(frozen=True)
class Section:
    """One row of the table: what it measures, its share of the budget, its sizes on a GPU and in the dry run."""

    name: str
    what: str
    slice_s: float
    #: ``"module:function"`` under ``benchmarks/`` (imported when the section runs), or the function itself.
    run: Any
    sizes: dict[str, Any] = field(default_factory=dict)
    dry_sizes: dict[str, Any] = field(default_factory=dict)
    #: Why the dry run skips it (``None``: it runs on the CPU with the dry sizes).
    cuda_only: str | None = None

    def function(self) -> Any:
        return self.run if callable(self.run) else pkgutil.resolve_name(self.run)


def cuda_tests(sizes: dict[str, Any]) -> dict[str, Any]:
    """The ``cuda``-marked tests, in a child pytest (its own collection; a crash there cannot end this run)."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    command += [f"--junitxml={Path(sizes['out']) / 'cuda_tests.xml'}", str(REPO / "tests")]
    remaining = sizes["slice_s"] - 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=remaining, env=env)
    except subprocess.TimeoutExpired as err:
        raise device.SliceOver(f"pytest -m cuda still running after {remaining:.0f} s") from err
    summary = (done.stdout.strip().splitlines()[-1:] or [""])[0]
    return {
        "figures": [figure("pytest -m cuda", summary, target="all pass", met=done.returncode == 0)],
        "details": {"returncode": done.returncode, "output_tail": done.stdout[-4000:] + done.stderr[-2000:]},
    }


_GPT2 = {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "seq": 1024}
_GPT_TINY = {"layers": 2, "width": 32, "heads": 2, "vocab": 128, "seq": 16}
# Batches whose unlimited step fits well under the 16 GiB cap (ResNet-50 fp32 at 224: ~0.1 GB a sample); the
# dry run's CNN would run the same code: one model is enough on a CPU.
_OOM = {"models": ["resnet50", "transformer"], "batch": {"resnet50": 96, "transformer": 32}}
_OOM_DRY = {"models": ["transformer"], "batch": {}}
_BATCHSIZE, _BATCHSIZE_DRY = {"models": ["lm"], "multiple_of": 8}, {"models": ["lm"], "multiple_of": 1}
# 32,000 sequences (3.0M tokens): the budget auto chooses under a 12 GiB limit (~70k tokens, from predict_peak's
# ~150 KB a token) gives ~45 batches an epoch, padding ~5 % (2,000 sequences at that budget: 30 %); the 4 GiB left
# to the 16 GiB cap hold the speed arms' other two models beside the auto batch. The dry run: a 32 MiB device.
_TOKENS = dict(samples=32000, vocab=8192, width=512, heads=8, layers=4, precision="bf16-mixed", fixed=64)
_TOKENS.update(target_fraction=0.9, limit_bytes=12 * 2**30, steps=20, warmup=2)
_TOKENS_DRY = dict(samples=300, vocab=256, width=32, heads=2, layers=1, precision="32-true", fixed=8)
_TOKENS_DRY.update(target_fraction=0.9, limit_bytes=32 * 2**20, steps=5, warmup=0)
_DATA, _DATA_DRY = {"repeats": 1, "steps": 20, "batch": 128}, {"repeats": 1, "steps": 2, "batch": 2}
_PREDICT = {"batches": [16], "precisions": ["32-true", "bf16-mixed"]}
_PRECISION = dict(_GPT2, layers=6, seq=512, batch=16, steps=12, warmup=4, repeats=2)
_PRECISION_DRY = dict(_GPT_TINY, batch=4, steps=3, warmup=1, repeats=1)
_MFU = dict(_GPT2, batch=8, steps=25, warmup=5, mfu_target=0.30)
_MFU_DRY = dict(_MFU, **_GPT_TINY, batch=4, steps=4, warmup=2, nominal_peak_flops=1e12)
_MFU_DRY["default_job"] = {"batch": 8, "steps": 2, "warmup": 1, "image_size": 8}
_MFU["default_job"] = {"batch": 64, "steps": 40, "warmup": 10, "image_size": 32}
_PAIRS = dict(_GPT2, layers=4, seq=512, batch=8, steps=30, warmup=5, repeats=10, min_repeats=3)
_PAIRS_DRY = dict(_GPT_TINY, batch=4, steps=3, warmup=1, repeats=2, min_repeats=2, precision="32-true")
_OVERHEAD = dict(_PAIRS, precision="bf16-mixed", target_percent=2.0)
_OVERHEAD_DRY = dict(_PAIRS_DRY, target_percent=2.0)
_GOODPUT = dict(_PAIRS, precision="bf16-mixed", steps=41, warmup=1, every=10, estimate_steps=60)
_GOODPUT.update(repeats=4, min_repeats=2, target_percent=1.0)
_GOODPUT_DRY = dict(_PAIRS_DRY, every=2, estimate_steps=6, target_percent=1.0, steps=5)
_FORENSICS = dict(min_repeats=1, layers=4, width=512, heads=8, vocab=8192, seq=256, batch=16)
_FORENSICS.update(precision="bf16-mixed", warmup=3, after=3, steps=20, repeats=4)
_FORENSICS_DRY = dict(_GPT_TINY, min_repeats=1, layers=1, batch=4, precision="32-true", warmup=2, after=2)
_FORENSICS_DRY.update(steps=4, repeats=1)
_FORMS = {"forms": ["module", "submodule"], "repeats": 1}
_LM = {"width": 512, "layers": 1, "heads": 8, "seq_len": 256, "vocab": 8192, "batch_size": 32}
# Inductor compiles for tens of seconds: one small transformer, one repeat. A form the slice has no time left
# for is listed as skipped.
_COMPILE = dict(model="transformer", transformer=_LM, **_FORMS, backend="inductor", precision="bf16-mixed")
_COMPILE["schedule"] = {"warmup": 3, "steady": 5, "after": 5}
_COMPILE_DRY = dict(model="cnn", cnn={"image_size": 16, "batch_size": 32}, **_FORMS, backend="aot_eager")
_COMPILE_DRY.update(precision="32-true", schedule={"warmup": 2, "steady": 2, "after": 2})
_NO_CUDA_TESTS = "pytest -m cuda skips every test on a machine without CUDA: nothing to prove on a CPU"
_NO_CUDA_ALLOCATOR = (
    "max_memory_allocated is CUDA's caching allocator; on a CPU the prediction is checked against "
    "SimulatedMemory in tests/memory/test_predict.py"
)
#: What each section measures (a row's ``what``).
_WHAT = {
    "cuda_tests": "the cuda-marked tests (pytest -m cuda)",
    "oom": "real OOM recovery: ResNet-50 and a causal transformer under a memory limit",
    "batchsize": "MemoryAwareBatchSize against the bisected true maximum",
    "tokens": (
        "batches by tokens: the budget max_tokens='auto' chooses, its costliest batch's peak, padding, real "
        "tokens/s against fixed batches of 64 at the same worst-case batch"
    ),
    "precision": "PrecisionSwitch auto against 32-true, TF32, bf16-mixed",
    "data": "data pipeline with and without device prefetch",
    "mfu": "MFU and tokens/s of a GPT-2-124M-shaped model (bf16-mixed, seq 1024); the default job's samples/s",
    "overhead": "OOMRecovery at k = 1 against plain Lightning (steady state)",
    "goodput": (
        "the gradient noise scale of the GPT-2-shaped model; GradientNoiseScale's steady-state step-time cost "
        "against OOMRecovery at k = 1"
    ),
    "forensics": (
        "the OOM record against a real CUDA OOM and memory_snapshot; the snapshot pickle; the history ring "
        "buffer's step-time cost"
    ),
    "predict": "predict_peak against max_memory_allocated and max_memory_reserved (MLP, ResNet-18, tiny GPT-2)",
    "compile": (
        "torch.compile with OOMRecovery: compiled / eager step time at k = 1 and after a real OOM's split, "
        "the recompilations the split caused and their seconds"
    ),
}

#: The one table: section -> slice of the default 300 s budget, sizes on the GPU, sizes in the dry run.
#: A later GPU figure adds a row here with its own slice, inside the same total. The slices follow the first
#: H200 run (2026-12-04: 158 s of 300), with room for both compiled forms (inductor: ~25 s a form);
#: ``forensics`` (15 s) took 5 s each from ``mfu`` (used 9 s), ``batchsize`` (used 20 s) and ``overhead`` (which
#: runs pairs of fits while its slice has room); ``goodput`` (20 s) took 10 s from ``overhead`` (pairs while room) and
#: 5 s each from ``batchsize`` (used 20 s) and ``precision``; ``tokens`` (20 s, ~10 s estimated: two short fits'
#: worth of steps, its speed arms stop with 3 s left) took 10 s each from ``cuda_tests`` (was 40 s: a child pytest of
#: 8 small tests, ~14 s of collection and start-up on a 2-core CPU) and ``oom`` (was 50 s). ``batchsize`` holds sizes
#: to the pack's default multiple on CUDA (8).
_ROWS = (
    Section("cuda_tests", _WHAT["cuda_tests"], 30, cuda_tests, cuda_only=_NO_CUDA_TESTS),
    Section("oom", _WHAT["oom"], 40, "gpu.oom:section", _OOM, _OOM_DRY),
    Section("batchsize", _WHAT["batchsize"], 20, "gpu.batchsize:section", _BATCHSIZE, _BATCHSIZE_DRY),
    Section("tokens", _WHAT["tokens"], 20, "gpu.tokens:section", _TOKENS, _TOKENS_DRY),
    Section("precision", _WHAT["precision"], 20, "gpu.speed:precision_section", _PRECISION, _PRECISION_DRY),
    Section("data", _WHAT["data"], 15, "data_pipeline:gpu_section", _DATA, _DATA_DRY),
    Section("mfu", _WHAT["mfu"], 15, "gpu.speed:mfu_section", _MFU, _MFU_DRY),
    Section("overhead", _WHAT["overhead"], 15, "gpu.speed:overhead_section", _OVERHEAD, _OVERHEAD_DRY),
    Section("goodput", _WHAT["goodput"], 20, "gpu.speed:goodput_section", _GOODPUT, _GOODPUT_DRY),
    Section("forensics", _WHAT["forensics"], 15, "gpu.forensics:section", _FORENSICS, _FORENSICS_DRY),
    Section("predict", _WHAT["predict"], 10, "gpu.predict:section", _PREDICT, cuda_only=_NO_CUDA_ALLOCATOR),
    Section("compile", _WHAT["compile"], 80, "compile:section", _COMPILE, _COMPILE_DRY),
)
SECTIONS: dict[str, Section] = {s.name: s for s in _ROWS}


class Watchdog:
    """Interrupts the main thread when a section overruns its slice by more than the grace period."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        # A real SIGINT to the main thread: it also wakes a blocking call (sleep, a wait on a queue).
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def run_section(section: Section, slice_s: float, dry_run: bool, out: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"section": section.name, "what": section.what, "slice_s": round(slice_s, 1)}
    if dry_run and section.cuda_only:
        record.update(status="skipped", reason=section.cuda_only, figures=[], wall_s=0.0)
        return record
    sizes = {**(section.dry_sizes if dry_run else section.sizes), "out": str(out), "slice_s": slice_s}
    the_device = device.SimulatedDevice() if dry_run else device.CudaDevice()
    record["memory_cap_bytes"] = the_device.cap_bytes
    started = time.perf_counter()
    print(f"gpu_check: {section.name} (slice {slice_s:.0f} s) ...", flush=True)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watchdog = Watchdog(slice_s + GRACE_S)
    try:
        with watchdog, device.deadline(slice_s), device.use(the_device):
            record.update(status="ran", **section.function()(sizes))
    except device.SliceOver as err:
        record.update(status="over_slice", error=str(err))
    except (KeyboardInterrupt, SystemExit) as err:
        if not watchdog.fired:  # the watchdog's interrupt (Lightning turns it into an exit) is an overrun
            record.update(status="interrupted", error=repr(err))
            raise
        record.update(status="over_slice", error=f"{type(err).__name__}: stopped by the watchdog")
    except Exception as err:
        traceback.print_exc()
        record.update(status="error", error=f"{type(err).__name__}: {err}")
    finally:
        signal.signal(signal.SIGINT, previous)
    record.setdefault("figures", [])
    record["wall_s"] = round(time.perf_counter() - started, 2)
    print(f"gpu_check: {section.name}: {record['status']} in {record['wall_s']:.1f} s", flush=True)
    return record


def _value(figure: dict[str, Any]) -> str:
    value = figure["value"]
    if value is None:
        return "n/a"
    if isinstance(value, float):
        value = f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value} {figure['unit']}".strip()


def markdown(results: dict[str, Any]) -> str:
    dry = ", DRY RUN on CPU with SimulatedMemory" if results["dry_run"] else ""
    lines = [
        f"GPU check of {results['date']} on **{results['device']}** (torch {results['torch']}, Lightning "
        f"{results['lightning']}{dry}); budget {results['budget_s']:.0f} s, took {results['wall_s']:.0f} s.",
        "",
        "| section | figure | value | target | met |",
        "|---|---|---|---|---|",
    ]
    for s in results["sections"]:
        if s["status"] != "ran":
            reason = s.get("reason") or s.get("error") or ""
            lines.append(
                f"| {s['section']} | *{s['status']}* ({s['wall_s']:.0f} s of {s['slice_s']:.0f}) | {reason} | | |"
            )
        for f in s["figures"]:
            met = {True: "yes", False: "**no**", None: ""}[f["met"]]
            lines.append(f"| {s['section']} | {f['name']} | {_value(f)} | {f['target'] or ''} | {met} |")
        for what, why in (s.get("skipped") or {}).items():
            lines.append(f"| {s['section']} | {what} | skipped: {why} | | |")
    return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="folder for gpu_check.json and gpu_check.md")
    budget = "seconds for all sections (default 300)"
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help=budget)
    parser.add_argument(
        "--only", default="", help=f"comma-separated sections to run (of: {', '.join(SECTIONS)})"
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU with SimulatedMemory and tiny sizes")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(
            f"--only: unknown section(s) {', '.join(unknown)}; the sections are {', '.join(SECTIONS)}"
        )
    args.sections = only or list(SECTIONS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device visible (torch.cuda.is_available() is False); use --dry-run on a CPU",
            file=sys.stderr,
        )
        return 2
    quiet()
    if args.dry_run:
        # Tiny ops on a shared CPU: one intra-op thread, or threads spin against each other (10x slower).
        torch.set_num_threads(1)
    else:
        torch.cuda.init()  # once, for every section
    args.out.mkdir(parents=True, exist_ok=True)
    scale = args.budget / sum(s.slice_s for s in SECTIONS.values())
    results: dict[str, Any] = {
        **environment(),
        "device": "cpu (dry run, SimulatedMemory)" if args.dry_run else torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "dry_run": args.dry_run,
        "budget_s": args.budget,
        "table": {n: {"slice_s": round(s.slice_s * scale, 1), "what": s.what} for n, s in SECTIONS.items()},
        "sections": [],
    }
    for section in (SECTIONS[name] for name in args.sections):
        results["sections"].append(run_section(section, section.slice_s * scale, args.dry_run, args.out))
    results["wall_s"] = round(time.perf_counter() - started, 2)
    results["every_section_ran"] = all(s["status"] in ("ran", "skipped") for s in results["sections"])
    write_json(args.out, "gpu_check.json", _plain(results))
    (args.out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    print(f"gpu_check: wrote {args.out / 'gpu_check.json'} and gpu_check.md ({results['wall_s']:.0f} s)")
    return 0 if results["every_section_ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
