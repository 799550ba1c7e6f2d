"""The layers of docs/architecture.md, checked over the whole package from its syntax trees.

1. ``memory/`` imports only ``memory/`` of the pack (plus the leaves ``_warnings``, ``_compat``, ``_validate``), and
   no Lightning.
2. Nothing outside ``callbacks/``, ``cli.py`` and the package ``__init__`` imports a callback.
3. No pack module reads a private name of another module: an attribute ``x._name`` (or ``getattr(x, "_name")``,
   ``hasattr``/``setattr``/``delattr`` alike) whose name the module does not define itself, or
   ``from m import _name`` of something that is not a module. Private names of torch, Lightning and the
   standard library are read in ``_compat.py`` and ``_compiled.py`` only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "lightning_gpuopt"
#: The modules that hold every read of another library's private names.
PRIVATE_GATES = {"_compat.py", "_compiled.py"}
#: Underscore names that are documented, public API of their owners (namedtuple and ``os``).
DOCUMENTED = {"_fields", "_asdict", "_replace", "_make", "_exit"}
#: The pack modules that ``memory/`` may import besides its own.
MEMORY_MAY_IMPORT = {"lightning_gpuopt._warnings", "lightning_gpuopt._compat", "lightning_gpuopt._validate"}


@dataclass(frozen=True)
class Source:
    path: Path
    tree: ast.Module

    @property
    def rel(self) -> str:
        return self.path.relative_to(PACKAGE).as_posix()

    @property
    def module(self) -> str:
        parts = self.path.relative_to(REPO).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[Source]:
    return [Source(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


SOURCES = _sources()


def _imports(source: Source) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module imported from, names) for every import, relative ones resolved."""
    package = source.module if source.path.name == "__init__.py" else source.module.rpartition(".")[0]
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base, [alias.name for alias in node.names]


def _is_pack_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_modules(source: Source) -> Iterator[tuple[int, str]]:
    """Every pack or outside module a file imports (``from a import b`` counts ``a.b`` when that is a module)."""
    for line, base, names in _imports(source):
        yield line, base
        for name in names:
            if _is_pack_module(f"{base}.{name}"):
                yield line, f"{base}.{name}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_" and name not in DOCUMENTED


def _own_names(tree: ast.Module) -> set[str]:
    """Every name a module defines: functions, classes, assigned names and attributes, arguments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Call) and _constant_attr_call(node) and node.func.id == "setattr":
            names.add(node.args[1].value)
    return names


def _constant_attr_call(node: ast.Call) -> bool:
    return (
        isinstance(node.func, ast.Name)
        and node.func.id in {"getattr", "hasattr", "setattr", "delattr"}
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def private_reads(source: Source) -> list[str]:
    """The private names of other modules that ``source`` reads, as ``file:line: what``."""
    own = _own_names(source.tree)
    found = []
    for node in ast.walk(source.tree):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            receiver = node.value
            if not (isinstance(receiver, ast.Name) and receiver.id in {"self", "cls"}):
                name = node.attr
        elif isinstance(node, ast.Call) and _constant_attr_call(node) and node.func.id != "setattr":
            name = node.args[1].value
        if name is not None and _is_private(name) and name not in own:
            found.append(f"{source.rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    for line, base, names in _imports(source):
        for name in names:
            if _is_private(name) and not _is_pack_module(f"{base}.{name}"):
                found.append(f"{source.rel}:{line}: from {base} import {name}")
    return found


def test_memory_imports_only_memory():
    offenders = []
    for source in SOURCES:
        if not source.rel.startswith("memory/"):
            continue
        for line, name in _imported_modules(source):
            pack = name.startswith("lightning_gpuopt")
            if pack and not name.startswith("lightning_gpuopt.memory") and name not in MEMORY_MAY_IMPORT:
                offenders.append(f"{source.rel}:{line}: imports {name}")
            if name == "lightning" or name.startswith(("lightning.", "lightning_utilities")):
                offenders.append(f"{source.rel}:{line}: imports {name} (memory/ runs without Lightning)")
    assert not offenders, "memory/ reaches out of its layer:\n" + "\n".join(offenders)


def test_only_callbacks_cli_and_the_package_import_callbacks():
    allowed = ("callbacks/", "cli.py", "__init__.py")
    offenders = [
        f"{source.rel}:{line}: imports {name}"
        for source in SOURCES
        if not (source.rel.startswith(allowed[0]) or source.rel in allowed[1:])
        for line, name in _imported_modules(source)
        if name == "lightning_gpuopt.callbacks" or name.startswith("lightning_gpuopt.callbacks.")
    ]
    assert not offenders, "a layer below the callbacks imports one:\n" + "\n".join(offenders)


def test_no_module_reads_another_modules_private_names():
    offenders = [read for s in SOURCES if s.path.name not in PRIVATE_GATES for read in private_reads(s)]
    assert not offenders, (
        "private names read outside their module (move the read into _compat.py / _compiled.py, or give the "
        "owner a public read):\n" + "\n".join(offenders)
    )


# ---------------------------------------------------------------------------- the checker itself


def _check(code: str, rel: str = "callbacks/x.py") -> list[str]:
    return private_reads(Source(PACKAGE / rel, ast.parse(code)))


@pytest.mark.parametrize(
    ("code", "flagged"),
    [
        ("engine._users.add(1)", True),
        ("getattr(trainer, '_accelerator_connector')", True),
        ("from torch.nn.modules.batchnorm import _BatchNorm", True),
        ("t._version", True),
        (
            "class A:\n    def f(self, other):\n        return other._x\n    def g(self):\n        self._x = 1",
            False,
        ),
        ("self._engine.k", False),
        ("from lightning_gpuopt import _compat\n_compat.x()", False),
        ("point._asdict()", False),
    ],
    ids=[
        "other-private",
        "getattr-constant",
        "import-private",
        "torch-private",
        "own-name",
        "self",
        "module",
        "doc",
    ],
)
def test_the_checker_flags_what_it_should(code, flagged):
    assert bool(_check(code)) is flagged
