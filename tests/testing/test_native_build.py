"""Building and loading the counting allocator: cache, broken compilers, the fallback, message parity."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import REPO


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.usefixtures("native")
def test_oom_message_is_the_same_from_both_backends():
    messages = []
    for backend in ("allocator", "dispatch"):
        with SimulatedMemory(limit_bytes=3 * 2**20, backend=backend):
            keep = torch.empty(2**20 + 123, dtype=torch.uint8)
            try:
                torch.empty(5 * 2**20, dtype=torch.uint8)
            except torch.OutOfMemoryError as err:
                messages.append(str(err))
            del keep
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "CUDA out of memory (simulated). Tried to allocate 5.00 MiB (5242880 bytes); 1.00 MiB (1048699 bytes) in use; "
        "limit 3.00 MiB (3145728 bytes)."
    )


def test_without_a_working_compiler_auto_falls_back_and_allocator_says_why(tmp_path):
    proc = _run(
        """
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from lightning_gpuopt.testing import SimulatedMemory
        with SimulatedMemory(limit_bytes=10_000) as mem:
            try:
                torch.zeros(10_000)
            except torch.OutOfMemoryError:
                print("oom-ok")
        print("backend", mem.backend)
        try:
            SimulatedMemory(backend="allocator").__enter__()
        except RuntimeError as err:
            print("allocator-error", err)
        """,
        LIGHTNING_GPUOPT_CACHE_DIR=str(tmp_path),
        CXX="/bin/false",
    )
    assert proc.returncode == 0, proc.stderr
    assert "oom-ok" in proc.stdout
    assert "backend dispatch" in proc.stdout
    assert (
        "allocator-error SimulatedMemory(backend='allocator') is unavailable: compiling the counting allocator failed"
        in proc.stdout
    )
    assert "use backend='dispatch'" in proc.stdout
    assert "uses its pure-Python backend" in proc.stderr  # said once, as a log record


@pytest.mark.usefixtures("native")
def test_a_cached_build_needs_no_compiler(tmp_path):
    # The library this process built, put where a fresh process with this cache directory looks.
    import shutil

    from lightning_gpuopt.memory import counting_allocator as native

    include, _ = native._torch_dirs()
    cached = os.path.join(native._cache_dir(), f"simmem_{native._build_key(include)}.so")
    target = tmp_path / "simulated_memory" / os.path.basename(cached)
    target.parent.mkdir()
    shutil.copy(cached, target)
    proc = _run(
        """
        from lightning_gpuopt.testing import SimulatedMemory
        with SimulatedMemory() as mem:
            pass
        print(mem.backend)
        """,
        LIGHTNING_GPUOPT_CACHE_DIR=str(tmp_path),
        CXX="/bin/false",  # a build attempt would fail: the cached library must be used as is
    )
    assert proc.stdout.strip() == "allocator", proc.stderr
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # nothing rebuilt


def test_a_built_wheel_ships_the_allocator_source_that_simulated_memory_builds_from(tmp_path):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from lightning_gpuopt.memory import counting_allocator as native

    pytest.importorskip(
        "setuptools", reason="building the wheel without network needs setuptools in this env"
    )
    repo = REPO
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(repo),
        ],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("lightning_gpuopt-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("lightning_gpuopt/memory/counting_allocator.cpp").decode()
    assert shipped == native._SOURCE  # the allocator is built from this very text
    assert "SetCPUAllocator" in shipped and "_SOURCE = r" not in Path(native.__file__).read_text()
