"""Every docstring example of the package runs, so the examples cannot drift from the code."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lightning_gpuopt

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(lightning_gpuopt.__path__, "lightning_gpuopt.")
    if not name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    failures, _ = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert failures == 0, f"{failures} docstring example(s) of {name} failed (output above)"
