"""``gpuopt report RUN_DIR``: a finished run's report table, its OOM records, and its picture drawn again."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_gpuopt.report import PNG_NAME, load_report, render_png
from lightning_gpuopt.report_text import format_oom, oom_listing, print_table

__all__ = ["report_command"]


def report_command(args: list[str]) -> int:
    """``gpuopt report RUN_DIR``: print the report table of a finished run and draw its picture again.

    Returns the exit status: 0, or 2 for a directory without a report (the message says what to pass).
    """
    parser = argparse.ArgumentParser(
        prog="gpuopt report",
        description="Print a finished run's GPUOptReport table and draw gpuopt_report.png again.",
    )
    parser.add_argument(
        "run_dir", help="the run's log directory (holding gpuopt_report.json), or the JSON file"
    )
    parser.add_argument("--out", default=None, help="folder for the picture (default: next to the JSON)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument(
        "--oom", type=int, metavar="N", help="print OOM record N (as listed) in full, and nothing else"
    )
    options = parser.parse_args(args)
    try:
        report = load_report(options.run_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"gpuopt report: {err}", file=sys.stderr)
        return 2
    ooms = report.get("ooms") or []
    if options.oom is not None:
        if not 0 <= options.oom < len(ooms):
            print(
                f"gpuopt report: --oom takes a record number from 0 to {len(ooms) - 1}, got {options.oom}; "
                "`gpuopt report RUN_DIR` lists them."
                if ooms
                else f"gpuopt report: --oom {options.oom}: this run has no OOM record.",
                file=sys.stderr,
            )
            return 2
        print(format_oom(ooms[options.oom], options.oom))
        return 0
    print_table(report, title=f"gpuopt report: {options.run_dir}")
    if ooms:
        print("\nOOMs (`--oom N` prints one in full):")
        print("\n".join(oom_listing(report)))
    if not options.no_plot:
        folder = (
            Path(options.out)
            if options.out
            else Path(options.run_dir if Path(options.run_dir).is_dir() else Path(options.run_dir).parent)
        )
        folder.mkdir(parents=True, exist_ok=True)
        try:
            print(f"wrote {render_png(report, folder / PNG_NAME)}")
        except ImportError as err:
            print(f"gpuopt report: {err}", file=sys.stderr)
    return 0
