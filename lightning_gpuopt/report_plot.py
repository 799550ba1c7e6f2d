"""GPUOptReport's pictures, drawn from the plain record: the run (``gpuopt_report.png``) and each OOM
(``oom_<step>_rank<r>.png``).

The run, three panels over the global step, the legend outside them:

1. memory: each step's peak, what stays allocated after it, and the limit, on an axis fitted to them;
   the decisions as markers, one shape and colour per kind (OOMs from the OOM records); epoch
   boundaries, stops and resumes as vertical lines;
2. k (micro-batches) and the precision, as step lines, each on its own axis;
3. throughput (samples/s over a 10-step window) and the data wait (smoothed, its own axis).

Past :data:`MAX_POINTS` steps the lines are drawn from bins (the peak's maximum, the other series'
mean, k's maximum), so 10 000 steps draw in about a second. matplotlib is needed (the ``[plot]`` extra).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_gpuopt.memory import format_bytes
from lightning_gpuopt.oom_record import largest_part, oom_parts, part_advice, part_label, smaller_may_fit
from lightning_gpuopt.report_series import (
    PNG_DPI,
    PNG_SIZE,
    THROUGHPUT_WINDOW,
    precision_code,
    windowed_samples_per_s,
)

__all__ = [
    "CATEGORY_COLORS",
    "MARKERS",
    "MAX_POINTS",
    "OOM_PNG_SIZE",
    "OOM_TEXT_WIDTH",
    "oom_picture_name",
    "render_oom_png",
    "render_png",
    "require_matplotlib",
]

#: Steps drawn one by one; past this, in bins.
MAX_POINTS = 1500
#: The OOM picture's size in inches (at PNG_DPI: 1100 x 650 pixels).
OOM_PNG_SIZE = (11.0, 6.5)

#: Decision kinds -> (marker, colour, legend label). Kinds not listed share the last entry's look.
MARKERS: dict[str, tuple[str, str, str]] = {
    "oom": ("X", "#d62728", "OOM"),
    "micro-batches": ("v", "#ff7f0e", "k changed"),
    "precision": ("D", "#9467bd", "precision switch"),
    "batch size": ("s", "#2ca02c", "batch size"),
    "checkpointing": ("*", "#8c564b", "checkpointing on"),
    "rung": ("*", "#8c564b", "recovery rung on"),
    "held back": ("x", "#111111", "step held back"),
    "skipped batch": ("|", "#7f7f7f", "batch skipped"),
    "loss weighting": ("P", "#17becf", "loss weighting"),
    "other": ("o", "#7f7f7f", "other decision"),
}
#: Kinds drawn as vertical lines across the panels instead of markers.
_LINES = {"stop": ("#000000", "--", "stopped"), "resume": ("#1f77b4", "-", "resumed")}
#: Kinds the picture leaves out (no step of their own worth a mark).
_UNMARKED = {"strategy", "recompilation"}

#: The OOM picture's colours, by part (``oom_record.OOM_PARTS``: the categories, ``other`` split into what was
#: held before the step and the rest) and for a step whose activations were not measured apart.
CATEGORY_COLORS = {
    "parameters": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer_state": "#9467bd",
    "activations": "#d62728",
    "other_held": "#757575",
    "other": "#bdbdbd",
    "activations_and_other": "#eba3a3",  # a step whose activations were not measured apart
}
#: The bars' own labels, in lines that fit inside a bar.
_BAR_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer\nstate",
    "activations": "activations",
    "other_held": "held before\nthe step",
    "other": "other",
    "activations_and_other": "activations\n+ other",
}
#: Characters of the OOM picture's words per line: the right panel is about 57 of its monospace characters wide.
OOM_TEXT_WIDTH = 54


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; an ``ImportError`` naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "Drawing gpuopt_report.png needs matplotlib, which is not installed: pip install 'lightning_gpuopt[plot]' "
            "(the JSON report and the table do not need it)."
        ) from err
    return plt


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def _bins(n: int) -> list[tuple[int, int]]:
    """(start, stop) index ranges: one per step up to MAX_POINTS steps, else MAX_POINTS even bins."""
    if n <= MAX_POINTS:
        return [(i, i + 1) for i in range(n)]
    edges = [round(i * n / MAX_POINTS) for i in range(MAX_POINTS + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def _binned(values: Sequence[float | None], bins: list[tuple[int, int]], how: str) -> list[float]:
    out = []
    for a, b in bins:
        present = [v for v in values[a:b] if v is not None and not math.isnan(v)]
        if not present:
            out.append(float("nan"))
        elif how == "max":
            out.append(max(present))
        else:
            out.append(sum(present) / len(present))
    return out


def _smooth(values: Sequence[float | None], window: int) -> list[float]:
    """A moving mean over ``window`` values (gaps skipped)."""
    out, recent = [], []
    for v in values:
        if v is not None and not math.isnan(v):
            recent.append(v)
        recent = recent[-window:]
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out


def _unit(top: float) -> tuple[float, str]:
    return (2**30, "GiB") if top >= 2**30 else (2**20, "MiB")


def _memory_axis(mem: Any, steps: list[dict[str, Any]], x: list[float], bins: list, unit: float) -> list:
    """Peak, allocated and limit lines on an axis that fits them; returns the legend handles."""
    peaks = _binned([s["peak_bytes"] for s in steps], bins, "max")
    allocated = _binned([s["allocated_bytes"] for s in steps], bins, "mean")
    handles = [
        mem.plot(x, [v / unit for v in peaks], color="#d62728", lw=1.4, label="peak in step")[0],
        mem.plot(x, [v / unit for v in allocated], color="#1f77b4", lw=1.2, label="allocated after step")[0],
    ]
    limits = [s.get("limit_bytes") for s in steps]
    top = max((v for v in peaks if not math.isnan(v)), default=0.0)
    low = min((v for v in allocated if not math.isnan(v)), default=0.0)
    shown = [v for v in limits if v and v <= 1.5 * top]  # a limit far above the run would flatten the curves
    if shown:
        line = _binned([v if v else float("nan") for v in limits], bins, "max")
        handles.append(
            mem.plot(x, [v / unit for v in line], color="black", ls="--", lw=1.2, label="limit")[0]
        )
    elif any(limits):
        far = max(v for v in limits if v)
        mem.annotate(
            f"limit {format_bytes(far)}: above the axis",
            xy=(0.99, 0.97),
            xycoords="axes fraction",
            ha="right",
            va="top",
            fontsize=8,
            color="black",
        )
    high = max([top, *shown]) if top else 1.0
    span = max(high - low, 0.05 * high)
    mem.set_ylim(max(0.0, low - 0.15 * span) / unit, (high + 0.12 * span) / unit)
    return handles


def _decision_steps(report: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(kind, step, detail) of every decision the picture marks; the OOMs from the OOM records when present."""
    made = report.get("decisions", [])
    ooms = report.get("ooms")
    marks: list[tuple[str, float, str]] = []
    if ooms is not None:
        marks += [("oom", r["step"], r.get("phase", "")) for r in ooms]
    for d in made:
        kind = d["kind"]
        if kind in _UNMARKED or (kind == "oom" and ooms is not None):
            continue
        step = d.get("data", {}).get("held_step", d["step"]) if kind == "held back" else d["step"]
        detail = ""
        if kind == "micro-batches":
            data = d.get("data", {})
            detail = "down" if data.get("k_after", 0) < data.get("k_before", 0) else "up"
        marks.append((kind, step, detail))
    return marks


def _lanes(ax: Any, report: dict[str, Any]) -> None:
    """The decisions, one lane per kind (the kind and its count on the axis), a marker at each step."""
    lanes: dict[str, list[tuple[float, str]]] = {}
    for kind, step, detail in _decision_steps(report):
        if kind not in _LINES:
            lanes.setdefault(kind if kind in MARKERS else "other", []).append((step, detail))
    order = [k for k in MARKERS if k in lanes]
    for row, kind in enumerate(reversed(order)):
        marker, color, label = MARKERS[kind]
        marks = lanes[kind]
        if kind == "micro-batches":  # up: more micro-batches; down: fewer (grow back)
            for detail, shape in (("up", "v"), ("down", "^")):
                xs = [step for step, d in marks if d == detail]
                if xs:
                    ax.scatter(xs, [row] * len(xs), marker=shape, s=45, color=color, zorder=5, linewidths=0)
        else:
            xs = [step for step, _ in marks]
            ax.scatter(
                xs, [row] * len(xs), marker=marker, s=70 if marker in "X*" else 40, color=color, zorder=5
            )
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"{MARKERS[k][2]} ({len(lanes[k])})" for k in reversed(order)], fontsize=8)
    for label, kind in zip(ax.get_yticklabels(), reversed(order)):
        label.set_color(MARKERS[kind][1] if kind != "held back" else "#111111")
    ax.set_ylim(-0.7, max(len(order), 1) - 0.3)
    ax.tick_params(axis="y", length=0)
    if not order:
        ax.text(
            0.5,
            0.5,
            "no decisions",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=8,
            color="#616161",
        )


def _mark_ooms(mem: Any, report: dict[str, Any], steps: list[dict[str, Any]], unit: float) -> list:
    """Each OOM on the memory panel, at what it needed (in use + requested), capped at the axis; legend handles."""
    records = report.get("ooms")
    if records is None:
        records = [{"step": d["step"]} for d in report.get("decisions", []) if d["kind"] == "oom"]
    if not records:
        return []
    peak_at = {s["step"]: s["peak_bytes"] for s in steps}
    bottom, top = mem.get_ylim()
    xs, ys = [], []
    for r in records:
        needed = (r.get("allocated_bytes") or 0) + (r.get("requested_bytes") or 0) or peak_at.get(
            r["step"], 0
        )
        xs.append(r["step"])
        ys.append(min(max(needed / unit, bottom), top - 0.03 * (top - bottom)))
    marker, color, _ = MARKERS["oom"]
    return [
        mem.scatter(
            xs,
            ys,
            marker=marker,
            s=80,
            color=color,
            zorder=6,
            edgecolors="white",
            linewidths=0.5,
            label="OOM: in use + request",
        )
    ]


def _vertical_marks(axes: list[Any], report: dict[str, Any], steps: list[dict[str, Any]]) -> list:
    """Epoch boundaries (thin, labelled), stops and resumes across every panel; legend handles."""
    handles = []
    starts = [s["step"] for i, s in enumerate(steps) if i and s.get("epoch") != steps[i - 1].get("epoch")]
    top = axes[0]
    for i, step in enumerate(starts):
        for ax in axes:
            line = ax.axvline(step, color="#9e9e9e", lw=0.8, ls=":", zorder=1)
        if len(starts) <= 30:
            top.annotate(
                f"epoch {steps[0].get('epoch', 0) + i + 1}",
                xy=(step, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -2),
                textcoords="offset points",
                ha="left",
                va="top",
                fontsize=7,
                color="#616161",
            )
        if i == 0:
            line.set_label("epoch start")
            handles.append(line)
    stops = [d["step"] for d in report.get("decisions", []) if d["kind"] == "stop"]
    resumes = [r["step"] for r in report.get("resumes", [])]
    for kind, where in (("stop", stops), ("resume", resumes)):
        color, style, label = _LINES[kind]
        for i, step in enumerate(where):
            for ax in axes:
                line = ax.axvline(step, color=color, lw=1.6, ls=style, zorder=2)
            if i == 0:
                line.set_label(label)
                handles.append(line)
    return handles


def _split_axis(ax: Any, steps: list[dict[str, Any]], x: list[float], bins: list) -> list:
    """k as a step line (left), the precision as a step line on its own axis (right); legend handles."""
    ks = _binned([s["k"] for s in steps], bins, "max")
    handles = [ax.step(x, ks, where="post", color="#ff7f0e", lw=1.6, label="k (micro-batches)")[0]]
    ax.set_ylabel("k")
    high = max((k for k in ks if not math.isnan(k)), default=1)
    ax.set_ylim(0.5, max(2, high) * 1.15 + 0.5)
    ax.yaxis.get_major_locator().set_params(integer=True)
    precisions = [s["precision"] for s in steps]
    names = sorted(set(precisions), key=lambda p: -(precision_code(p) or 0))
    twin = ax.twinx()
    level = {p: i for i, p in enumerate(reversed(names))}
    values = [float(level[p]) for p in precisions]
    binned = [values[a] for a, _ in bins]  # a switch is a moment: the bin's first value
    handles.append(
        twin.step(x, binned, where="post", color="#9467bd", lw=1.4, ls="--", label="precision (right)")[0]
    )
    twin.set_yticks(range(len(names)))
    twin.set_yticklabels(list(reversed(names)), fontsize=8, color="#9467bd")
    twin.set_ylim(-0.6, len(names) - 0.4)
    return handles


def _speed_axis(ax: Any, steps: list[dict[str, Any]], x: list[float], bins: list) -> list:
    """Throughput (left) and the smoothed data wait (right, in %); legend handles."""
    rate = _binned(windowed_samples_per_s(steps), bins, "mean")
    handles = [ax.plot(x, rate, color="#2ca02c", lw=1.4, label="samples/s")[0]]
    ax.set_ylabel(f"samples/s ({THROUGHPUT_WINDOW}-step mean)", fontsize=9)
    present = [r for r in rate if not math.isnan(r)]
    if present:
        ax.set_ylim(0, max(present) * 1.15)
    waits = [s.get("data_wait_fraction") for s in steps]
    if any(w is not None for w in waits):
        window = max(THROUGHPUT_WINDOW, len(steps) // 100)
        smooth = _binned(_smooth([100 * w if w is not None else None for w in waits], window), bins, "mean")
        twin = ax.twinx()
        handles.append(twin.plot(x, smooth, color="#455a64", lw=1.3, ls="-.", label="data wait (right)")[0])
        twin.set_ylabel(f"data wait, % ({window}-step mean)", color="#455a64", fontsize=9)
        high = max((w for w in smooth if not math.isnan(w)), default=0.0)
        twin.set_ylim(0, min(100.0, max(5.0, 1.3 * high)))
    noise = [s.get("noise_scale") for s in steps]
    if any(v is not None for v in noise):  # GradientNoiseScale's trusted estimate, against the batch
        binned = _binned([float(v) if v is not None else math.nan for v in noise], bins, "mean")
        batch = _binned([float(s["batch_size"]) for s in steps], bins, "mean")
        scale = ax.twinx()
        scale.spines["right"].set_position(("axes", 1.09))
        handles.append(scale.plot(x, binned, color="#d62728", lw=1.4, label="B_simple (far right)")[0])
        handles.append(
            scale.step(x, batch, where="post", color="#d62728", lw=0.9, ls=":", label="batch (far right)")[0]
        )
        scale.set_yscale("log")
        scale.set_ylabel("samples (log)", color="#d62728", fontsize=9)
    return handles


def _title(report: dict[str, Any], steps: list[dict[str, Any]]) -> str:
    run = report.get("run", {})
    parts = [f"gpuopt report: {run.get('device', '')}"]
    if steps:
        parts.append(f"{len(steps)} steps")
        ks = [s["k"] for s in steps]
        parts.append(f"k {ks[0]} → {ks[-1]}" if ks[0] != ks[-1] else f"k {ks[0]}")
        precisions = [s["precision"] for s in steps]
        changes = [p for i, p in enumerate(precisions) if i == 0 or p != precisions[i - 1]]
        parts.append(" → ".join(changes))
    ooms = report.get("ooms")
    if ooms:
        parts.append(f"{len(ooms)} OOM{'s' if len(ooms) > 1 else ''}")
    return "   ·   ".join(parts)


def render_png(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw the run's picture (memory and decisions, k and precision, throughput and data wait) as a PNG.

    Raises:
        ImportError: matplotlib is missing (the message names the extra to install).
    """
    plt = require_matplotlib()
    return _saved(plt, _run_figure(plt, report), path)


def _saved(plt: Any, fig: Any, path: str | os.PathLike[str]) -> Path:
    """``fig`` written as a PNG at ``path``, and closed."""
    try:
        path = Path(path)
        fig.savefig(path, dpi=PNG_DPI)
    finally:
        plt.close(fig)
    return path


def _run_figure(plt: Any, report: dict[str, Any]) -> Any:
    """The run picture's figure, panels top to bottom: decisions, memory, k and precision, speed (closed here if
    drawing fails)."""
    steps = report.get("steps", [])
    kinds = {k if k in MARKERS else "other" for k, _, _ in _decision_steps(report) if k not in _LINES}
    fig, (lanes, mem, split, speed) = plt.subplots(
        4,
        1,
        figsize=PNG_SIZE,
        dpi=PNG_DPI,
        sharex=True,
        height_ratios=(0.35 + 0.22 * len(kinds), 3, 1.1, 1.6),
    )
    try:
        bins = _bins(len(steps))
        x = [steps[a]["step"] for a, _ in bins]
        top = max((s["peak_bytes"] for s in steps), default=0)
        unit, unit_name = _unit(top)
        handles = _memory_axis(mem, steps, x, bins, unit) if steps else []
        handles += _mark_ooms(mem, report, steps, unit) if steps else []
        _lanes(lanes, report)
        mem.set_ylabel(f"memory ({unit_name})")
        lanes.set_title(_title(report, steps), fontsize=11, loc="left", pad=14)
        split_handles = _split_axis(split, steps, x, bins) if steps else []
        speed_handles = _speed_axis(speed, steps, x, bins) if steps else []
        handles += _vertical_marks([lanes, mem, split, speed], report, steps) if steps else []
        speed.set_xlabel("global step")
        for ax in (lanes, mem, split, speed):
            ax.grid(alpha=0.25)
            ax.margins(x=0.01)
        lanes.grid(axis="y", alpha=0)
        fig.subplots_adjust(left=0.12, right=0.79, top=0.94, bottom=0.07, hspace=0.14)
        for ax, panel_handles in ((mem, handles), (split, split_handles), (speed, speed_handles)):
            if panel_handles:  # in one column right of the panels, level with each panel's top
                fig.legend(
                    handles=panel_handles,
                    loc="upper left",
                    bbox_to_anchor=(0.855, ax.get_position().y1),
                    fontsize=8,
                    frameon=False,
                    borderaxespad=0.0,
                )
    except BaseException:
        plt.close(fig)
        raise
    return fig


# ---------------------------------------------------------------------------------------------------
# One OOM
# ---------------------------------------------------------------------------------------------------
def oom_picture_name(record: dict[str, Any], nth: int = 1) -> str:
    """``oom_<step>_rank<r>.png``; a second OOM of the same step and rank gets ``_2``, and so on.

    Example:
        >>> oom_picture_name({"step": 3, "rank": 1}), oom_picture_name({"step": 3, "rank": 1}, nth=2)
        ('oom_3_rank1.png', 'oom_3_rank1_2.png')
    """
    return f"oom_{record['step']}_rank{record['rank']}" + (f"_{nth}" if nth > 1 else "") + ".png"


def _stacked_bar(ax: Any, x: float, categories: dict[str, int], unit: float, label_min: float) -> float:
    bottom = 0.0
    for name, color in CATEGORY_COLORS.items():
        value = categories.get(name, 0) / unit
        if value <= 0:
            continue
        ax.bar(x, value, bottom=bottom, width=0.6, color=color, edgecolor="white", linewidth=0.8)
        label = f"{_BAR_LABELS[name]}\n{format_bytes(categories[name])}"
        if value >= label_min * (label.count("\n") + 1) / 2:  # a label only where its lines fit
            ax.text(
                x,
                bottom + value / 2,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color="black" if name in ("other", "activations_and_other") else "white",
                gid="bar label",
            )
        bottom += value
    return bottom


def render_oom_png(record: dict[str, Any], peak: dict[str, Any] | None, path: str | os.PathLike[str]) -> Path:
    """Draw one OOM: the memory in use by category against the limit, the requested allocation on top, beside the
    same bar for the step with the highest peak; the phase, the modules owning the activations and what the pack
    did, in words.

    Raises:
        ImportError: matplotlib is missing.
    """
    plt = require_matplotlib()
    return _saved(plt, _oom_figure(plt, record, peak), path)


def _oom_figure(plt: Any, record: dict[str, Any], peak: dict[str, Any] | None) -> Any:
    """The OOM picture's figure (closed here if drawing fails)."""
    fig, (bars, words) = plt.subplots(1, 2, figsize=OOM_PNG_SIZE, dpi=PNG_DPI, width_ratios=(1.1, 1))
    try:
        _oom_bars(plt, bars, record, peak)
        words.axis("off")
        words.text(
            0.0,
            1.0,
            _oom_text(record, peak),
            ha="left",
            va="top",
            fontsize=9.5,
            family="monospace",
            transform=words.transAxes,
        )
        stage = record.get("stage", "train")
        fig.suptitle(
            f"Out of memory at step {record['step']} on rank {record['rank']}: {stage}, {record.get('phase', '?')}",
            fontsize=12,
            x=0.02,
            ha="left",
        )
        fig.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.1, wspace=0.08)
    except BaseException:
        plt.close(fig)
        raise
    return fig


def _oom_bars(plt: Any, bars: Any, record: dict[str, Any], peak: dict[str, Any] | None) -> None:
    """The OOM's bar by category (the request hatched on top) beside the highest peak's, under the limit line."""
    requested = record.get("requested_bytes") or 0
    limit = record.get("limit_bytes")
    heights = [record["allocated_bytes"] + requested, limit or 0]
    if peak:
        heights.append(peak["peak_bytes"])
    unit, unit_name = _unit(max(heights))
    label_min = 0.06 * max(heights) / unit
    columns = [("at the OOM", oom_parts(record))]
    if peak:
        columns.append((f"highest peak\n(step {peak['step']})", _peak_categories(peak)))
    for i, (_, categories) in enumerate(columns):
        top = _stacked_bar(bars, i, categories, unit, label_min)
        if i == 0 and requested:
            bars.bar(
                0,
                requested / unit,
                bottom=top,
                width=0.6,
                color="none",
                edgecolor="#d62728",
                hatch="///",
                linewidth=1.2,
            )
            bars.text(
                0.34,
                top + requested / unit / 2,
                f"requested\n{format_bytes(requested)}",
                ha="left",
                va="center",
                fontsize=8,
                color="#d62728",
            )
    if limit:
        bars.axhline(limit / unit, color="black", ls="--", lw=1.2)
        bars.annotate(
            f"limit {format_bytes(limit)}",
            xy=(0.01, limit / unit),
            xycoords=("axes fraction", "data"),
            xytext=(0, 2),
            textcoords="offset points",
            ha="left",
            va="bottom",
            fontsize=8,
        )
    bars.set_xticks(range(len(columns)))
    bars.set_xticklabels([name for name, _ in columns], fontsize=9)
    bars.set_xlim(-0.6, len(columns) + 1.3)  # the legend's own band, right of the bars
    bars.set_ylim(0, 1.12 * max(heights) / unit)
    bars.set_ylabel(f"memory ({unit_name})")
    bars.grid(axis="y", alpha=0.25)
    shown = [c for c in CATEGORY_COLORS if any(cats.get(c) for _, cats in columns)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=CATEGORY_COLORS[c]) for c in shown]
    split = record.get("held_before_step") is not None
    bars.legend(
        handles, [_legend_label(c, split) for c in shown], fontsize=8, loc="upper right", frameon=False
    )


def _peak_categories(peak: dict[str, Any]) -> dict[str, int]:
    categories = dict(peak["categories"])
    if not peak.get("activations_measured", True):  # activations and the rest, not split at that step
        categories["activations_and_other"] = categories.pop("activations", 0) + categories.pop("other", 0)
    return categories


def _legend_label(part: str, split: bool) -> str:
    return "activations + other" if part == "activations_and_other" else part_label(part, split)


def _wrap(text: str, width: int = OOM_TEXT_WIDTH, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width`` characters, every character kept: words move to the next line
    (continued with ``indent``), and a word longer than a line is broken across lines.

    Example:
        >>> _wrap("what the pack did: micro-batch 64 → 32", width=20, indent="  ")
        ['what the pack did:', '  micro-batch 64 →', '  32']
        >>> _wrap("snapshot: oom_3_rank0_with_a_long_name.pickle", width=20)
        ['snapshot:', 'oom_3_rank0_with_a_l', 'ong_name.pickle']
    """
    lines: list[str] = []
    line = ""
    for word in text.split():
        while True:
            prefix = indent if lines else ""
            joined = f"{line} {word}" if line else prefix + word
            if len(joined) <= width:
                line = joined
                break
            if line:  # the word goes on a line of its own
                lines.append(line)
                line = ""
                continue
            room = width - len(prefix)  # a word longer than a line: broken, nothing dropped
            lines.append(prefix + word[:room])
            word = word[room:]
    if line:
        lines.append(line)
    return lines


def _oom_text(record: dict[str, Any], peak: dict[str, Any] | None, width: int = OOM_TEXT_WIDTH) -> str:
    """The OOM picture's words, every line at most ``width`` characters and no text left out."""
    lines = _wrap(f"What the pack did: {record.get('action') or 'nothing recorded'}", width, "  ")
    lines.append("")
    total = record.get("allocated_bytes") or 0
    requested = record.get("requested_bytes")
    in_use = f"In use: {format_bytes(total)}" + (
        f", requested {format_bytes(requested)}" if requested else ""
    )
    if record.get("held_before_step_bytes") is not None:
        in_use += (
            f"; held before the step {format_bytes(record['held_before_step_bytes'])}, allocated during it "
            f"{format_bytes(record['allocated_during_step_bytes'])}"
        )
    lines += _wrap(in_use, width, "  ")
    if record.get("micro_batch_size"):
        lines += _wrap(
            f"micro-batch {record['micro_batch_size']} (k {record['k']}) of batch {record['batch_size']}",
            width,
        )
    parts, split = oom_parts(record), record.get("held_before_step") is not None
    if total and any(parts.values()):
        biggest = largest_part(parts)
        lines.append("")
        lines += _wrap(
            f"Largest part: {part_label(biggest, split)}, {format_bytes(parts[biggest])} "
            f"({parts[biggest] / total:.0%})",
            width,
            "  ",
        )
        lines += _wrap(f"To cut it: {part_advice(biggest, smaller_may_fit(record), split)}", width, "  ")
    modules = record.get("modules") or {}
    lines.append("")
    lines.append("Activations by module:")
    for m in (modules.get("top") or [])[:5]:
        size = format_bytes(m["bytes"])
        name = f"  {m['module']}"
        if len(name) + 1 + len(size) <= width:
            lines.append(name + size.rjust(width - len(name)))
        else:  # a long name on lines of its own, the bytes under its end
            lines += _wrap(name, width, "    ")
            lines.append(size.rjust(width))
    lines += _wrap(f"  ({modules.get('how', 'not measured')})", width, "   ")
    if record.get("fragmentation"):
        frag = record["fragmentation"]
        lines.append("")
        lines += _wrap(f"free inside reserved {format_bytes(frag['free_in_reserved_bytes'])}", width)
        lines += _wrap(f"largest free block   {format_bytes(frag['largest_free_block_bytes'])}", width)
    if record.get("outside_allocator_bytes") is not None:
        lines += _wrap(f"outside the allocator {format_bytes(record['outside_allocator_bytes'])}", width)
    if record.get("snapshot"):
        lines += _wrap(f"snapshot: {record['snapshot']} (pytorch.org/memory_viz)", width, "  ")
    return "\n".join(lines)
