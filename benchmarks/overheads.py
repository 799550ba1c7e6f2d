"""The pack's own costs against plain Lightning, in one run: start-up so far (the rest of issue 27 is to come).

    python benchmarks/overheads.py [--repeats 5] [--out DIR]

Each figure is the median of interleaved repeats of fresh interpreters (the pack's command, then plain
Lightning's, then again), each row naming the module that owns the cost. Target: ``gpuopt --help`` takes
at most ``python -c "import lightning.pytorch"`` + 0.5 s. Writes ``overheads.json``; exit 1 when missed.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from common import arguments, environment, print_table, write_json

#: (figure, owner, command, the plain Lightning command it is measured against)
STARTUP = [
    ("import lightning_gpuopt", "lightning_gpuopt/__init__.py", "import lightning_gpuopt"),
    (
        "gpuopt --help",
        "lightning_gpuopt/cli.py",
        "import sys; sys.argv = ['gpuopt', '--help']\n"
        "from lightning_gpuopt.cli import main\ntry: main()\nexcept SystemExit: pass",
    ),
]
PLAIN = "import lightning.pytorch"
HELP_SLACK_S = 0.5


def seconds(code: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return time.perf_counter() - started


def main() -> int:
    parser = arguments(__doc__, "overheads.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    started = time.perf_counter()
    times: dict[str, list[float]] = {PLAIN: [], **{name: [] for name, _, _ in STARTUP}}
    for _ in range(args.repeats):  # interleaved: a slow moment of the machine hits every command alike
        times[PLAIN].append(seconds(PLAIN))
        for name, _, code in STARTUP:
            times[name].append(seconds(code))
    plain = statistics.median(times[PLAIN])
    rows, costs = [["cost", "owner", "seconds", "plain Lightning", "ratio", "target"]], []
    for name, owner, _ in STARTUP:
        own = statistics.median(times[name])
        target = f"<= plain + {HELP_SLACK_S} s" if name == "gpuopt --help" else ""
        met = own <= plain + HELP_SLACK_S if target else None
        rows.append([name, owner, f"{own:.2f}", f"{plain:.2f}", f"{own / plain:.2f}x", target])
        costs.append({"cost": name, "owner": owner, "seconds": own, "plain_seconds": plain, "met": met})
    print_table(rows)
    write_json(
        args.out, "overheads.json", {"environment": environment(), "costs": costs, "times": times}, started
    )
    return 0 if all(c["met"] is not False for c in costs) else 1


if __name__ == "__main__":
    sys.exit(main())
