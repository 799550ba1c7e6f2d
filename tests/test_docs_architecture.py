"""docs/architecture.md names every module of the package, so its file tables cannot fall behind the tree."""

from __future__ import annotations

import re

from tests.helpers import REPO


def test_every_module_is_in_a_file_table():
    page = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"^\| `([^`]+\.py)` \|", page, flags=re.MULTILINE))
    package = REPO / "lightning_gpuopt"
    modules = {path.relative_to(package).as_posix() for path in package.rglob("*.py")}
    assert not sorted(modules - named), f"docs/architecture.md's file tables lack: {sorted(modules - named)}"
    assert not sorted(named - modules), (
        f"docs/architecture.md names files that are gone: {sorted(named - modules)}"
    )
