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
