"""GPUOptReport: the per-step record, the decisions at their steps, the JSON, the picture, `gpuopt report`."""

from __future__ import annotations

import json
import re
import struct
import sys

import lightning.pytorch as pl
import pytest

from lightning_gpuopt import GPUOptReport, GPUOptWarning, OOMRecovery
from lightning_gpuopt.cli import main
from lightning_gpuopt.report import PNG_DPI, PNG_SIZE, load_report, summary_rows
from tests.callbacks.oom_models import WideRegressor, fit, step_marks
from tests.helpers import TRAINER_QUIET, MetricsLogger


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def oom_run(tmp_path_factory):
    """A short fit under SimulatedMemory whose limit forces an OOM at step 3 (OOMRecovery splits the batch)."""
    calibration = fit(WideRegressor("adam"), [OOMRecovery()], steps=3)
    start, _, forward_peak = step_marks(calibration.model)
    limit = start + int(0.7 * (forward_peak - start))

    class LimitAt(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            from lightning_gpuopt.memory import get_probe

            if trainer.global_step == 3:
                get_probe().limit_bytes = limit

    folder = tmp_path_factory.mktemp("run")
    report, logger = GPUOptReport(dirpath=str(folder)), MetricsLogger()
    run = fit(
        WideRegressor("adam"), [LimitAt(), OOMRecovery(), report], steps=8, logger=logger, log_every_n_steps=2
    )
    return run, report, folder, limit, logger


def test_json_holds_every_step_the_memory_series_and_the_oom_at_its_step(oom_run):
    _, report, folder, limit, _ = oom_run
    saved = json.loads((folder / "gpuopt_report.json").read_text())
    assert saved == json.loads(json.dumps(report.report))  # what the callback holds is what it wrote
    steps = saved["steps"]
    assert [s["step"] for s in steps] == list(range(8))
    assert all(s["allocated_bytes"] > 0 and s["peak_bytes"] >= s["allocated_bytes"] for s in steps)
    assert all(s["peak_bytes"] <= limit for s in steps[3:])  # from the limit on, every step fits under it
    assert [s["k"] for s in steps[:3]] == [1, 1, 1] and all(s["k"] > 1 for s in steps[3:])
    assert [s["limit_bytes"] for s in steps[:3]] == [None] * 3  # no limit yet (SimulatedMemory without one)
    assert steps[-1]["micro_batch_size"] == -(-128 // steps[-1]["k"]) and steps[-1]["precision"] == "64-true"
    assert steps[3]["limit_bytes"] == limit
    ooms = [d for d in saved["decisions"] if d["kind"] == "oom"]
    changes = [d for d in saved["decisions"] if d["kind"] == "micro-batches"]
    assert ooms and {d["step"] for d in ooms} == {3} and ooms[0]["data"]["phase"] == "forward"
    assert (
        changes
        and changes[-1]["data"]["k_after"] == steps[-1]["k"]
        and "optimizer batch 128 kept" in changes[-1]["message"]
    )
    assert saved["run"]["memory_kind"] == "simulated" and saved["run"]["device"] == "cpu"


def test_png_is_a_valid_picture_of_the_expected_size(oom_run):
    _, report, folder, _, _ = oom_run
    assert report.paths["png"] == str(folder / "gpuopt_report.png")
    assert _png_size(folder / "gpuopt_report.png") == (int(PNG_SIZE[0] * PNG_DPI), int(PNG_SIZE[1] * PNG_DPI))


def test_memory_and_throughput_go_to_the_logger(oom_run):
    *_, logger = oom_run
    logged = {step: m for step, m in logger.rows if "gpuopt/memory_peak" in m}
    assert sorted(logged) == [1, 3, 5, 7]  # every log_every_n_steps, on Lightning's step numbers
    assert all(isinstance(m["gpuopt/memory_allocated"], float) for m in logged.values())
    assert all(m["gpuopt/samples_per_s"] > 0 for step, m in logged.items() if step > 1)
    assert not any("gpuopt/mfu" in m for m in logged.values())  # MFU only on CUDA


def test_gpuopt_report_reproduces_the_table_and_redraws_the_picture(oom_run, tmp_path, capsys, monkeypatch):
    _, report, folder, _, _ = oom_run
    monkeypatch.setenv("COLUMNS", "400")  # a wide terminal: long decision lines stay on one line to compare
    main(["report", str(folder), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = summary_rows(load_report(folder))
    assert rows == summary_rows(report.report)
    assert any(what == "decisions" and "oom" in value for what, value in rows)
    for what, value in rows:
        assert what.strip() in out and value.split(" (")[0] in out, (what, value)
    assert _png_size(tmp_path / "gpuopt_report.png") == _png_size(folder / "gpuopt_report.png")


NOT_RUNS = {
    "a picture": ("gpuopt_report.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"),
    "a text file": ("notes.txt", b"not a report"),
    "a JSON list": ("gpuopt_report.json", b"[1, 2]"),
    "JSON without a format": ("other.json", b'{"steps": []}'),
    "another format": ("manifest.json", b'{"format": "lightning_gpuopt.memmap/1"}'),
    "a missing path": (None, None),
    "a folder without a report": ("", None),
}


@pytest.mark.parametrize("what", list(NOT_RUNS), ids=list(NOT_RUNS))
def test_gpuopt_report_on_a_path_that_is_no_run_says_what_to_pass_in_one_line(what, tmp_path, capsys):
    name, content = NOT_RUNS[what]
    path = tmp_path / (name if name is not None else "missing")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(path)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuopt report: ") and captured.out == "", captured
    assert repr(str(path))[1:-1] in lines[0] and "log directory" in lines[0], lines[0]
    assert "codec" not in lines[0] and "Traceback" not in lines[0]


def test_without_matplotlib_the_json_and_table_are_written_and_the_extra_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    report = GPUOptReport(dirpath=str(tmp_path), table=False)
    with pytest.warns(GPUOptWarning, match=r"pip install 'lightning_gpuopt\[plot\]'"):
        pl.Trainer(max_steps=2, callbacks=[report], **TRAINER_QUIET).fit(
            WideRegressor("adam", hidden=16), _tiny_loader()
        )
    assert (tmp_path / "gpuopt_report.json").is_file() and not (tmp_path / "gpuopt_report.png").exists()
    with pytest.raises(ImportError, match=r"pip install 'lightning_gpuopt\[plot\]'"):
        pl.Trainer(
            max_steps=2, callbacks=[GPUOptReport(dirpath=str(tmp_path), plot=True)], **TRAINER_QUIET
        ).fit(WideRegressor("adam", hidden=16), _tiny_loader())


def test_plot_and_table_can_be_turned_off_and_every_n_steps_thins_the_record(tmp_path, capsys):
    report = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False, every_n_steps=2)
    pl.Trainer(max_steps=6, callbacks=[report], **TRAINER_QUIET).fit(
        WideRegressor("adam", hidden=16), _tiny_loader()
    )
    assert [s["step"] for s in report.report["steps"]] == [0, 2, 4]
    assert not (tmp_path / "gpuopt_report.png").exists() and report.paths["png"] is None
    assert "gpuopt report" not in capsys.readouterr().out


def test_a_short_last_batch_is_not_shown_as_a_split(tmp_path):
    from torch.utils.data import DataLoader

    from tests.callbacks.oom_models import Waves

    report = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False)
    trainer = pl.Trainer(max_epochs=2, callbacks=[report, OOMRecovery(verbose=False)], **TRAINER_QUIET)
    trainer.fit(WideRegressor("adam", hidden=16), DataLoader(Waves(length=96), batch_size=64))
    assert [s["batch_size"] for s in report.report["steps"]] == [64, 32, 64, 32]  # recorded as they ran
    rows = dict(summary_rows(report.report))
    assert rows["micro-batches k"] == "1 -> 1 (max 1); micro-batch 64 -> 64 of batch 64"


def test_a_step_held_back_for_non_finite_values_is_a_decision(tmp_path):
    from lightning_gpuopt import PrecisionSwitch
    from tests.callbacks.precision_models import Troubled

    report = GPUOptReport(dirpath=str(tmp_path), plot=False, table=False)
    trainer = pl.Trainer(max_steps=6, callbacks=[PrecisionSwitch(), report], **TRAINER_QUIET)
    trainer.fit(Troubled(overflow=(3, 4), bad_in="always"), _tiny_loader())
    (held,) = [d for d in report.report["decisions"] if d["kind"] == "held back"]
    assert held["source"] == "PrecisionSwitch" and held["data"]["held_step"] == 3
    assert held["message"] == "step 3 not applied: non-finite loss in 32-true (1 in a row; patience 2)"
    assert dict(summary_rows(report.report))["decisions"] == "1 held back"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"plot": "yes"}, r"`plot` must be True, False or 'auto', got 'yes'"),
        ({"table": 1}, r"`table` must be True or False, got 1"),
        ({"every_n_steps": 0}, r"`every_n_steps` must be a positive int, got 0"),
    ],
    ids=["plot", "table", "every-n"],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPUOptReport(**kwargs)


def _tiny_loader():
    from torch.utils.data import DataLoader

    from tests.callbacks.oom_models import Waves

    return DataLoader(Waves(length=256), batch_size=32)


LIMITS = {
    "constant": [1000] * 4,
    "lowered": [1000, 1000, 700, 700],
    "raised": [1000, 1000, 1200, 1200],
    "set mid-run": [None, None, 700, 700],
    "none": [None] * 4,
}


@pytest.mark.parametrize("limits", list(LIMITS), ids=list(LIMITS))
def test_the_peak_is_a_share_of_a_limit_only_where_the_limit_held_still(limits):
    peaks = [1000, 990, 650, 690]  # the run's peak came before any lowering: 143 % of the lowered limit
    steps = [
        {"step": i, "peak_bytes": p, "allocated_bytes": 1, "limit_bytes": v, "k": 1, "micro_batch_size": 8,
         "batch_size": 8, "precision": "32-true", "samples": 8, "step_time_s": None}
        for i, (p, v) in enumerate(zip(peaks, LIMITS[limits]))
    ]  # fmt: skip
    row = dict(summary_rows({"run": {"memory_kind": "simulated"}, "steps": steps, "decisions": []}))
    text = row["peak memory (simulated)"]
    assert text.startswith("1000 B")
    changed = len({v for v in LIMITS[limits]}) > 1
    assert ("the limit changed during the run" in text) == changed
    shares = [int(s) for s in re.findall(r"(\d+)%", text)]
    if limits == "none":
        assert shares == []
    else:  # one share: the peak's, of a limit that held still, or the highest of any step's in its own limit
        best = max(p / v for p, v in zip(peaks, LIMITS[limits]) if v)
        assert shares == [round(100 * best)] and shares[0] <= 100


def test_the_oom_run_never_shows_a_peak_above_its_limit(oom_run):
    _, report, *_ = oom_run
    text = dict(summary_rows(report.report))["peak memory (simulated)"]
    assert all(int(s) <= 100 for s in re.findall(r"(\d+)%", text)), text
