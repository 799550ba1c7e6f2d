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
