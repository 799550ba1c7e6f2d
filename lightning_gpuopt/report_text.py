"""The report as text: the summary table (its rows, and the run's figures they show) and the OOM records.

Pure functions over the plain record (``gpuopt_report.json``), for GPUOptReport at the end of ``fit`` and for
``gpuopt report RUN_DIR`` afterwards; ``report.py`` re-exports them. docs/report.md explains every row.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lightning_gpuopt.memory import format_bytes
from lightning_gpuopt.oom_record import (
    OOM_PARTS,
    largest_part,
    oom_parts,
    part_advice,
    part_label,
    smaller_may_fit,
)
from lightning_gpuopt.report_series import windowed_samples_per_s

__all__ = [
    "format_oom",
    "format_table",
    "oom_listing",
    "oom_rows",
    "print_table",
    "run_peak_bytes",
    "run_samples_per_s",
    "summarize_values",
    "summary_rows",
]


def summarize_values(values: Sequence[Any]) -> str:
    """One table cell for a field's per-step values: numbers by their last, min, median and max; other
    values by their changes in order; ``"not recorded"`` when every value is ``None``.

    Example:
        >>> summarize_values([1, 2, 3, None])
        '3 at the last step (min 1, median 2, max 3)'
        >>> summarize_values(["a", "a", "b"])
        'a -> b'
    """
    present = [v for v in values if v is not None]
    if not present:
        return "not recorded"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        low, mid, high = min(present), statistics.median(present), max(present)
        return f"{present[-1]:.4g} at the last step (min {low:.4g}, median {mid:.4g}, max {high:.4g})"
    changes = [v for i, v in enumerate(present) if i == 0 or v != present[i - 1]]
    return " -> ".join(str(v) for v in changes)


def run_samples_per_s(steps: Sequence[dict[str, Any]]) -> float | None:
    """The run's throughput: the median over its steps (the first left out) of the samples/s of the last
    :data:`THROUGHPUT_WINDOW` steps (:func:`windowed_samples_per_s`); ``None`` before two timed steps.

    Example:
        >>> run_samples_per_s([{"samples": 8, "step_time_s": None}] + [{"samples": 8, "step_time_s": 0.5}] * 3)
        16.0
    """
    return _median(windowed_samples_per_s(steps)[1:])


def run_peak_bytes(steps: Sequence[dict[str, Any]]) -> int | None:
    """The run's peak memory: the highest peak of any recorded training step (each step's peak window starts
    at its batch start, so set-up and validation do not count); ``None`` without steps.

    Example:
        >>> run_peak_bytes([{"peak_bytes": 5}, {"peak_bytes": 7}])
        7
    """
    return max((int(s["peak_bytes"]) for s in steps), default=None)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(present) if present else None


def _share(record: dict[str, Any]) -> str:
    """The two largest parts of an OOM record's memory as shares: ``"activations 62%, parameters 20%"``."""
    total = record.get("allocated_bytes") or 0
    if not total:
        return ""
    parts, split = oom_parts(record), record.get("held_before_step") is not None
    ranked = sorted(((n, OOM_PARTS.index(p), p) for p, n in parts.items() if n), key=lambda x: (-x[0], x[1]))
    return ", ".join(f"{part_label(p, split)} {n / total:.0%}" for n, _, p in ranked[:2])


def oom_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows about OOMs, from ``report["ooms"]`` (none without OOMs): how many, where, by rank.

    Example:
        >>> record = {"step": 3, "rank": 0, "stage": "train", "phase": "forward", "allocated_bytes": 100,
        ...           "categories": {"parameters": 20, "activations": 70, "other": 10}, "action": "k 1 → 2"}
        >>> oom_rows({"ooms": [record], "run": {"world_size": 1}})[0]
        ('OOMs', '1: train forward 1')
    """
    ooms = report.get("ooms") or []
    if not ooms:
        return []
    where = Counter(f"{r['stage']} {r['phase']}" for r in ooms)
    rows = [("OOMs", f"{len(ooms)}: " + ", ".join(f"{w} {n}" for w, n in where.items()))]
    world = int(report.get("run", {}).get("world_size") or 1)
    if world > 1:
        parts = []
        for rank in range(world):
            mine = [r for r in ooms if r["rank"] == rank]
            if not mine:
                parts.append(f"{rank}: none")
                continue
            worst = max(mine, key=lambda r: r["allocated_bytes"])
            parts.append(
                f"{rank}: {len(mine)}, up to {format_bytes(worst['allocated_bytes'])} in use ({_share(worst)})"
            )
        rows.append(("OOMs per rank", "; ".join(parts)))
    last = ooms[-1]
    rows.append(
        (
            "  last OOM",
            f"step {last['step']} rank {last['rank']}: {_share(last)}; {last.get('action') or 'no action recorded'}",
        )
    )
    return rows


def format_oom(record: dict[str, Any], index: int | None = None) -> str:
    """One OOM record as text (``gpuopt report RUN_DIR --oom N``).

    Example:
        >>> record = {"step": 3, "rank": 0, "stage": "train", "phase": "forward", "requested_bytes": 2**20,
        ...           "allocated_bytes": 3 * 2**20, "reserved_bytes": 3 * 2**20, "limit_bytes": 4 * 2**20,
        ...           "categories": {"parameters": 2**20, "gradients": 0, "optimizer_state": 0,
        ...                          "activations": 2**21, "other": 0},
        ...           "modules": {"how": "measured at the OOM", "top": [{"module": "net.0", "bytes": 2**21}]},
        ...           "action": "micro-batch 64 → 32 (k 1 → 2)"}
        >>> print(format_oom(record, 0).splitlines()[0])
        OOM #0: step 3, rank 0, train, forward
    """
    head = f"OOM #{index}: " if index is not None else "OOM: "
    lines = [head + f"step {record['step']}, rank {record['rank']}, {record['stage']}, {record['phase']}"]
    if record.get("message"):
        lines.append(f"  error      {record['message']}")
    figures = [
        ("requested", record.get("requested_bytes")),
        ("allocated", record.get("allocated_bytes")),
        ("reserved", record.get("reserved_bytes")),
        ("limit", record.get("limit_bytes")),
    ]
    lines.append("  memory     " + ", ".join(f"{w} {format_bytes(v)}" for w, v in figures if v is not None))
    total = record.get("allocated_bytes") or 0
    held = record.get("held_before_step")
    if held is not None:
        lines.append(
            f"  in use     {format_bytes(total)}: {format_bytes(record['held_before_step_bytes'])} held before the "
            f"step, {format_bytes(record['allocated_during_step_bytes'])} allocated during it"
        )
        lines.append(f"  in use by category:{'':>24}held before the step  allocated during it")
    else:
        lines.append("  in use by category:")
    for name, value in record.get("categories", {}).items():
        share = f"{value / total:6.1%}" if total else ""
        line = f"    {name.replace('_', ' '):<16} {format_bytes(value):>12} {share}"
        if held is not None:
            before = int(held.get(name, 0))
            line += f" {format_bytes(before):>22} {format_bytes(value - before):>20}"
        lines.append(line)
    if not record.get("activations_measured", True):
        lines.append("    (activations not measured: they are in other)")
    modules = record.get("modules") or {}
    lines.append(f"  activations by module ({modules.get('how', 'not measured')}):")
    lines += [f"    {m['module']:<40} {format_bytes(m['bytes']):>12}" for m in modules.get("top", [])]
    if record.get("micro_batch_size"):
        lines.append(
            f"  attempt    micro-batch {record['micro_batch_size']} (k {record['k']}) of batch {record['batch_size']}"
        )
    if record.get("fragmentation"):
        frag = record["fragmentation"]
        lines.append(
            f"  fragmentation  free inside reserved {format_bytes(frag['free_in_reserved_bytes'])}, largest free "
            f"block {format_bytes(frag['largest_free_block_bytes'])}"
        )
    if record.get("outside_allocator_bytes") is not None:
        lines.append(
            f"  outside the allocator  {format_bytes(record['outside_allocator_bytes'])} "
            f"({record.get('outside_allocator_source')})"
        )
    lines.append(f"  action     {record.get('action') or 'no action recorded'}")
    if total:
        parts, split = oom_parts(record), held is not None
        biggest = largest_part(parts)
        lines.append(
            f"  largest    {part_label(biggest, split)}, {format_bytes(parts[biggest])} "
            f"({parts[biggest] / total:.0%}); to cut it: {part_advice(biggest, smaller_may_fit(record), split)}"
        )
    for what in ("snapshot", "picture"):
        if record.get(what):
            lines.append(f"  {what:<10} {record[what]}")
    return "\n".join(lines)


def oom_listing(report: dict[str, Any]) -> list[str]:
    """One line per OOM record, numbered as ``--oom N`` takes them."""
    lines = []
    for i, r in enumerate(report.get("ooms") or []):
        limit = f" of {format_bytes(r['limit_bytes'])}" if r.get("limit_bytes") else ""
        lines.append(
            f"#{i}  step {r['step']} rank {r['rank']} {r['stage']} {r['phase']}: {format_bytes(r['allocated_bytes'])}"
            f"{limit} in use ({_share(r)}) -> {r.get('action') or '?'}"
        )
    return lines


def _full_batches(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps without an epoch's short last batch (fewer samples than the batch before it in its epoch).

    A short last batch runs as fewer or smaller micro-batches; shown, it would read like a split.

    Example:
        >>> steps = [{"epoch": 0, "batch_size": 64}, {"epoch": 0, "batch_size": 32}, {"epoch": 1, "batch_size": 64}]
        >>> [s["batch_size"] for s in _full_batches(steps)]
        [64, 64]
    """
    kept = []
    for i, step in enumerate(steps):
        ends_epoch = i + 1 == len(steps) or steps[i + 1].get("epoch") != step.get("epoch")
        before = steps[i - 1] if i else None
        short = (
            ends_epoch
            and before is not None
            and before.get("epoch") == step.get("epoch")
            and step["batch_size"] < before["batch_size"]
        )
        if not short:
            kept.append(step)
    return kept or list(steps)


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table as (what, value) rows.

    Example:
        >>> rows = summary_rows({"run": {"device": "cpu"}, "steps": [], "decisions": []})
        >>> rows[0]
        ('device', 'cpu')
    """
    run, steps, made = report.get("run", {}), report.get("steps", []), report.get("decisions", [])
    rows = _run_rows(run, made)
    if steps:
        rows += _step_rows(run, steps)
    return rows + _decision_rows(report, made)


def _run_rows(run: dict[str, Any], made: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Where the run ran: the device, what ended it, the strategy (and the plan of ``gpuopt fit``)."""
    rows: list[tuple[str, str]] = [("device", str(run.get("device", "?")))]
    if run.get("stopped_by"):
        rows.append(("ended by", str(run["stopped_by"])))
    world = int(run.get("world_size") or 1)
    if world > 1 or any(d["kind"] == "strategy" for d in made):
        nodes = int(run.get("num_nodes") or 1)
        text = f"{run.get('strategy', '?')} on {world} rank(s)" + (f", {nodes} nodes" if nodes > 1 else "")
        plan = next((d for d in reversed(made) if d["kind"] == "strategy"), None)
        if plan is not None:  # gpuopt fit planned it: the pick and why (the table is in the decision's data)
            text += f"; planned: {plan['message']}"
        rows.append(("strategy", text))
    return rows


def _step_rows(run: dict[str, Any], steps: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """What the recorded steps show: speed, memory, the split, the precision, data waits, the noise scale."""
    first, last = steps[0], steps[-1]
    rows = [("steps", f"{len(steps)} recorded (global step {first['step']} to {last['step']})")]
    rate = run_samples_per_s(steps)
    if rate is not None:
        rows.append(("throughput", f"{rate:.1f} samples/s (median)"))
    utilisation = _median([s.get("mfu") for s in steps])
    if utilisation is not None:
        rows.append(("model FLOPs utilisation", f"{utilisation:.1%} (median)"))
    elif run.get("mfu_note"):
        rows.append(("model FLOPs utilisation", str(run["mfu_note"])))
    rows += _memory_rows(run, steps)
    full = _full_batches(steps)
    ks = [s["k"] for s in full]
    rows.append(
        (
            "micro-batches k",
            f"{ks[0]} -> {ks[-1]} (max {max(ks)}); micro-batch {full[0]['micro_batch_size']} -> "
            f"{full[-1]['micro_batch_size']} of batch {full[-1]['batch_size']}",
        )
    )
    precisions = [s["precision"] for s in steps]
    changes = [p for i, p in enumerate(precisions) if i == 0 or p != precisions[i - 1]]
    rows.append(("precision", " -> ".join(changes)))
    wait = _median([s.get("data_wait_fraction") for s in steps[1:]])
    if wait is not None:
        rows.append(("data-wait fraction", f"{wait:.0%} (median)"))
    noise = [(s["step"], s["noise_scale"]) for s in steps if s.get("noise_scale") is not None]
    if noise:  # GradientNoiseScale: its trusted estimate, first and last
        rows.append(
            (
                "noise scale B_simple",
                f"{noise[0][1]:.0f} (step {noise[0][0]}) -> {noise[-1][1]:.0f} samples (step {noise[-1][0]}); "
                f"optimizer batch {last['batch_size']} a batch",
            )
        )
    for field in run.get("fields", []):  # ReportFields: GPUOptReport(fields=[...])
        rows.append((field["label"], summarize_values([s.get(field["name"]) for s in steps])))
    return rows


def _memory_rows(run: dict[str, Any], steps: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The run's peak (per rank too), and the memory in use at the last step."""
    rows = [
        (f"peak memory ({run.get('memory_kind', 'device')})", _peak_text(steps)),
        ("memory at the last step", format_bytes(steps[-1]["allocated_bytes"])),
    ]
    ranks = run.get("rank_peaks") or []
    if len(ranks) > 1:
        rows.append(
            (
                "peak memory per rank",
                ", ".join(
                    f"{r['rank']}: {format_bytes(r['peak_bytes'])}"
                    + (f" of {format_bytes(r['limit_bytes'])}" if r.get("limit_bytes") else "")
                    for r in ranks
                ),
            )
        )
    return rows


def _decision_rows(report: dict[str, Any], made: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """What the pack did: recompilations it caused, the OOMs, the decisions by kind and the last five."""
    rows = []
    recompiled = [d for d in made if d["kind"] == "recompilation"]
    if recompiled:  # torch.compile: what the pack's splits and switches cost, from dynamo's counters
        causes = "; ".join(d["data"].get("cause", "?") for d in recompiled[-3:])
        frames = sum(int(d["data"].get("frames", 1)) for d in recompiled)
        rows.append(("recompilations by the pack", f"{frames} (last: {causes})"))
    rows += oom_rows(report)
    kinds = Counter(d["kind"] for d in made)
    if "ooms" in report:  # the OOM records are the one count of OOMs the report prints
        kinds = Counter({"oom": len(report["ooms"])}) + Counter(
            {k: n for k, n in kinds.items() if k != "oom"}
        )
    rows.append(("decisions", ", ".join(f"{n} {kind}" for kind, n in kinds.items()) if kinds else "none"))
    for d in made[-5:]:
        rows.append((f"  step {d['step']}", d["message"]))
    return rows


def _peak_text(steps: Sequence[dict[str, Any]]) -> str:
    """The run's peak, and its share of the limit where the limit held still; a limit that changed during the
    run is said, with the highest share of a step's peak in the limit then in force.

    Example:
        >>> _peak_text([{"step": 0, "peak_bytes": 900, "limit_bytes": 1000}, {"step": 1, "peak_bytes": 700,
        ...             "limit_bytes": 1000}])
        '900 B (90% of 1000 B)'
        >>> _peak_text([{"step": 0, "peak_bytes": 900, "limit_bytes": 1000}, {"step": 1, "peak_bytes": 700,
        ...             "limit_bytes": 750}])
        '900 B; the limit changed during the run (1000 B -> 750 B): at most 93% of the limit then in force (step 1)'
    """
    peak = run_peak_bytes(steps) or 0
    limits = [s.get("limit_bytes") for s in steps]
    known = [v for v in limits if v]
    if not known:
        return format_bytes(peak)
    changes = [v for i, v in enumerate(limits) if i == 0 or v != limits[i - 1]]
    if len(changes) == 1:
        return f"{format_bytes(peak)} ({peak / known[0]:.0%} of {format_bytes(known[0])})"
    share, step = max((s["peak_bytes"] / s["limit_bytes"], s["step"]) for s in steps if s.get("limit_bytes"))
    seen = " -> ".join(format_bytes(v) if v else "none" for v in changes)
    return f"{format_bytes(peak)}; the limit changed during the run ({seen}): at most {share:.0%} of the limit then in force (step {step})"


def format_table(report: dict[str, Any], title: str = "gpuopt report") -> str:
    """The summary table as plain text (what ``gpuopt report`` prints, and the callback without rich)."""
    rows = summary_rows(report)
    width = max(len(what) for what, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{what.ljust(width)}  {value}" for what, value in rows]
    return "\n".join(lines)


def print_table(report: dict[str, Any], title: str = "gpuopt report") -> None:
    """Print the summary table, with rich when it is installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(report, title))
        return
    table = Table(title=title, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for what, value in summary_rows(report):
        table.add_row(what, value)
    Console().print(table)
