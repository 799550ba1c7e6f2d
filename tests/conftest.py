"""Shared test settings: the `cuda` marker skips on machines without a GPU, never fakes one; fixtures that
more than one test file uses (helpers that are not fixtures live in tests/helpers.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (torch.cuda.is_available() is False); run `pytest -m cuda` on one"
    )
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning prints tips and banners on every Trainer; tests assert on their own output.
    monkeypatch.setenv("LIGHTNING_DISABLE_TIPS", "1")


@pytest.fixture(autouse=True)
def _own_main_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # An in-process multi-process fit (ddp_spawn, DDP) takes its store's port from MASTER_PORT: a fresh one
    # per test, outside the ephemeral range that the suite's other processes' connections draw from.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: ResNet steps stay fast when the CI machine's cores are busy (OpenMP
    barriers spin otherwise). Reference and measured runs share it, so figures stay comparable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cli_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sys.argv`` as the ``gpuopt`` command's: LightningCLI warns when sys.argv (pytest's) and ``args`` are both given."""
    monkeypatch.setattr(sys, "argv", ["gpuopt"])
