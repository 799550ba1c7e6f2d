"""Shared test settings: the `cuda` marker skips on machines without a GPU, never fakes one."""

from __future__ import annotations

import pytest
import torch


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
