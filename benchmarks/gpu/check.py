"""Every GPU check in one budgeted call: one process, one CUDA start-up, one table of time slices.

    bash benchmarks/gpu_check.sh all OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]
    python benchmarks/gpu/check.py OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]

:data:`SECTIONS` is the one table: each section's time slice (of the default 300 s budget, scaled
to ``--budget``), its sizes on the GPU and its tiny sizes for ``--dry-run``. A section runs under its
memory cap (``set_per_process_memory_fraction``, at most 16 GiB) and stops at the next batch or loop
boundary once past its slice, recorded as ``over_slice``; the others still run (a watchdog interrupts
a section that does not reach a boundary within a grace period). ``--dry-run`` runs the same code on
the CPU with SimulatedMemory standing in for the device and tiny sizes; what only CUDA can run is
skipped with its reason in the JSON.

Writes ``gpu_check.json`` and ``gpu_check.md`` (date, device, torch and Lightning versions, then
every figure with its target and whether it was met). Exit status: 0 when every section ran
(targets met or not: the table says), 1 when one did not (error, over its slice), 2 on bad usage or,
without ``--dry-run``, no CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(HERE), str(HERE.parent), str(REPO)):  # gpu/ sections, benchmarks/ scripts, the package
    if path not in sys.path:
        sys.path.append(
            path
        )  # after what is there: a test session importing this keeps its own modules first

import device  # noqa: E402
import lightning  # noqa: E402
import torch  # noqa: E402

DEFAULT_BUDGET_S = 300.0
GRACE_S = 20.0


@dataclass(frozen=True)
class Section:
    """One row of the table: what it measures, its share of the budget, its sizes on a GPU and in the dry run."""

    name: str
    what: str
    slice_s: float
    run: Callable[[dict[str, Any]], dict[str, Any]]
    sizes: dict[str, Any] = field(default_factory=dict)
    dry_sizes: dict[str, Any] = field(default_factory=dict)
    #: Why the dry run skips it (``None``: it runs on the CPU with the dry sizes).
    cuda_only: str | None = None


# ----------------------------------------------------------------------------- the sections


def cuda_tests(sizes: dict[str, Any]) -> dict[str, Any]:
    """The ``cuda``-marked tests, in a child pytest (its own collection; a crash there cannot end this run)."""
    junit = Path(sizes["out"]) / "cuda_tests.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    remaining = sizes["slice_s"] - 2
    try:
        done = subprocess.run(
            [*command, str(REPO / "tests")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=remaining,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
    except subprocess.TimeoutExpired as err:
        raise device.SliceOver(f"pytest -m cuda still running after {remaining:.0f} s") from err
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    summary = tail[0]
    return {
        "figures": [
            {
                "name": "pytest -m cuda",
                "value": summary,
                "unit": "",
                "target": "all pass",
                "met": done.returncode == 0,
            }
        ],
        "details": {"returncode": done.returncode, "output_tail": done.stdout[-4000:] + done.stderr[-2000:]},
    }


def oom_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """Real OOM recovery on a ResNet-50-size CNN and a small causal transformer (see oom.py)."""
    import oom

    on_cuda = device.current().kind == "cuda"
    figures, details = [], {}
    with oom.exact_fp32():
        for name in sizes["models"]:
            device.check()
            workload = oom.sized(name, sizes["batch"][name]) if on_cuda else oom.DRY_WORKLOADS[name]
            r = oom.check_workload(workload)
            details[name] = r
            params, memory = r.get("parameters", {}), r.get("memory", {})
            figures.append(
                {
                    "name": f"{name}: OOM retries, final k",
                    "value": f"{r.get('retries')} retries, k {r.get('final_k')}",
                    "unit": "",
                    "target": "real OOM at its batch, run completes",
                    "met": all(
                        r["checks"].get(c, False)
                        for c in ("completed", "real_oom_of_the_device", "limit_forced_the_oom_at_its_batch")
                    ),
                }
            )
            figures.append(
                {
                    "name": f"{name}: parameters vs unlimited reference (rel. error; spread of two unlimited runs "
                    f"{params.get('reference_spread', float('nan')):.1e})",
                    "value": params.get("max_rel_error"),
                    "unit": "",
                    "target": f"<= {params.get('tolerance', float('nan')):.1e}",
                    "met": r["checks"].get("parameters_match_reference", False),
                }
            )
            figures.append(
                {
                    "name": f"{name}: memory_allocated after recovery vs pre-OOM",
                    "value": None if not memory else 100 * memory["relative_change"],
                    "unit": "%",
                    "target": "<= +1 %",
                    "met": r["checks"].get("memory_returns_to_pre_oom", False),
                }
            )
    return {"figures": figures, "details": details}


def batchsize_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """MemoryAwareBatchSize against the true maximum from a short bisection of real runs (see batchsize.py)."""
    import batchsize

    workloads = batchsize.DRY_WORKLOADS if device.current().kind != "cuda" else batchsize.WORKLOADS
    figures, details = [], {}
    for name in sizes["models"]:
        device.check()
        r = batchsize.check_workload(workloads[name])
        details[name] = r
        figures.append(
            {
                "name": f"{name}: MemoryAwareBatchSize(mode='max') found / true maximum",
                "value": f"{r['max_mode']['found']} / {r['true_max']}",
                "unit": "",
                "target": "90-100 %",
                "met": r["checks"]["max_mode: found within 90-100 % of the true maximum"],
            }
        )
        for mode in ("max_mode", "micro_mode"):
            error = r[mode]["peak_error"]
            figures.append(
                {
                    "name": f"{name}: {mode.replace('_', ' ')} predicted vs measured peak",
                    "value": None if error is None else 100 * error,
                    "unit": "%",
                    "target": "<= 5 %",
                    "met": r["checks"][f"{mode}: predicted peak within 5% of measured"],
                }
            )
    return {"figures": figures, "details": details}


def data_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The data pipeline with and without device prefetch (see benchmarks/data_pipeline.py)."""
    import data_pipeline

    on_cuda = device.current().kind == "cuda"
    runs = data_pipeline.measure(
        "cuda" if on_cuda else "cpu",
        sizes["repeats"],
        sizes["steps"],
        sizes["batch"],
        sizes.get("standin_ms", 0.0),
    )
    figures = [
        {
            "name": f"data pipeline, {name}: samples/s",
            "value": r["samples_per_s"]["median"],
            "unit": "samples/s",
            "target": None,
            "met": None,
        }
        for name, r in runs.items()
    ]
    defaults = runs["defaults"]
    figures.append(
        {
            "name": "data pipeline: defaults over naive settings",
            "value": defaults["speedup_vs_naive"]["median"],
            "unit": "x",
            "target": "> 1",
            "met": defaults["speedup_vs_naive"]["median"] > 1 if on_cuda else None,
        }
    )
    skipped = {}
    if "defaults, no device prefetch" in runs:
        figures.append(
            {
                "name": "data pipeline: device prefetch gain (defaults over defaults without it)",
                "value": defaults["samples_per_s"]["median"]
                / runs["defaults, no device prefetch"]["samples_per_s"]["median"],
                "unit": "x",
                "target": "reported",
                "met": None,
            }
        )
    else:
        skipped["device prefetch"] = (
            "device prefetch copies on a CUDA side stream; a CPU run has no device copy"
        )
    for r in runs.values():
        r.pop("fits", None)
    return {"figures": figures, "details": runs, "skipped": skipped}


def predict_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """predict_peak against max_memory_allocated (+-5 %) and max_memory_reserved (at most 15 % under)."""
    import predict

    result = predict.check(
        str(Path(sizes["out"]) / "predict"), tuple(sizes["batches"]), tuple(sizes["precisions"])
    )
    figures = [
        {
            "name": f"predicted peak vs max_memory_allocated, {r['model']} {r['precision']} batch {r['batch']}",
            "value": r["error_allocated"],
            "unit": "relative error",
            "target": f"within +-{predict.ALLOCATED_BAND:.0%}, at most {predict.RESERVED_UNDER:.0%} under reserved",
            "met": r["ok"],
        }
        for r in result["rows"]
    ]
    return {"figures": figures, "details": result, "skipped": {}}


def compile_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """torch.compile with OOMRecovery: compiled over eager at k = 1 and after a split, recompilations (see compile.py)."""
    import importlib.util

    # Loaded by path: `import compile` could find benchmarks/compile.py, the script this section runs.
    spec = importlib.util.spec_from_file_location("gpu_compile_section", HERE / "compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.section(sizes)


def _speed(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def run(sizes: dict[str, Any]) -> dict[str, Any]:
        import speed

        return getattr(speed, f"{name}_section")(sizes)

    run.__name__ = name
    return run


_GPT2 = {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "seq": 1024}
_GPT_TINY = {"layers": 2, "width": 32, "heads": 2, "vocab": 128, "seq": 16}

#: The one table: section -> slice of the default 300 s budget, sizes on the GPU, sizes in the dry run.
#: A later GPU figure adds a row here with its own slice, inside the same total.
SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        Section(
            "cuda_tests",
            "the cuda-marked tests (pytest -m cuda)",
            45,
            cuda_tests,
            cuda_only="pytest -m cuda skips every test on a machine without CUDA: nothing to prove on a CPU",
        ),
        Section(
            "oom",
            "real OOM recovery: ResNet-50 and a causal transformer under a memory limit",
            55,
            oom_section,
            # Batches whose unlimited step fits well under the 16 GiB cap (ResNet-50 fp32 at 224: ~0.1 GB a sample).
            sizes={"models": ["resnet50", "transformer"], "batch": {"resnet50": 96, "transformer": 32}},
            dry_sizes={"models": ["transformer"]},  # the CNN runs the same code: one is enough on a CPU
        ),
        Section(
            "batchsize",
            "MemoryAwareBatchSize against the bisected true maximum",
            40,
            batchsize_section,
            sizes={"models": ["lm"]},
            dry_sizes={"models": ["lm"]},
        ),
        Section(
            "precision",
            "PrecisionSwitch auto against 32-true, TF32, bf16-mixed",
            25,
            _speed("precision"),
            sizes={**_GPT2, "layers": 6, "seq": 512, "batch": 16, "steps": 12, "warmup": 4, "repeats": 2},
            dry_sizes={**_GPT_TINY, "batch": 4, "steps": 3, "warmup": 1, "repeats": 1},
        ),
        Section(
            "data",
            "data pipeline with and without device prefetch",
            20,
            data_section,
            sizes={"repeats": 1, "steps": 20, "batch": 128},
            dry_sizes={"repeats": 1, "steps": 2, "batch": 2},
        ),
        Section(
            "mfu",
            "MFU and tokens/s of a GPT-2-124M-shaped model (bf16-mixed, seq 1024); the default job's samples/s",
            40,
            _speed("mfu"),
            sizes={
                **_GPT2,
                "batch": 8,
                "steps": 25,
                "warmup": 5,
                "mfu_target": 0.30,
                "nominal_peak_flops": None,
                "default_job": {"batch": 64, "steps": 40, "warmup": 10, "image_size": 32},
            },
            dry_sizes={
                **_GPT_TINY,
                "batch": 4,
                "steps": 4,
                "warmup": 2,
                "mfu_target": 0.30,
                "nominal_peak_flops": 1e12,
                "default_job": {"batch": 8, "steps": 2, "warmup": 1, "image_size": 8},
            },
        ),
        Section(
            "overhead",
            "OOMRecovery at k = 1 against plain Lightning (steady state)",
            20,
            _speed("overhead"),
            sizes={
                **_GPT2,
                "layers": 4,
                "seq": 512,
                "batch": 8,
                "steps": 20,
                "warmup": 5,
                "repeats": 3,
                "precision": "bf16-mixed",
                "target_percent": 2.0,
            },
            dry_sizes={
                **_GPT_TINY,
                "batch": 4,
                "steps": 3,
                "warmup": 1,
                "repeats": 1,
                "precision": "32-true",
                "target_percent": 2.0,
            },
        ),
        Section(
            "predict",
            "predict_peak against max_memory_allocated and max_memory_reserved (MLP, ResNet-18, tiny GPT-2)",
            15,
            predict_section,
            sizes={"batches": [16], "precisions": ["32-true", "bf16-mixed"]},
            cuda_only=(
                "max_memory_allocated is CUDA's caching allocator; on a CPU the prediction is checked against "
                "SimulatedMemory in tests/memory/test_predict.py"
            ),
        ),
        Section(
            "compile",
            "torch.compile with OOMRecovery: compiled / eager step time at k = 1 and after a real OOM's split, "
            "the recompilations the split caused and their seconds",
            40,
            compile_section,
            # Inductor compiles for tens of seconds: one small transformer, one repeat. A form the slice has no
            # time left for is listed as skipped.
            sizes={
                "model": "transformer",
                "transformer": {
                    "width": 512,
                    "layers": 1,
                    "heads": 8,
                    "seq_len": 256,
                    "vocab": 8192,
                    "batch_size": 32,
                },
                "forms": ["module", "submodule"],
                "backend": "inductor",
                "precision": "bf16-mixed",
                "repeats": 1,
                "schedule": {"warmup": 3, "steady": 5, "after": 5},
            },
            dry_sizes={
                "model": "cnn",
                "cnn": {"image_size": 16, "batch_size": 32},
                "forms": ["module", "submodule"],
                "backend": "aot_eager",
                "precision": "32-true",
                "repeats": 1,
                "schedule": {"warmup": 2, "steady": 2, "after": 2},
            },
        ),
    )
}


# ----------------------------------------------------------------------------- running one section


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
    try:
        watchdog = Watchdog(slice_s + GRACE_S)
        with watchdog, device.deadline(slice_s), device.use(the_device):
            result = section.run(sizes)
        record.update(status="ran", **result)
    except device.SliceOver as err:
        record.update(status="over_slice", error=str(err))
    except (
        KeyboardInterrupt,
        SystemExit,
    ) as err:  # the watchdog (Lightning turns the interrupt into an exit)
        status = "over_slice" if watchdog.fired else "interrupted"
        record.update(
            status=status,
            error=f"{type(err).__name__}: stopped by the watchdog" if watchdog.fired else repr(err),
        )
        if not watchdog.fired:
            raise
    except Exception as err:
        traceback.print_exc()
        record.update(status="error", error=f"{type(err).__name__}: {err}")
    finally:
        signal.signal(signal.SIGINT, previous)
    record.setdefault("figures", [])
    record["wall_s"] = round(time.perf_counter() - started, 2)
    print(f"gpu_check: {section.name}: {record['status']} in {record['wall_s']:.1f} s", flush=True)
    return record


# ----------------------------------------------------------------------------- the table


def _value(figure: dict[str, Any]) -> str:
    value = figure["value"]
    if value is None:
        return "n/a"
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    else:
        text = str(value)
    return f"{text} {figure['unit']}".strip()


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"GPU check of {results['date']} on **{results['device']}** (torch {results['torch']}, Lightning "
        f"{results['lightning']}{', DRY RUN on CPU with SimulatedMemory' if results['dry_run'] else ''}); "
        f"budget {results['budget_s']:.0f} s, took {results['wall_s']:.0f} s.",
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
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all sections (default 300)"
    )
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
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gpuopt"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*TF32.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    os.environ.setdefault("LIGHTNING_DISABLE_TIPS", "1")
    if args.dry_run:
        # Tiny ops on a shared CPU: one intra-op thread, or threads spin against each other (10x slower).
        torch.set_num_threads(1)
    else:
        torch.cuda.init()  # once, for every section
    args.out.mkdir(parents=True, exist_ok=True)
    total_slices = sum(SECTIONS[s].slice_s for s in SECTIONS)
    scale = args.budget / total_slices
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu (dry run, SimulatedMemory)" if args.dry_run else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "dry_run": args.dry_run,
        "budget_s": args.budget,
        "table": {n: {"slice_s": round(s.slice_s * scale, 1), "what": s.what} for n, s in SECTIONS.items()},
        "sections": [],
    }
    for name in args.sections:
        results["sections"].append(
            run_section(SECTIONS[name], SECTIONS[name].slice_s * scale, args.dry_run, args.out)
        )
    results["wall_s"] = round(time.perf_counter() - started, 2)
    results["every_section_ran"] = all(s["status"] in ("ran", "skipped") for s in results["sections"])
    (args.out / "gpu_check.json").write_text(json.dumps(_plain(results), indent=2) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    print(f"gpu_check: wrote {args.out / 'gpu_check.json'} and gpu_check.md ({results['wall_s']:.0f} s)")
    return 0 if results["every_section_ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
