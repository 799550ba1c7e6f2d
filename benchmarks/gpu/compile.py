"""GPU section ``compile``: torch.compile with OOMRecovery, compiled over eager, and what a split costs in compilation.

    bash benchmarks/gpu_check.sh all OUT_DIR --only compile            # the section inside the budgeted call
    bash benchmarks/gpu_check.sh all OUT_DIR --only compile --dry-run  # the same code on a CPU, tiny sizes
    bash benchmarks/gpu_check.sh compile OUT_DIR                       # the same, alone (runs this file)

The measurement is ``benchmarks/compile.py``'s (loaded from there): eager and compiled fits with
``OOMRecovery()``, a real OOM forced at one batch (on CUDA ``set_per_process_memory_fraction``, in the
dry run SimulatedMemory), then for each compiled form (the compiled ``LightningModule`` and a compiled
submodule) the step time compiled / eager at k = 1 and after the split, dynamo's compilations (the
first, and those the split caused, with their seconds), and whether the split recovered. The sizes
are check.py's table: on the GPU one small transformer with inductor, as inductor compiles for tens
of seconds; in the dry run a tiny CNN with ``aot_eager``. A form OOMRecovery refuses at setup, or
that the slice has no time left for, is listed as skipped with its reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))


def _load_benchmark() -> ModuleType:
    """benchmarks/compile.py (workloads, fits, figures), loaded by path: it shares this file's name."""
    name = "compile_benchmark"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE.parent / "compile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _figure(
    name: str, value: Any, unit: str = "", target: str | None = None, met: bool | None = None
) -> dict:
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met}


FORM_NAMES = {"module": "compiled LightningModule", "submodule": "compiled submodule"}


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    """One workload, eager and compiled in each form of ``sizes['forms']``, with an OOM forced mid-run."""
    bench = _load_benchmark()
    bench.quiet()
    name = sizes["model"]
    workload = bench.cnn(**sizes[name]) if name == "cnn" else bench.transformer(**sizes[name])
    result = bench.measure(
        workload,
        sizes["forms"],
        sizes["backend"],
        sizes["repeats"],
        bench.Schedule(**sizes["schedule"]),
        sizes["precision"],
    )
    figures, skipped = [], {}
    for form, f in result["forms"].items():
        label = f"{name}, {FORM_NAMES[form]} ({sizes['backend']})"
        if f["status"] in ("refused", "left out"):
            skipped[label] = f"{f['status']}: {f['reason']}"
            continue
        if f["status"] != "ran":
            figures.append(
                _figure(
                    f"{label}: eager and compiled fits",
                    "; ".join(map(str, f["errors"])),
                    "",
                    "both run",
                    False,
                )
            )
            continue
        ks = sorted(set(f["final_k"]["compiled"]))
        recompilations = f["recompilations"]
        caused = recompilations["caused_by_split_median"]
        by_timing = recompilations["split_batch_by_timing_s_median"]
        figures += [
            _figure(
                f"{label}: OOM at its batch, split and recovered (k after the split)",
                "/".join(map(str, ks)),
                "",
                "k > 1, run completes",
                f["split_happened"],
            ),
            _figure(f"{label}: step time compiled / eager at k = 1", f["ratio_k1_median"], "x", "reported"),
            _figure(
                f"{label}: step time compiled / eager after the split",
                f["ratio_after_split_median"],
                "x",
                "reported",
            ),
            _figure(
                f"{label}: recompilations the split caused (dynamo's records; "
                f"{max(recompilations['steady_before_split'])} in the steady batches before it; the pack "
                f"counted {'/'.join(map(str, recompilations['counted_by_the_pack']))})",
                caused,
                "",
                "<= 1 per split",
                caused is not None and caused <= 1,
            ),
            _figure(
                f"{label}: first compilation (dynamo)", f["first_compile_s"]["dynamo_median"], "s", "reported"
            ),
            _figure(
                f"{label}: seconds per recompilation (dynamo; the split batch's extra time over eager: "
                f"{by_timing:.1f} s)",
                recompilations["seconds_per_recompilation_median"],
                "s",
                "reported",
            ),
        ]
    return {"figures": figures, "details": result, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    """``gpu_check.sh compile OUT_DIR``: this section alone, through the budgeted runner (its slice, its sizes)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("gpu_check_out"), help="directory for gpu_check.json"
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU with SimulatedMemory and tiny sizes")
    args = parser.parse_args(argv)
    import check

    return check.main([str(args.out), "--only", "compile", *(["--dry-run"] if args.dry_run else [])])


if __name__ == "__main__":
    sys.exit(main())
