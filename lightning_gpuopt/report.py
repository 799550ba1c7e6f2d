"""What GPUOptReport writes and how it is shown: the JSON record, its files, and the picture drawn from it.

Pure functions over the plain record (a dict, as stored in ``gpuopt_report.json``), so the callback
at the end of ``fit`` and ``gpuopt report RUN_DIR`` afterwards render the same table and picture. The table and
the OOM records as text are ``report_text.py``'s (re-exported here).

The record::

    {"format": "lightning_gpuopt.report/1", "run": {...}, "steps": [{...}, ...], "decisions": [{...}, ...]}

Every field is explained in docs/report.md.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_gpuopt.report_series import (
    PNG_DPI,
    PNG_SIZE,
    THROUGHPUT_WINDOW,
    precision_code,
    windowed_samples_per_s,
)
from lightning_gpuopt.report_text import (
    format_oom,
    format_table,
    oom_listing,
    oom_rows,
    print_table,
    run_peak_bytes,
    run_samples_per_s,
    summarize_values,
    summary_rows,
)

__all__ = [
    "FORMAT",
    "JSON_NAME",
    "PNG_DPI",
    "PNG_NAME",
    "PNG_SIZE",
    "RANK_JSON_NAME",
    "THROUGHPUT_WINDOW",
    "ReportField",
    "StepClock",
    "format_oom",
    "format_table",
    "load_report",
    "mfu",
    "oom_listing",
    "oom_rows",
    "precision_code",
    "print_table",
    "remove_rank_parts",
    "render_png",
    "report_json",
    "run_peak_bytes",
    "run_samples_per_s",
    "summarize_values",
    "summary_rows",
    "windowed_samples_per_s",
    "write_oom_pictures",
    "write_rank_part",
    "write_report",
]

FORMAT = "lightning_gpuopt.report/1"
JSON_NAME = "gpuopt_report.json"
PNG_NAME = "gpuopt_report.png"
#: After an error, each other rank's part beside rank zero's JSON (``{rank}``: its global rank).
RANK_JSON_NAME = "gpuopt_report_rank{rank}.json"


#: The per-step fields GPUOptReport records itself: a :class:`ReportField` may not take these names.
STEP_FIELDS = (
    "step",
    "epoch",
    "batch_idx",
    "time_s",
    "allocated_bytes",
    "peak_bytes",
    "reserved_bytes",
    "limit_bytes",
    "alloc_retries",
    "k",
    "batch_size",
    "micro_batch_size",
    "precision",
    "data_wait_fraction",
    "samples",
    "step_time_s",
    "mfu",
    "noise_scale",
)

_PLAIN = (int, float, str, bool, type(None))


@dataclass(frozen=True)
class ReportField:
    """A per-step field of your own for :class:`~lightning_gpuopt.GPUOptReport` (``GPUOptReport(fields=[...])``).

    At every recorded step ``read(trainer, pl_module)`` gives the value (a number, a string, a bool or
    ``None``); it goes into each step of the JSON record under ``name`` and, summarised by
    :func:`summarize_values`, into a row ``label`` of the table (also in ``gpuopt report DIR``, which
    reads the field's name and label from the JSON's ``run.fields``).

    Args:
        name: the key in each step record: letters, digits and ``_``, not one of :data:`STEP_FIELDS`.
        read: called at the end of each recorded training batch with ``(trainer, pl_module)``.
        label: the table row's label; ``None``: ``name``.

    Raises:
        ValueError: a name that is empty, not an identifier, or one the report records itself.
        TypeError: ``read`` is not callable.

    Example:
        >>> field = ReportField("lr", lambda trainer, module: trainer.optimizers[0].param_groups[0]["lr"],
        ...                     label="learning rate")
        >>> field.name, field.label
        ('lr', 'learning rate')
        >>> summarize_values([0.1, 0.1, 0.05])
        '0.05 at the last step (min 0.05, median 0.1, max 0.1)'
    """

    name: str
    read: Callable[[Any, Any], Any]
    label: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(
                f"ReportField `name` must be a non-empty identifier (letters, digits, _), got {self.name!r}"
            )
        if self.name in STEP_FIELDS:
            raise ValueError(
                f"ReportField `name` {self.name!r} is a field GPUOptReport records itself ({', '.join(STEP_FIELDS)}); "
                "pick another name."
            )
        if not callable(self.read):
            raise TypeError(f"ReportField `read` must be callable (trainer, pl_module), got {self.read!r}")
        if self.label is None:
            object.__setattr__(self, "label", self.name)

    def value(self, trainer: Any, pl_module: Any) -> Any:
        """``read(trainer, pl_module)``, checked: a number (a 0-d tensor becomes one), a string, a bool or ``None``."""
        value = self.read(trainer, pl_module)
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            value = value.item()
        if not isinstance(value, _PLAIN):
            raise TypeError(
                f"ReportField {self.name!r}: `read` must return a number, a string, a bool or None (what JSON "
                f"holds), got {type(value).__name__}; convert it in `read` (e.g. float(x))."
            )
        return value


def mfu(
    flops_per_batch: float | None, seconds_per_batch: float | None, peak_flops: float | None
) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak; ``None`` when a figure is missing.

    Example:
        >>> mfu(flops_per_batch=4e12, seconds_per_batch=0.01, peak_flops=989e12)  # 400 TFLOP/s achieved
        0.4044...
    """
    if not flops_per_batch or not seconds_per_batch or not peak_flops:
        return None
    return flops_per_batch / seconds_per_batch / peak_flops


class StepClock:
    """The wall time of each training step, as the report and the ``gpuopt fit`` summary both count it.

    A step's time runs from the end of the previous training batch (or the start of its epoch, or the end
    of a validation run) to the end of its own: waiting for data is included, validation is not. The first
    batch of each epoch has no time (it pays for starting the loader). docs/report.md defines the figures.

    Example:
        >>> clock = StepClock()
        >>> clock.restart()
        >>> clock.start_batch()
        >>> clock.end_batch(batch_idx=0)[1] is None, clock.end_batch(batch_idx=1)[1] >= 0
        (True, True)
    """

    def __init__(self) -> None:
        #: When the last training batch ended (or the epoch started, or validation ended).
        self.last_end: float | None = None
        #: When the current training batch started.
        self.batch_started: float | None = None

    def restart(self) -> None:
        """The epoch starts, or validation ended: the next step's time starts now."""
        self.last_end = time.perf_counter()

    def start_batch(self) -> None:
        self.batch_started = time.perf_counter()

    def end_batch(self, batch_idx: int) -> tuple[float, float | None]:
        """``(now, the step's seconds)``; the seconds are ``None`` for the first batch of an epoch."""
        now = time.perf_counter()
        seconds = now - self.last_end if self.last_end is not None and batch_idx > 0 else None
        self.last_end = now
        return now, seconds


def write_report(
    report: dict[str, Any], folder: str | os.PathLike[str], png: bool = True
) -> tuple[Path, Path | None]:
    """Write ``gpuopt_report.json`` (and the picture, when ``png`` and matplotlib is installed) into ``folder``.

    Returns:
        The JSON path, and the PNG path or ``None`` when no picture was drawn.

    Raises:
        ImportError: ``png`` is ``True`` and matplotlib is missing (the message names the extra).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / JSON_NAME
    json_path.write_text(report_json(report))
    png_path = render_png(report, folder / PNG_NAME) if png else None
    return json_path, png_path


def report_json(report: dict[str, Any]) -> str:
    """The record as JSON text: each of its lists one entry per line (``json``'s C encoder, per entry: a signal's
    stop writes 10,000 steps in a tenth of a second, where an indent for every field took seconds), the rest
    indented.

    Example:
        >>> print(report_json({"format": "f", "steps": [{"step": 0}, {"step": 1}], "resumes": []}))
        {
         "format": "f",
         "steps": [
          {"step": 0},
          {"step": 1}
         ],
         "resumes": []
        }
        <BLANKLINE>
    """
    parts = []
    for key, value in report.items():
        if isinstance(value, list) and value:
            text = "[\n" + ",\n".join("  " + json.dumps(item) for item in value) + "\n ]"
        else:
            text = json.dumps(value, indent=1).replace("\n", "\n ")
        parts.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_rank_part(part: dict[str, Any], folder: str | os.PathLike[str]) -> Path:
    """After an error, a rank other than zero writes its part (its OOM records, peak and peak breakdown) beside the
    report, since nothing was gathered; :func:`load_report` merges it into the run's report."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RANK_JSON_NAME.format(rank=part["rank_peak"]["rank"])
    path.write_text(json.dumps({"format": FORMAT, **part}, indent=1) + "\n")
    return path


def remove_rank_parts(folder: str | os.PathLike[str]) -> None:
    """Remove the ranks' parts an earlier failed fit left in ``folder`` (a new fit writes its own)."""
    for path in Path(folder).glob(RANK_JSON_NAME.format(rank="*")):
        path.unlink(missing_ok=True)


def _merge_rank_parts(report: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A failed run's report with the other ranks' parts written beside it (their OOM records, peaks)."""
    run = report.setdefault("run", {})
    for path in sorted(folder.glob(RANK_JSON_NAME.format(rank="*"))):
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(part, dict) or part.get("format") != FORMAT:
            continue
        peaks = [p for p in run.get("rank_peaks", []) if p.get("rank") != part["rank_peak"]["rank"]]
        run["rank_peaks"] = sorted([*peaks, part["rank_peak"]], key=lambda p: p["rank"])
        known = {(r["rank"], r["time_s"]) for r in report.get("ooms", [])}
        ooms = report.get("ooms", []) + [
            r for r in part.get("ooms", []) if (r["rank"], r["time_s"]) not in known
        ]
        report["ooms"] = sorted(ooms, key=lambda r: (r["rank"], r["time_s"]))
        if part.get("peak_breakdown"):
            report.setdefault("peak_breakdowns", []).append(part["peak_breakdown"])
    return report


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a report from a run directory (or the JSON file itself); after a failed fit, with the other ranks'
    parts written beside it.

    Raises:
        FileNotFoundError: nothing at ``path``, or no ``gpuopt_report.json`` in the directory.
        ValueError: the file is not a report this version reads (another file, another format).
    """
    path = Path(path)
    what = "pass the run's log directory (e.g. lightning_logs/default/run-805e1e93) or its gpuopt_report.json"
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist: {what}.")
    file = path / JSON_NAME if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"No {JSON_NAME} in {str(path)!r}: GPUOptReport writes it into the run's log directory when fit ends "
            "(the logger's folder, e.g. lightning_logs/default/run-805e1e93). Pass that directory."
        )
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{str(file)!r} is not a GPUOptReport (not JSON text): {what}.") from None
    except OSError as err:
        raise ValueError(f"{str(file)!r} cannot be read ({err.strerror or err}): {what}.") from None
    if not isinstance(data, dict) or "format" not in data:
        raise ValueError(f'{str(file)!r} is not a GPUOptReport (JSON without a report\'s "format"): {what}.')
    if data["format"] != FORMAT:
        raise ValueError(
            f"{str(file)!r} has format {data['format']!r}; this version reads {FORMAT!r}: {what} of this version."
        )
    if data.get("run", {}).get("ended_by") == "error":
        return _merge_rank_parts(data, file.parent)
    return data


def render_png(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw the run's picture as a PNG (:func:`lightning_gpuopt.report_plot.render_png`).

    Raises:
        ImportError: matplotlib is missing (the message names the extra to install).
    """
    from lightning_gpuopt.report_plot import render_png as draw

    return draw(report, path)


def write_oom_pictures(
    records: Sequence[dict[str, Any]],
    peak: dict[str, Any] | None,
    folder: str | os.PathLike[str],
    max_files: int,
) -> list[Path]:
    """Draw ``oom_<step>_rank<r>.png`` for the first ``max_files`` of one rank's OOM records into ``folder``; each
    drawn record gets its file name in ``"picture"``. ``peak``: that rank's highest-peak step (``peak_breakdowns``).

    Raises:
        ImportError: matplotlib is missing.
    """
    from lightning_gpuopt.report_plot import oom_picture_name, render_oom_png

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths, seen = [], Counter()
    for record in records[:max_files]:
        key = (record["step"], record["rank"])
        seen[key] += 1
        name = oom_picture_name(record, seen[key])
        paths.append(render_oom_png(record, peak, folder / name))
        record["picture"] = name
    return paths
