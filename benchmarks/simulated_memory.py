"""Step-time overhead of SimulatedMemory on a ResNet-18 training step (32×32 images, Adam).

    python benchmarks/simulated_memory.py [--out DIR] [--batch-size 32] [--repeats 7] [--steps 3]

Each repeat times a block of ``--steps`` steps per configuration (plain, plain again as an A/A control,
SimulatedMemory per backend) in a rotating order; per repeat the ratio to plain, the median over repeats.
Writes ``simulated_memory.json``; target: median ratio ≤ 1.1 (allocator backend), ``--check`` exits 1 if not.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from common import arguments, clocked, labelled, positive_int, print_table, spread, write_json
from torch import nn

from lightning_gpuopt.memory.counting_allocator import native_status
from lightning_gpuopt.testing import SimulatedMemory

TARGET = 1.1


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "simulated_memory.json", out=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per block")
    parser.add_argument("--backends", default="allocator,dispatch", help="comma-separated backends to time")
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: torch's choice)")
    check = f"exit 1 if the allocator's median ratio > {TARGET}"
    parser.add_argument("--check", action="store_true", help=check)
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in ("allocator", "dispatch")]
    if unknown:
        parser.error(f"--backends: unknown {unknown}; choose from allocator, dispatch")
    if "allocator" in backends and native_status() is not None:
        print(f"allocator backend unavailable here ({native_status()}); timing the others", file=sys.stderr)
        backends.remove("allocator")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = labelled(args.batch_size, 3, 32, 32)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    peaks: dict[str, int] = {}

    def block(name: str) -> float:
        backend = name.split(":", 1)[1] if name.startswith("simulated:") else None
        with SimulatedMemory(backend=backend) if backend else contextlib.nullcontext() as mem:
            step()  # untimed: counts what existed before entering, settles caches
            if mem is not None:
                mem.reset_peak()
            times = [clocked(step)[0] for _ in range(args.steps)]
        if mem is not None:
            peaks[name] = mem.peak_bytes
        return statistics.median(times)

    configs = ["plain", "plain (A/A)"] + [f"simulated:{b}" for b in backends]
    for _ in range(2):  # warm-up: first-touch page faults, oneDNN primitive caches, the allocator build
        for name in configs:
            block(name)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    started = time.perf_counter()
    for r in range(args.repeats):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        times = {name: block(name) for name in order}
        for name in configs:
            samples[name].append(times[name])
    elapsed = time.perf_counter() - started

    rows, table = [], [["config", "step ms", "ratio", "min", "max", "IQR", "peak MiB"]]
    for name in configs:
        ratios = spread([t / p for t, p in zip(samples[name], samples["plain"])])
        row = {"config": name, "step_ms_median": 1e3 * statistics.median(samples[name])}
        row.update({f"ratio_{key}": ratios[key] for key in ("median", "min", "max", "q1", "q3")})
        rows.append({**row, "peak_bytes": peaks.get(name), "step_ms": [1e3 * t for t in samples[name]]})
        peak = f"{peaks[name] / 2**20:.1f}" if peaks.get(name) else "-"
        figures = [f"{ratios[key]:.3f}" for key in ("median", "min", "max")]
        iqr = f"{ratios['q1']:.3f}-{ratios['q3']:.3f}"
        table.append([name, f"{row['step_ms_median']:.1f}", *figures, iqr, peak])
    print(
        f"ResNet-18, 32x32, batch {args.batch_size}, Adam; {args.repeats} interleaved repeats x {args.steps} steps; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print_table(table)
    allocator = next((r for r in rows if r["config"] == "simulated:allocator"), None)
    verdict = None if allocator is None else allocator["ratio_median"] <= TARGET
    if allocator is not None:
        ratio, ok = allocator["ratio_median"], "ok" if verdict else "OVER"
        print(f"allocator backend: median ratio {ratio:.3f} (target <= {TARGET}): {ok}")

    result = {
        "benchmark": "simulated_memory_overhead",
        **{"model": "resnet18", "image_size": 32, "batch_size": args.batch_size, "repeats": args.repeats},
        **{"steps_per_block": args.steps, "threads": torch.get_num_threads(), "torch": torch.__version__},
        **{"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count()},
        **dict(timed_seconds=elapsed, target_ratio=TARGET, allocator_within_target=verdict, rows=rows),
    }
    write_json(args.out, "simulated_memory.json", result)
    return 1 if args.check and verdict is False else 0


if __name__ == "__main__":
    sys.exit(main())
