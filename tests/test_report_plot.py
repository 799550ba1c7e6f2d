"""report_plot: the run's picture stays quick and the right size on a long run; each OOM gets its picture."""

from __future__ import annotations

import struct
import time

import pytest

from lightning_gpuopt.report import PNG_DPI, PNG_SIZE, write_oom_pictures
from lightning_gpuopt.report_plot import OOM_PNG_SIZE, render_png

pytest.importorskip("matplotlib")

GiB = 2**30


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _record(step: int, rank: int = 0) -> dict:
    categories = {
        "parameters": 8 * GiB,
        "gradients": 8 * GiB,
        "optimizer_state": 16 * GiB,
        "activations": 30 * GiB,
    }
    categories["other"] = 6 * GiB
    return {
        "step": step, "rank": rank, "stage": "train", "phase": "backward", "requested_bytes": 4 * GiB,
        "allocated_bytes": sum(categories.values()), "reserved_bytes": 70 * GiB, "limit_bytes": 70 * GiB,
        "categories": categories, "activations_measured": True, "action": "micro-batch 32 → 16 (k 2 → 4)",
        "modules": {"how": "measured at the OOM", "top": [{"module": "blocks.0.attn", "bytes": 9 * GiB}]},
        "k": 2, "batch_size": 64, "micro_batch_size": 32, "message": "CUDA out of memory.",
    }  # fmt: skip


def _long_run(n: int) -> dict:
    steps, decisions = [], []
    for i in range(n):
        k = 1 if i < n // 3 else 2
        steps.append(
            {
                "step": i, "epoch": i // 1000, "allocated_bytes": 30 * GiB, "peak_bytes": (40 + 20 / k) * GiB,
                "limit_bytes": 70 * GiB, "k": k, "precision": "bf16-mixed" if i < n // 2 else "32-true",
                "samples": 64, "step_time_s": 0.1, "data_wait_fraction": 0.05 * (i % 7),
            }
        )  # fmt: skip
    decisions += [
        {"step": n // 3, "kind": "micro-batches", "data": {"k_before": 1, "k_after": 2}, "message": ""}
    ]
    decisions += [{"step": n // 2, "kind": "precision", "data": {}, "message": ""}]
    decisions += [
        {"step": i, "kind": "held back", "data": {"held_step": i - 1}, "message": ""} for i in (5, 9)
    ]
    return {
        "run": {"device": "NVIDIA H200 (cuda:0)"},
        "steps": steps,
        "decisions": decisions,
        "ooms": [_record(n // 3)],
        "resumes": [{"step": n // 4, "steps_before": n // 4}],
    }


def test_ten_thousand_steps_draw_in_seconds_at_the_usual_size(tmp_path):
    report = _long_run(10_000)
    started = time.perf_counter()
    path = render_png(report, tmp_path / "long.png")
    seconds = time.perf_counter() - started
    # The budget is 5 s; a loaded CI machine gets room, a regression to one point per step does not (~20 s).
    assert seconds < 15, f"{seconds:.1f} s"
    assert _png_size(path) == (int(PNG_SIZE[0] * PNG_DPI), int(PNG_SIZE[1] * PNG_DPI))


def test_each_oom_gets_a_picture_up_to_the_cap_and_its_record_names_it(tmp_path):
    records = [_record(3), _record(3), _record(7)]
    peak = {"rank": 0, "step": 5, "peak_bytes": 66 * GiB, "categories": dict(records[0]["categories"])}
    peak["activations_measured"] = False
    paths = write_oom_pictures(records, peak, tmp_path, max_files=2)
    assert [p.name for p in paths] == ["oom_3_rank0.png", "oom_3_rank0_2.png"]
    assert [r.get("picture") for r in records] == ["oom_3_rank0.png", "oom_3_rank0_2.png", None]
    assert _png_size(paths[0]) == (int(OOM_PNG_SIZE[0] * PNG_DPI), int(OOM_PNG_SIZE[1] * PNG_DPI))


def _long_texts(record: dict, split: bool) -> dict:
    record = dict(record)
    record["action"] = "gave up: " + " ".join(
        ["Out of memory at step 3 with micro-batches of 1 sample(s)"] * 6
    )
    record["micro_batch_size"] = 1
    record["modules"] = {
        "how": "measured at step 4, the next training batch after the OOM (micro-batch 16, k 2)",
        "top": [
            {"module": "model.encoder.layers.11.self_attention.out_proj.lora_A.default", "bytes": 9 * GiB},
            {"module": "x" * 140, "bytes": GiB},
        ],
    }
    record["snapshot"] = "oom_3_rank0_" + "z" * 80 + ".pickle"
    if split:
        held = {"parameters": 8 * GiB, "optimizer_state": 16 * GiB, "other": 5 * GiB}
        record["held_before_step"] = held
        record["held_before_step_bytes"] = sum(held.values())
        record["allocated_during_step_bytes"] = record["allocated_bytes"] - sum(held.values())
    return record


OOM_PICTURES = [(split, peak) for split in (False, True) for peak in ("none", "measured", "unmeasured")]


@pytest.mark.parametrize(
    ("split", "peak"), OOM_PICTURES, ids=[f"split={s}-peak={p}" for s, p in OOM_PICTURES]
)
def test_no_text_of_an_oom_picture_is_cut_or_covered(split, peak):
    """Every text lies inside the picture; a bar's label inside its bar; the legend, the limit and the request
    cover no other text."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from lightning_gpuopt.report_plot import _oom_figure

    record = _long_texts(_record(3), split)
    top = None
    if peak != "none":
        top = {"rank": 0, "step": 5, "peak_bytes": 66 * GiB, "categories": dict(record["categories"])}
        top["activations_measured"] = peak == "measured"
    fig = _oom_figure(plt, record, top)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        inside = fig.bbox.padded(-1)
        bars, words = fig.axes[:2]
        legend = bars.get_legend()
        shown = [*fig.texts, *bars.texts, *words.texts, *legend.get_texts(), *bars.get_xticklabels()]
        shown += [bars.yaxis.label]
        for text in shown:
            box = text.get_window_extent(renderer)
            assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1), (text.get_text(), box)
        blocks = [
            p.get_window_extent(renderer)
            for p in bars.patches
            if isinstance(p, Rectangle) and p.get_facecolor()[3] > 0 and p.get_height() > 0
        ]
        labels = [t for t in bars.texts if t.get_gid() == "bar label"]
        assert labels
        for label in labels:
            box = label.get_window_extent(renderer)
            assert any(b.x0 - 1 <= box.x0 and box.x1 <= b.x1 + 1 for b in blocks), label.get_text()
        free = [t.get_window_extent(renderer) for t in bars.texts if t.get_gid() != "bar label"]
        free.append(legend.get_window_extent(renderer))
        for i, a in enumerate(free):
            for b in free[i + 1 :]:
                assert not a.overlaps(b), (a, b)
        said = " ".join(words.texts[0].get_text().split())
        assert ("held before the step" in said) == split
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# What the pictures draw (the figures before they are saved)
# ---------------------------------------------------------------------------------------------------
#: One decision of each kind the run picture marks, at its own step; "held back" marks the step it held back.
MARKED = {
    "oom": 11,
    "micro-batches": 12,
    "precision": 13,
    "batch size": 14,
    "checkpointing": 15,
    "rung": 16,
    "held back": 17,
    "skipped batch": 18,
    "loss weighting": 19,
    "other": 20,
}


def _small_run(limit: int = 50 * GiB) -> dict:
    """30 steps over three epochs, one decision of every kind, a stop, a resume and two unmarked kinds."""
    steps = [
        {
            "step": i, "epoch": i // 10, "allocated_bytes": 30 * GiB, "peak_bytes": (40 + i % 3) * GiB,
            "limit_bytes": limit, "k": 1 if i < 12 else 2, "precision": "32-true" if i < 13 else "64-true",
            "samples": 64, "step_time_s": 0.1, "data_wait_fraction": 0.1,
        }
        for i in range(30)
    ]  # fmt: skip
    decisions = [
        {"step": step, "kind": kind if kind != "other" else "workers", "data": {}, "message": ""}
        for kind, step in MARKED.items()
        if kind not in ("oom", "held back")
    ]
    decisions[0]["data"] = {"k_before": 1, "k_after": 2}  # micro-batches: up
    decisions.append(
        {"step": 22, "kind": "micro-batches", "data": {"k_before": 2, "k_after": 1}, "message": ""}
    )
    decisions.append(
        {"step": 25, "kind": "held back", "data": {"held_step": MARKED["held back"]}, "message": ""}
    )
    decisions += [
        {"step": 5, "kind": kind, "data": {}, "message": ""} for kind in ("strategy", "recompilation")
    ]
    decisions.append({"step": 27, "kind": "stop", "data": {}, "message": ""})
    return {
        "run": {"device": "cpu"},
        "steps": steps,
        "decisions": decisions,
        "ooms": [_record(MARKED["oom"])],
        "resumes": [{"step": 8, "steps_before": 8}],
    }


def test_report_plot_and_report_do_not_import_each_other_in_a_circle():
    """report.py imports report_plot.py (inside the functions that draw); report_plot.py never imports report.py,
    at any level, type-only imports included: what both need lives in report_series.py, below both."""
    import ast

    from tests.helpers import REPO

    def imported(name: str) -> set[str]:
        tree = ast.parse((REPO / "lightning_gpuopt" / f"{name}.py").read_text())
        found = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        return found | {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        }

    assert "lightning_gpuopt.report_plot" in imported("report")
    assert "lightning_gpuopt.report" not in imported("report_plot")
    assert not {"lightning_gpuopt.report", "lightning_gpuopt.report_plot"} & imported("report_series")


def _run_figure(report: dict):
    from lightning_gpuopt.report_plot import _run_figure, require_matplotlib

    return _run_figure(require_matplotlib(), report)


@pytest.fixture
def closing():
    import matplotlib.pyplot as plt

    figures: list = []
    yield figures.append
    for fig in figures:
        plt.close(fig)


def _marker_path(marker: str):
    from matplotlib.markers import MarkerStyle

    style = MarkerStyle(marker)
    return style.get_path().transformed(style.get_transform())


def test_the_run_picture_has_its_four_panels_and_their_axes(closing):
    fig = _run_figure(_small_run())
    closing(fig)
    lanes, mem, split, speed = fig.axes[:4]
    assert "cpu" in lanes.get_title(loc="left") and "k 1 → 2" in lanes.get_title(loc="left")
    assert mem.get_ylabel() == "memory (GiB)"
    assert split.get_ylabel() == "k"
    assert speed.get_ylabel() == "samples/s (10-step mean)" and speed.get_xlabel() == "global step"
    twins = {ax.get_ylabel() for ax in fig.axes[4:]}
    assert "data wait, % (10-step mean)" in twins
    precision = [ax for ax in fig.axes[4:] if ax.bbox.bounds == split.bbox.bounds]
    # bottom to top: the precision with the most significand bits on top
    assert [t.get_text() for t in precision[0].get_yticklabels()] == ["32-true", "64-true"]
    [k_line] = [line for line in split.get_lines() if line.get_label() == "k (micro-batches)"]
    assert list(k_line.get_ydata()) == [1] * 12 + [2] * 18


def test_the_run_picture_marks_each_decision_kind_once_with_its_marker(closing):
    from matplotlib.colors import to_rgba

    from lightning_gpuopt.report_plot import MARKERS

    fig = _run_figure(_small_run())
    closing(fig)
    lanes = fig.axes[0]
    labels = [t.get_text() for t in lanes.get_yticklabels()]
    # one lane per kind, bottom to top in reverse MARKERS order; two k changes, one of every other kind
    assert labels == [f"{MARKERS[k][2]} ({2 if k == 'micro-batches' else 1})" for k in reversed(MARKERS)]
    drawn = {}
    for collection in lanes.collections:
        (x, row), *more = collection.get_offsets().tolist()
        assert not more or all(r == row for _, r in more)
        kind = list(reversed(MARKERS))[int(row)]
        drawn.setdefault(kind, []).append((collection, [x] + [m[0] for m in more]))
    assert set(drawn) == set(MARKERS)  # the unmarked kinds (strategy, recompilation) add no lane
    for kind, shown in drawn.items():
        marker, color, _ = MARKERS[kind]
        if kind == "micro-batches":  # more micro-batches down, fewer up
            assert [xs for _, xs in shown] == [[12], [22]]
            paths = [c.get_paths()[0] for c, _ in shown]
            assert [p.vertices.tolist() for p in paths] == [_marker_path(m).vertices.tolist() for m in "v^"]
            continue
        ((collection, xs),) = shown
        assert xs == [MARKED[kind]], kind
        assert collection.get_paths()[0].vertices.tolist() == _marker_path(marker).vertices.tolist(), kind
        assert tuple(collection.get_facecolor()[0]) == pytest.approx(to_rgba(color)), kind


def test_the_run_picture_draws_the_limit_or_says_it_is_above_the_axis(closing):
    fig = _run_figure(_small_run(limit=50 * GiB))
    closing(fig)
    mem = fig.axes[1]
    [limit] = [line for line in mem.get_lines() if line.get_label() == "limit"]
    assert set(limit.get_ydata()) == {50.0} and limit.get_linestyle() == "--"
    assert mem.get_ylim()[1] > 50
    far = _run_figure(_small_run(limit=1000 * GiB))
    closing(far)
    mem = far.axes[1]
    assert not [line for line in mem.get_lines() if line.get_label() == "limit"]
    assert [t.get_text() for t in mem.texts] == ["limit 1000.00 GiB: above the axis"]
    assert mem.get_ylim()[1] < 100  # the curves keep the axis


def test_the_run_picture_marks_epochs_stops_resumes_and_ooms(closing):
    fig = _run_figure(_small_run())
    closing(fig)
    lanes, mem, split, speed = fig.axes[:4]
    for ax in (lanes, mem, split, speed):
        vertical = sorted(
            (line.get_xdata()[0], line.get_linestyle())
            for line in ax.get_lines()
            if list(line.get_xdata()) == [line.get_xdata()[0]] * 2
        )
        assert vertical == [(8, "-"), (10, ":"), (20, ":"), (27, "--")], ax.get_ylabel()
    assert [t.get_text() for t in lanes.texts] == ["epoch 1", "epoch 2"]  # Lightning counts epochs from 0
    [ooms] = [c for c in mem.collections if c.get_label() == "OOM: in use + request"]
    # at what it needed (64 GiB in use + 4 requested), capped just under the axis's top
    bottom, top = mem.get_ylim()
    [(x, y)] = ooms.get_offsets().tolist()
    assert x == MARKED["oom"] and y == pytest.approx(top - 0.03 * (top - bottom)) and top < 68
    legend = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    for label in ("peak in step", "limit", "OOM: in use + request", "epoch start", "stopped", "resumed"):
        assert label in legend


def test_the_oom_picture_draws_the_bars_the_request_the_limit_and_the_words(closing):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from lightning_gpuopt.report_plot import CATEGORY_COLORS, _oom_figure

    record = _record(3)
    peak = {"rank": 0, "step": 5, "peak_bytes": 66 * GiB, "categories": dict(record["categories"])}
    peak["activations_measured"] = False
    fig = _oom_figure(plt, record, peak)
    closing(fig)
    bars, words = fig.axes
    assert fig._suptitle.get_text() == "Out of memory at step 3 on rank 0: train, backward"
    assert [t.get_text() for t in bars.get_xticklabels()] == ["at the OOM", "highest peak\n(step 5)"]
    filled = [p for p in bars.patches if p.get_facecolor()[3] > 0]
    at_oom = [(p.get_height(), p.get_facecolor()) for p in filled if p.get_x() < 0.5]
    expected = [(8.0, "parameters"), (8.0, "gradients"), (16.0, "optimizer_state"), (30.0, "activations")]
    expected.append((6.0, "other"))
    assert [h for h, _ in at_oom] == [h for h, _ in expected]
    assert [tuple(c) for _, c in at_oom] == [to_rgba(CATEGORY_COLORS[name]) for _, name in expected]
    at_peak = [(p.get_height(), tuple(p.get_facecolor())) for p in filled if p.get_x() > 0.5]
    assert at_peak[-1] == (36.0, to_rgba(CATEGORY_COLORS["activations_and_other"]))  # not measured apart
    [request] = [p for p in bars.patches if p.get_hatch() == "///"]
    assert (request.get_y(), request.get_height()) == (68.0, 4.0)  # on top of the 68 GiB in use
    [limit] = bars.get_lines()
    assert list(limit.get_ydata()) == [70.0, 70.0]
    assert "limit 70.00 GiB" in [t.get_text() for t in bars.texts]
    legend = [t.get_text() for t in bars.get_legend().get_texts()]
    assert legend == [
        "parameters",
        "gradients",
        "optimizer state",
        "activations",
        "other",
        "activations + other",
    ]
    assert not words.axison and words.texts[0].get_text().startswith("What the pack did: micro-batch 32 → 16")
