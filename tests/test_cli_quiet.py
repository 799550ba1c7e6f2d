"""`gpuopt fit` causes no warning of its own making: on a fresh run, a stop by SIGTERM or a resume. Each warning
Lightning or torch still gives is on docs/cli.md's list ("What Lightning and torch still print"), with why it is
left there. Python's default filters apply, as in a user's run (deprecation warnings of other packages hidden)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from lightning_gpuopt import GPUOptWarning
from lightning_gpuopt.cli import main
from tests.helpers import REPO

pytestmark = pytest.mark.usefixtures("cli_argv")

TINY_CONFIG = """\
seed_everything: 3
trainer:
  enable_progress_bar: false
  enable_model_summary: false
  max_epochs: 1
model:
  class_path: tests.helpers.RecordingRegressor
data:
  class_path: tests.helpers.IndexedData40
  init_args:
    batch_size: 4
    num_workers: 0
"""


def documented_patterns() -> list[re.Pattern[str]]:
    """The patterns of docs/cli.md's table of what Lightning and torch still print (first column)."""
    text = (REPO / "docs" / "cli.md").read_text()
    section = text.split("## What Lightning and torch still print", 1)[1].split("\n## ", 1)[0]
    patterns = [re.compile(m.group(1)) for m in re.finditer(r"^\| `([^`]+)` \|", section, re.MULTILINE)]
    assert patterns, "docs/cli.md lists no patterns"
    return patterns


def _fit_collecting_warnings(args: list[str]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # as Python's default filters do in a user's run: other packages' deprecations are hidden
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=PendingDeprecationWarning)
        warnings.filterwarnings("always", module="lightning_gpuopt")
        main(args)
    return list(caught)


def _of_the_pack(caught: list[warnings.WarningMessage]) -> list[str]:
    package = str(REPO / "lightning_gpuopt")
    return [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, GPUOptWarning) or w.filename.startswith(package)
    ]


@pytest.mark.parametrize("logger", ["false", "default"], ids=["no-logger", "lightnings-default-logger"])
def test_a_fit_a_sigterm_stop_and_a_resume_give_no_warning_of_the_pack(tmp_path: Path, logger: str):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "run")]
    args += ["--trainer.logger", "false"] if logger == "false" else []
    stop = ["--trainer.callbacks+=tests.resume_child.Fault", "--trainer.callbacks.term_batch=3"]
    caught = _fit_collecting_warnings([*args, *stop])  # ExactResume takes the SIGTERM: a stop at step 4
    caught += _fit_collecting_warnings(args)  # resumes mid-epoch, and finishes the epoch
    (last,) = (tmp_path / "run").glob("**/checkpoints/last.ckpt")  # the default logger's: in the run's folder
    assert torch.load(last, weights_only=True, mmap=True)["global_step"] == 10
    caught += _fit_collecting_warnings(args)  # finished: nothing to do
    if logger == "default":
        caught += _fit_collecting_warnings([*args, "--ckpt_path", "null"])  # afresh, in the run's folder
    assert _of_the_pack(caught) == []
    patterns = documented_patterns()
    undocumented = sorted(
        {str(w.message) for w in caught if not any(p.search(str(w.message)) for p in patterns)}
    )
    assert undocumented == [], "add these to docs/cli.md, with why they are left"
