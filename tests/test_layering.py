"""The layers of docs/architecture.md, checked over the whole package from its syntax trees.

1. Every import between two pack modules is one that docs/architecture.md's allowed-imports table allows
   (imports inside functions and type-only imports included); every module is in one layer of the table.
2. The imports between the pack's modules form no circle.
3. The rules layer is pure: no function takes a Trainer, none sets an attribute of torch or uses ``global``.
4. ``memory/`` never imports Lightning.
5. No pack module reads a private name of another module: an attribute ``x._name`` (or ``getattr(x, "_name")``,
   ``hasattr``/``setattr``/``delattr`` alike) whose name the module does not define itself, or
   ``from m import _name`` of something that is not a module. Private names of torch, Lightning and the
   standard library are read in ``_compat.py`` and ``_compiled.py`` only.
"""

from __future__ import annotations

import ast
import re
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
ARCHITECTURE = REPO / "docs" / "architecture.md"


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


# ---------------------------------------------------------------------------- the allowed-imports table


@dataclass(frozen=True)
class Layer:
    name: str
    members: tuple[str, ...]  # paths relative to the package: "x.py" or a folder "x/"
    may_import: frozenset[str]


def layers(page: str | None = None) -> list[Layer]:
    """docs/architecture.md's allowed-imports table, between its ``<!-- layers -->`` markers."""
    page = ARCHITECTURE.read_text() if page is None else page
    table = page.split("<!-- layers: tests/test_layering.py reads this table -->")[1].split(
        "<!-- /layers -->"
    )[0]
    found = []
    for row in table.strip().splitlines()[2:]:
        label, members, may = (cell.strip() for cell in row.strip("|").split("|"))
        name = label.split(" (")[0]  # the words in brackets say what the layer is
        allowed = frozenset() if may == "—" else frozenset(m.strip() for m in may.split(","))
        found.append(Layer(name, tuple(re.findall(r"`([^`]+)`", members)), allowed))
    return found


LAYERS = layers()


def layer_of(rel: str, table: list[Layer] = LAYERS) -> list[str]:
    """The layers whose members hold the module at ``rel`` (a path relative to the package)."""
    return [
        layer.name
        for layer in table
        if any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in layer.members)
    ]


def _rel(module: str) -> str:
    """``lightning_gpuopt.a.b`` as the path of its file relative to the package."""
    path = REPO.joinpath(*module.split("."))
    return (
        (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(PACKAGE).as_posix()
    )


def pack_edges(sources: list[Source] = SOURCES) -> list[tuple[str, int, str]]:
    """(file, line, imported file) for every import of a pack module by a pack module, as paths relative to the
    package. ``from a import b`` is an edge to ``a.b`` where that is a module, else to ``a``."""
    edges = []
    for source in sources:
        for line, base, names in _imports(source):
            modules = [f"{base}.{n}" for n in names if _is_pack_module(f"{base}.{n}")]
            if len(modules) < len(names) or not names:
                modules.append(base)
            for name in modules:
                if (name == "lightning_gpuopt" or name.startswith("lightning_gpuopt.")) and _is_pack_module(
                    name
                ):
                    target = _rel(name)
                    if target != source.rel:
                        edges.append((source.rel, line, target))
    return edges


def forbidden_edges(edges: list[tuple[str, int, str]], table: list[Layer] = LAYERS) -> list[str]:
    by_name = {layer.name: layer for layer in table}
    found = []
    for rel, line, target in edges:
        (mine,), (theirs,) = layer_of(rel, table), layer_of(target, table)
        if mine != theirs and theirs not in by_name[mine].may_import:
            found.append(f"{rel}:{line}: imports {target} ({mine} -> {theirs})")
    return found


def test_every_module_is_in_one_layer_and_every_listed_file_exists():
    modules = [s.rel for s in SOURCES]
    assert {rel: layer_of(rel) for rel in modules if len(layer_of(rel)) != 1} == {}
    listed = [m for layer in LAYERS for m in layer.members]
    assert [m for m in listed if not (PACKAGE / m).exists()] == [], "the table names files that are gone"
    names = {layer.name for layer in LAYERS}
    assert all(layer.may_import <= names for layer in LAYERS), "a row may import a layer the table lacks"


def test_every_import_is_one_the_table_allows():
    offenders = forbidden_edges(pack_edges())
    assert not offenders, (
        "imports docs/architecture.md's allowed-imports table does not allow:\n" + "\n".join(offenders)
    )


def import_circles(edges: list[tuple[str, int, str]]) -> list[list[str]]:
    """The circles of the import graph: its strongly connected components of more than one module."""
    graph: dict[str, set[str]] = {}
    for rel, _, target in edges:
        graph.setdefault(rel, set()).add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_imports_form_no_circle():
    assert import_circles(pack_edges()) == []


def impurities(source: Source) -> list[str]:
    """What makes a rules module impure: a parameter called or typed ``trainer``/``Trainer``, an assignment to an
    attribute of ``torch...`` (or of a name bound to one), a ``global`` statement."""
    torch_names = {
        target.id
        for node in ast.walk(source.tree)
        if isinstance(node, ast.Assign) and ast.unparse(node.value).startswith("torch.")
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def of_torch(target: ast.AST) -> bool:
        root = target
        while isinstance(root, ast.Attribute):
            root = root.value
        return (
            isinstance(target, ast.Attribute)
            and isinstance(root, ast.Name)
            and root.id in {"torch", *torch_names}
        )

    found = []
    for node in ast.walk(source.tree):
        if isinstance(node, ast.arg):
            annotation = ast.unparse(node.annotation) if node.annotation is not None else ""
            if node.arg == "trainer" or "Trainer" in annotation:
                found.append((node.lineno, f"takes a Trainer ({node.arg})"))
        elif isinstance(node, ast.Global):
            found.append((node.lineno, f"global {', '.join(node.names)}"))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if of_torch(target):
                    found.append((node.lineno, f"sets {ast.unparse(target)}"))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            if of_torch(ast.Attribute(node.args[0], "x")):
                found.append((node.lineno, ast.unparse(node)[:60]))
    return [f"{source.rel}:{line}: {what}" for line, what in sorted(found)]


def test_the_rules_are_pure():
    rules = [s for s in SOURCES if layer_of(s.rel) == ["rules"]]
    assert rules
    offenders = [line for source in rules for line in impurities(source)]
    assert not offenders, "the rules layer takes a Trainer or changes global state:\n" + "\n".join(offenders)


def test_memory_never_imports_lightning():
    offenders = [
        f"{source.rel}:{line}: imports {name} (memory/ runs without Lightning)"
        for source in SOURCES
        if source.rel.startswith("memory/")
        for line, name in _imported_modules(source)
        if name == "lightning" or name.startswith(("lightning.", "lightning_utilities"))
    ]
    assert not offenders, "\n".join(offenders)


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


def test_the_table_checker_flags_what_it_should():
    page = """<!-- layers: tests/test_layering.py reads this table -->
| layer | modules | may import |
|---|---|---|
| low | `memory/` | — |
| high | `callbacks/`, `cli.py` | low |
<!-- /layers -->"""
    table = layers(page)
    assert layer_of("memory/probe.py", table) == ["low"] and layer_of("cli.py", table) == ["high"]
    edges = [("cli.py", 1, "memory/probe.py"), ("memory/probe.py", 2, "callbacks/x.py")]
    assert forbidden_edges(edges, table) == ["memory/probe.py:2: imports callbacks/x.py (low -> high)"]
    assert import_circles([("a.py", 1, "b.py"), ("b.py", 1, "a.py"), ("b.py", 2, "c.py")]) == [
        ["a.py", "b.py"]
    ]


def test_a_type_only_import_inside_a_function_is_an_edge():
    code = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_gpuopt import _compat\n"
        "def f():\n    from lightning_gpuopt.memory import probe\n"
    )
    edges = pack_edges([Source(PACKAGE / "report.py", ast.parse(code))])
    assert [(line, target) for _, line, target in edges] == [(3, "_compat.py"), (5, "memory/probe.py")]


def test_the_purity_check_flags_what_it_should():
    code = (
        "import torch\ndef f(trainer): pass\ndef g(t: 'pl.Trainer'): pass\n"
        "torch.backends.cuda.matmul.allow_tf32 = True\ndef h():\n    global X\n"
    )
    found = impurities(Source(PACKAGE / "precision.py", ast.parse(code)))
    assert [line.split(":")[1] for line in found] == ["2", "3", "4", "6"]
