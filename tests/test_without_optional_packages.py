"""The GPU machine's image has no jsonargparse and no torchdata: the pack imports there, and the CLI says what is missing."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO as ROOT

WITHOUT = ROOT / "tests" / "tools" / "without_packages.py"

PROGRAM = """
import sys
import lightning_gpuopt
from lightning_gpuopt import GPUOptReport, MemoryAwareBatchSize, OOMRecovery, PrecisionSwitch
assert "jsonargparse" not in sys.modules and "torchdata" not in sys.modules, "an optional package was imported"
try:
    lightning_gpuopt.GPUOptCLI(args=["--help"])
except ModuleNotFoundError as err:
    print("CLI:", err)
"""


def test_import_without_jsonargparse_and_torchdata_and_the_cli_names_the_missing_package():
    done = subprocess.run(
        [sys.executable, str(WITHOUT), "jsonargparse,torchdata", "-c", PROGRAM],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CLI: The gpuopt command line (GPUOptCLI) needs 'jsonargparse[signatures]" in done.stdout
    assert "use the Python API" in done.stdout


LAZY = """
import sys
import lightning.pytorch
before = set(sys.modules)
import lightning_gpuopt
from lightning_gpuopt import GPUOptReport, MemoryAwareBatchSize, OOMRecovery
added = sorted({m.split(".")[0] for m in set(sys.modules) - before} | {m for m in sys.modules if "report_plot" in m})
print("added:", added)
lightning_gpuopt.GPUOptCLI
print("after GPUOptCLI:", "jsonargparse" in sys.modules)
"""


def test_import_adds_to_lightning_only_the_pack_itself():
    """What only some commands need (the picture, the CLI's parser) loads when first used, not on import."""
    done = subprocess.run([sys.executable, "-c", LAZY], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "added: ['lightning_gpuopt']" in done.stdout
    assert "after GPUOptCLI: True" in done.stdout
