"""What a user reads in an ordinary run says what they can act on, in their words, not the pack's internals.

Every line of a run is collected (log records, warnings, what is printed: the report's table included): a
`gpuopt fit` with its default callbacks, and a fit with every callback of the pack through the Python API,
under SimulatedMemory, with the batch-size search and an OOM that makes OOMRecovery split the batch. No line may hold one of the pack's internal words (how the search predicts, the engine's parts) or a
private name (an identifier that starts with ``_``).
"""

from __future__ import annotations

import logging
import re
import warnings

import lightning.pytorch as pl
import pytest

from lightning_gpuopt import (
    AdaptiveBatchSize,
    DataStallMonitor,
    GPUOptReport,
    GradientNoiseScale,
    MemoryAwareBatchSize,
    OOMRecovery,
    PrecisionSwitch,
)
from lightning_gpuopt.cli import main
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import IndexedData40, RecordingRegressor

#: Words of the pack's insides: how the batch-size search predicts (traces), the micro-batch engine and its
#: parts (the attempt loop, the ranks' vote and exchange, the window's stashed gradients, recovery rungs).
INTERNAL_WORDS = re.compile(
    r"\btrac(?:e|es|ed|ing)\b|\brungs?\b|\battempt loop\b|\bengine\b|\bstash(?:ed)?\b|\bvotes?\b|\bexchange\b"
    r"|\bhand(?:ed)?[- ]over\b",
    re.IGNORECASE,
)
#: The pack's classes a user never makes: naming one tells them nothing.
INTERNAL_CLASSES = re.compile(
    r"\b(?:MicroBatchEngine|AttemptLoop|TrainingBatch|EvalBatch|SizeSearch|PredictedSearch|Tracer|TrialSteps"
    r"|LocalExchange|DDPExchange|FSDP2Exchange|EngineState|Agreement|OOMFailure|KChange|CannotPredict)\b"
)
#: A private name: ``_`` then a letter, not inside a path or a word (``/tmp/x_y``, ``max_steps``).
PRIVATE_NAME = re.compile(r"(?<![\w./\\-])_[A-Za-z]\w*")


def internal(line: str) -> list[str]:
    """The internal words and private names in ``line``."""
    return [
        m.group(0)
        for pattern in (INTERNAL_WORDS, INTERNAL_CLASSES, PRIVATE_NAME)
        for m in pattern.finditer(line)
    ]


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("auto: measured steps, a real step 0.003 s against a trace stopped after 0.020 s", ["trace"]),
        ("5 traces cost more than the step they save", ["traces"]),
        ("AttributeError: 'MyData' object has no attribute '_datasets'", ["_datasets"]),
        ("OOM raised by _rank_peaks in callbacks/report.py", ["_rank_peaks"]),
        ("the micro-batch engine's attempt checks", ["engine"]),
        ("PredictedSearch handed over to the measured search", ["handed over", "PredictedSearch"]),
        ("`Trainer.fit` stopped: `max_steps=2` reached.", []),
        ("wrote /tmp/run_1/_x/gpuopt_report.json", []),
        ("micro-batch 64 -> 32 (k 1 -> 2); optimizer batch 64 kept", []),
    ],
)
def test_the_check_finds_internal_words(line, found):
    assert sorted(internal(line)) == sorted(found)


class Lines:
    """Every line a run shows: log records, warnings, and what it printed."""

    def __init__(self, caplog, capsys) -> None:
        self.caplog, self.capsys = caplog, capsys
        self.caught: list[warnings.WarningMessage] = []

    def run(self, fit) -> None:
        with self.caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit()
        self.caught += caught

    def all(self) -> list[str]:
        printed = self.capsys.readouterr()
        texts = [r.getMessage() for r in self.caplog.records]
        texts += [str(w.message) for w in self.caught] + [printed.out, printed.err]
        return [line for text in texts for line in text.splitlines() if line.strip()]


def _assert_plain(lines: list[str], expected: tuple[str, ...]) -> None:
    for wanted in expected:  # the lines this test is about were shown
        assert any(wanted in line for line in lines), (wanted, lines)
    bad = {line: internal(line) for line in lines if internal(line)}
    assert not bad, bad


TINY_CONFIG = """\
seed_everything: 3
trainer:
  enable_progress_bar: false
  max_epochs: 1
model:
  class_path: tests.helpers.RecordingRegressor
data:
  class_path: tests.helpers.IndexedData40
  init_args:
    batch_size: 4
    num_workers: 0
"""


@pytest.mark.usefixtures("cli_argv")
def test_the_lines_of_a_default_gpuopt_fit(tmp_path, caplog, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    lines = Lines(caplog, capsys)

    def fit():
        with SimulatedMemory("64MiB"):
            main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)])

    lines.run(fit)
    _assert_plain(lines.all(), ("MemoryAwareBatchSize (fit start)", "PrecisionSwitch", "gpuopt summary"))


class LowerTheLimit(pl.Callback):
    """After ``at`` steps the simulated device shrinks so that a whole batch no longer fits (what a step held
    at its start, plus 75 % of what it added at its peak): OOMRecovery splits the next batch."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.start = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        probe = get_probe()
        probe.reset_peak()
        self.start = probe.allocated_bytes

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            probe = get_probe()
            probe.limit_bytes = self.start + int(0.75 * (probe.peak_bytes - self.start))


def test_the_lines_of_a_fit_with_every_callback_and_an_oom(tmp_path, caplog, capsys):
    lines = Lines(caplog, capsys)
    callbacks = [
        PrecisionSwitch(),
        MemoryAwareBatchSize(),
        OOMRecovery(),
        DataStallMonitor(),
        GradientNoiseScale(),
        AdaptiveBatchSize(),
        GPUOptReport(),
        LowerTheLimit(at=2),
    ]
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )

    def fit():
        with SimulatedMemory("64MiB"):
            trainer.fit(RecordingRegressor(hidden=2048), IndexedData40(batch_size=16, num_workers=0))

    lines.run(fit)
    oom = callbacks[2]
    assert oom.failures and oom.k >= 2  # the OOM happened and was recovered from by a split
    _assert_plain(lines.all(), ("MemoryAwareBatchSize (fit start)", "OOM at step", "GPUOptReport: wrote"))
