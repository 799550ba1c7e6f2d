"""docs/testing.md names the tests that hold each claim: every one must exist, or the page lies."""

from __future__ import annotations

import ast
import re

from tests.helpers import REPO

PAGE = REPO / "docs" / "testing.md"
TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`")


def _tests_of(path: str) -> set[str]:
    tree = ast.parse((REPO / path).read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


def test_every_test_the_page_names_exists():
    named = TEST_ID.findall(PAGE.read_text())
    assert len(named) >= 40, "the page names fewer tests than it should: the pattern no longer matches them?"
    missing = [
        f"{path}::{name}" for path, name in named if not (REPO / path).exists() or name not in _tests_of(path)
    ]
    assert not missing, f"docs/testing.md names tests that do not exist: {missing}"


def test_the_check_sees_a_missing_test():
    assert TEST_ID.findall("`tests/test_docs_testing.py::test_no_such_thing`") == [
        ("tests/test_docs_testing.py", "test_no_such_thing")
    ]
    assert "test_no_such_thing" not in _tests_of("tests/test_docs_testing.py")
