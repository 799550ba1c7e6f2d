"""GPU section ``data``: the data pipeline on a real GPU, with and without device prefetch.

    bash benchmarks/gpu_check.sh data OUT_DIR        # runs: python benchmarks/gpu/data.py --out OUT_DIR

Runs ``benchmarks/data_pipeline.py`` on CUDA (JPEG decode + augmentation per sample feeding a
ResNet-18 at 64x64): naive loader settings (``num_workers=0``, no pinning, no device prefetch), the
GPUOptDataModule defaults, and the defaults without device prefetch, interleaved. Reports samples/s
and the data-wait fraction DataStallMonitor measured from CUDA events, per configuration.

Checks (pass flags in ``data.json``; exit 1 when one fails, and when no CUDA device is present):

- the defaults are faster than naive settings (median per-repeat samples/s ratio > 1);
- the defaults wait for data less than naive settings (median data-wait fraction lower).

Device prefetch's own gain (defaults vs defaults without it) is reported, not checked: with enough
workers and pinned memory, the copy of one batch is short next to a step, and what it saves depends on
the batch size and the GPU. Takes about 2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the CPU script this extends

import data_pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for data.json")
    parser.add_argument("--quick", action="store_true", help="one short repeat")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu/data.py: no CUDA device visible (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    extra = ["--quick"] if args.quick else ["--repeats", "3", "--steps", "40"]
    results = data_pipeline.main(["--device", "cuda", "--batch-size", "128", "--out", str(args.out), *extra])
    runs = results["models"]["resnet18"]
    defaults, naive = runs["defaults"], runs["naive"]
    checks = {
        "defaults_faster_than_naive": defaults["speedup_vs_naive"]["median"] > 1.0,
        "defaults_wait_less_than_naive": defaults["wait_fraction"]["median"]
        < naive["wait_fraction"]["median"],
    }
    prefetch_gain = (
        defaults["samples_per_s"]["median"] / runs["defaults, no device prefetch"]["samples_per_s"]["median"]
    )
    summary = {
        "section": "data",
        **{k: results[k] for k in ("date", "device", "torch", "lightning")},
        "checks": checks,
        "device_prefetch_gain": prefetch_gain,
        "passed": all(checks.values()),
        "results": results,
    }
    (args.out / "data.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
