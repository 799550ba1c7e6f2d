"""The pack's ``gpuopt/*`` metrics: one source and one meaning per name, documented, on Lightning's step numbers.

A fit with every callback of the pack (``gpuopt fit``'s defaults, GradientNoiseScale, AdaptiveBatchSize and
DataStallMonitor) records which callback sent each name, whether it went straight to the loggers or through
``LightningModule.log``: whatever a callback adds later is covered.
"""

from __future__ import annotations

import csv
import inspect
import re
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_gpuopt import (
    AdaptiveBatchSize,
    DataStallMonitor,
    ExactResume,
    GPUOptReport,
    GradientNoiseScale,
    MemoryAwareBatchSize,
    OOMRecovery,
    PrecisionSwitch,
)
from tests.callbacks.oom_models import WideRegressor, fit
from tests.helpers import REPO


def _caller() -> str:
    """The callback (or other object) whose method sent the metrics: the first one on the stack."""
    for frame in inspect.stack()[2:]:
        owner = frame.frame.f_locals.get("self")
        if isinstance(owner, pl.Callback):
            return type(owner).__name__
    return "outside any callback"


def _every_callback() -> list[pl.Callback]:
    return [
        MemoryAwareBatchSize(verbose=False),
        OOMRecovery(verbose=False),
        PrecisionSwitch(initial="keep", verbose=False),
        GradientNoiseScale(),
        AdaptiveBatchSize(),
        DataStallMonitor(),
        GPUOptReport(plot=False, table=False),
        ExactResume(),
    ]


def test_every_gpuopt_metric_name_has_one_source_and_is_documented(tmp_path, monkeypatch):
    sources: dict[str, set[str]] = defaultdict(set)
    logged = CSVLogger.log_metrics
    module_log = pl.LightningModule.log

    def to_logger(self, metrics, step=None):
        for name in metrics:
            if name.startswith("gpuopt/"):
                sources[name].add(_caller())
        return logged(self, metrics, step)

    def through_module(self, name, value, *args, **kwargs):
        if name.startswith("gpuopt/"):
            sources[name].add(_caller())
        return module_log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(CSVLogger, "log_metrics", to_logger)
    monkeypatch.setattr(pl.LightningModule, "log", through_module)
    callbacks = _every_callback()
    report = next(c for c in callbacks if isinstance(c, GPUOptReport))
    report.dirpath = str(tmp_path)
    logger = CSVLogger(str(tmp_path), name="csv")
    fit(WideRegressor("adam"), callbacks, limit=2**30, steps=6, logger=logger, log_every_n_steps=1)
    assert {"gpuopt/memory_peak", "gpuopt/k", "gpuopt/micro_batch_size", "gpuopt/precision"} <= set(sources)
    assert {"gpuopt/precision_index", "gpuopt/search_trials", "gpuopt/data_wait_fraction"} <= set(sources)
    shared = {name: sorted(who) for name, who in sources.items() if len(who) != 1}
    assert not shared, f"names sent by more than one source: {shared}"
    # docs/report.md lists every name once, with its source; a name of two meanings would need two rows.
    page = (REPO / "docs" / "report.md").read_text()
    rows = re.findall(r"^\| `(gpuopt/[a-z_]+)` \| (\w+) \|", page, flags=re.MULTILINE)
    listed = dict(rows)
    assert len(listed) == len(rows), "a name listed twice in docs/report.md"
    assert {name: listed.get(name) for name in sources} == {
        name: next(iter(who)) for name, who in sources.items()
    }


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


CELLS = [(1, 1), (3, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize(("every", "accumulate"), CELLS, ids=[f"log_every={n}-A={a}" for n, a in CELLS])
def test_gpuopt_rows_share_lightnings_step_numbers(every, accumulate, tmp_path):
    """CSVLogger's metrics.csv: the report's rows fall on the steps of Lightning's own rows (``self.log``), and no
    ``gpuopt/*`` row has a step number Lightning's rows do not use."""
    logger = CSVLogger(str(tmp_path), name="csv")
    callbacks = [
        PrecisionSwitch(initial="keep", verbose=False),
        DataStallMonitor(),
        GPUOptReport(dirpath=str(tmp_path), plot=False, table=False),
    ]
    steps = 7
    fit(
        WideRegressor("adam"),
        callbacks,
        steps=steps,
        accumulate=accumulate,
        logger=logger,
        log_every_n_steps=every,
    )
    rows = _rows(Path(logger.log_dir) / "metrics.csv")
    lightning = [int(r["step"]) for r in rows if r.get("train_loss")]
    assert lightning == [s for s in range(steps) if (s + 1) % every == 0]
    report = [int(r["step"]) for r in rows if r.get("gpuopt/memory_peak")]
    assert report == lightning
    events = [int(r["step"]) for r in rows if any(v for k, v in r.items() if k.startswith("gpuopt/"))]
    assert set(events) <= set(range(steps)) and 0 in events  # PrecisionSwitch's precision at step 0
