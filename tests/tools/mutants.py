"""Plant one-line bugs in the pack's core semantics, one at a time, and count those the suite catches.

    python -m tests.tools.mutants [--target NAME ...] [--jobs 2] [--out mutants.json] [--list] [--limit N]
                                  [--rerun mutants.json]

Each target is a module (or some of its functions) and the test selection that claims to guard it. A mutant
changes one expression of that code in a way a hand-planted bug would (an operator, a comparison, a boolean, a
constant off by one, ``and``/``or``, ``min``/``max``, a dropped ``not``, an augmented assignment); the
selection runs against it in a copy of the repository (``pytest -x -m "not slow"`` unless the target says
otherwise, stopped at the first failure) and the mutant is *caught* when the selection fails or times out. Mutants in docstrings, messages,
annotations and ``__all__`` are not made. The figure for docs/testing.md is caught / made, per target and in all.

Each target's selection first runs once without a mutant, under coverage.py (its subprocesses too: the DDP ranks,
the ``gpuopt fit`` children, the loader's workers), which records the tests that run each line. A mutant then runs
only the tests that run its line, the fastest first; a line that ran at import runs the whole selection,
and a line no test runs is a survivor without running anything ("not run"). Without coverage.py installed, every
mutant runs the whole selection. ``--rerun`` runs again only the mutants a previous JSON did not see caught (after
new tests), and keeps the others' results. CI does not run it.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Target:
    """A module, the functions of it to mutate (``()``: all), and the tests that guard it."""

    name: str
    path: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    #: pytest's ``-m``: the slow tests left out unless a target's claim is held by one.
    markers: str = "not slow"

    def selection(self) -> tuple[str, ...]:
        """The module's docstring examples (part of the suite), then the tests."""
        module = self.path.removesuffix(".py").replace("/", ".")
        return (f"tests/test_docstring_examples.py::test_docstring_examples[{module}]", *self.tests)


_WEIGHTING_TESTS = (
    "tests/microbatch/test_loss_weighting_rules.py",
    "tests/microbatch/test_loss_weighting_alike.py",
    "tests/microbatch/test_loss_weighting_precision.py",
    "tests/microbatch/test_loss_weighting_memory.py",
    "tests/microbatch/test_loss_weighting.py",
    "tests/microbatch/test_stochastic_steps.py",
    "tests/microbatch/test_loss_weighting_decision.py",
)

#: Each target's tests, fastest first (``-x`` stops at the first failure).
TARGETS = (
    Target(
        "resume",
        "lightning_gpuopt/data/resume.py",
        (
            "tests/data/test_resume.py",
            "tests/data/test_resume_matrix.py",
            "tests/callbacks/test_exact_resume.py",
        ),
    ),
    Target(
        "weighting",
        "lightning_gpuopt/microbatch/loss_weighting.py",
        (*_WEIGHTING_TESTS, "tests/callbacks/test_oom_recovery.py", "tests/callbacks/test_compiled.py"),
        markers="",  # the DDP check (a rank whose samples tell the candidates apart) and the HF heads are slow
    ),
    Target("weighting-rules", "lightning_gpuopt/microbatch/loss_weighting_rules.py", _WEIGHTING_TESTS),
    Target(
        "skip",
        "lightning_gpuopt/microbatch/batch_runs.py",
        (
            "tests/microbatch/test_batch_runs.py",  # the module's own tests: what each backward is told, the loss
            "tests/microbatch/test_skipped_batches.py",
            "tests/callbacks/test_oom_recovery.py",
            "tests/callbacks/test_gradient_noise_scale.py",  # what each micro-batch's backward tells listeners
        ),
        functions=("TrainingBatch._run", "TrainingBatch.keep", "TrainingBatch.skip"),
    ),
    Target(
        "cli-resume",
        "lightning_gpuopt/_cli_resume.py",
        (
            "tests/test_cli_resume_rules.py",
            "tests/test_cli_resume.py",
            "tests/test_cli_quiet.py",
            "tests/test_cli_same_command.py",
        ),
        markers="",  # "the same command resumes" is held by a slow test
    ),
    Target(
        "oom-policy",
        "lightning_gpuopt/oom_policy.py",
        (
            "tests/test_oom_policy.py",
            "tests/callbacks/test_oom_record_parts.py",
            "tests/callbacks/test_oom_record_text.py",
            "tests/callbacks/test_oom_recovery.py",
            "tests/callbacks/test_oom_recovery_adaptive.py",
        ),
    ),
    Target(  # oom_policy.py's vote protocol, moved out of it (issue 35)
        "votes",
        "lightning_gpuopt/votes.py",
        ("tests/test_oom_policy.py", "tests/callbacks/test_oom_recovery.py"),
    ),
    Target(  # oom_policy.py's OOM record, moved out of it (issue 35)
        "oom-record",
        "lightning_gpuopt/oom_record.py",
        ("tests/callbacks/test_oom_record_parts.py", "tests/callbacks/test_oom_record_text.py"),
    ),
    Target(
        "noise-scale",
        "lightning_gpuopt/goodput/estimator.py",
        ("tests/callbacks/test_gradient_noise_scale.py", "tests/callbacks/test_adaptive_batch_size.py"),
    ),
)

#: Mutants that cannot change what a user sees (here, or on a machine without CUDA), with the reason: made and
#: listed, but not counted. (target, text of the line before, text after, reason)
EQUIVALENT = (
    ("resume", "EVALUATION_EPOCH = -1", "EVALUATION_EPOCH = -2", "any epoch no training epoch has will do"),
    ("resume", "self._skip_samples = 0", "self._skip_samples = 1", "read only after skip() set it"),
    ("resume", "self._skip_samples = None, 0", "None, 1", "read only after skip() set it"),
    (
        "resume",
        "epoch != self._skip_epoch:",
        "(self._skip_epoch is None) and",
        "epochs only grow: a past skip never applies again",
    ),
    ("resume", '"cuda" in state and torch.cuda', "", "the CUDA RNG: no CUDA device here"),
    ("resume", "len(states) == torch.cuda.device_count()", "", "the CUDA RNG: no CUDA device here"),
    (
        "weighting-rules",
        "@dataclass(frozen=True)",
        "frozen=False",
        "frozen only refuses assignments none makes",
    ),
    ("weighting-rules", "<= tol", "< tol", "only a difference exactly at the tolerance tells them apart"),
    ("weighting-rules", "<= tol", "< (tol", "only a difference exactly at the tolerance tells them apart"),
    ("weighting-rules", "> 1e-12", ">= 1e-12", "only a difference of exactly 1e-12 tells them apart"),
    ("weighting-rules", "<= 1e-12", "< 1e-12", "only a difference of exactly 1e-12 tells them apart"),
    (
        "weighting-rules",
        "1e-12",
        "2e-12",
        "a rounding tolerance: only values 1e-12 to 2e-12 apart tell them apart",
    ),
    ("weighting-rules", "1e-30", "2e-30", "any tiny floor for a zero loss"),
    (
        "weighting-rules",
        "for j in pool[x + 1 :]), key=lambda p: gap(*p))",
        "pool[(x - 1) :]",
        "pairs in both orders and with themselves (gap 0): the same best pair, sorted",
    ),
    (
        "weighting",
        "replayed: bool = False",
        "replayed: bool = True",
        "set by the measurement before it is read",
    ),
    (
        "weighting",
        "self.verbose = True",
        "self.verbose = False",
        "OOMRecovery sets it from its own `verbose`",
    ),
    (
        "weighting",
        "checked=False, replayed=True, refusal=message",
        "replayed=False",
        "a refusal names its source; the flag is shown nowhere",
    ),
    ("noise-scale", "min_count: int = 20", "21", "GradientNoiseScale passes its own `min_measurements`"),
    ("noise-scale", "trust: float = 0.1", "0.2", "GradientNoiseScale passes its own `trust`"),
    ("noise-scale", "if n >= memory:", "(n > memory)", "only a need of exactly the memory tells them apart"),
    ("oom-policy", "if k <= 1:", "(k < 1)", "at k 1 no k is smaller: None either way"),
    (
        "weighting-rules",
        "for b in kinds[i + 1 :] if _differ",
        "kinds[(i - 1) :]",
        "pairs in both orders and with themselves (never out of proportion): the same gaps",
    ),
    ("oom-policy", "@dataclass(frozen=True)", "frozen=False", "frozen only refuses assignments none makes"),
    ("votes", "@dataclass(frozen=True)", "frozen=False", "frozen only refuses assignments none makes"),
    (
        "oom-policy",
        "return max(0, self.allocated_bytes",
        "max(1,",
        "one byte where the attempt added nothing",
    ),
    (
        "oom-policy",
        "max(0, demand - self.held_gradient_bytes)",
        "max(1,",
        "one byte where the attempt added nothing",
    ),
    (
        "oom-policy",
        "per_sample = max(0, peak_bytes - baseline_bytes)",
        "max(1,",
        "one byte where the step added nothing: the target is the whole batch either way",
    ),
    ("oom-policy", "need > failure.limit_bytes", ">=", "only a need of exactly the limit tells them apart"),
    (
        "oom-policy",
        "int(budget // per_sample)",
        "int((budget / per_sample))",
        "floored or truncated, a target at or below the micro-batch grows nothing either way",
    ),
    (
        "oom-policy",
        "while k2 < batch_size",
        "(k2 <= batch_size)",
        "at k2 = batch_size the micro-batch is one sample, never at least a larger one",
    ),
    ("votes", "asked = 0", "asked = 1", "every vote folded in carries the OOM bit, 1"),
    ("votes", "if new_k > k else", "(new_k >= k)", "new_k == k returned earlier"),
    ("votes", "CHECKPOINT = 4", "CHECKPOINT = 5", "a retired bit: nothing sets or reads it"),
    ("weighting", "p.device.index or 0", "", "the CUDA device list: no CUDA device here"),
    (
        "weighting",
        "generation=1",
        "generation=2",
        "a fuller collection: slower, the same memory freed for the check",
    ),
    (
        "weighting",
        "error > result.tolerance",
        ">=",
        "only a difference exactly at the tolerance tells them apart",
    ),
    (
        "weighting",
        "e <= result.tolerance",
        "<",
        "only a difference exactly at the tolerance tells them apart",
    ),
    ("weighting", "<= 1e-12", "< 1e-12", "only a difference of exactly 1e-12 tells them apart"),
    (
        "weighting",
        "<= 1e-12",
        "<= 2e-12",
        "a rounding tolerance: only weights 1e-12 to 2e-12 apart tell them apart",
    ),
    (
        "weighting",
        "return self._alike[0].weights(chunks)",
        "_alike[1]",
        "reached only where every candidate in it gives these micro-batches the same weights",
    ),
    (
        "cli-resume",
        "_FORMAT = 1",
        "_FORMAT = 2",
        "written for a later release to read: none reads it yet, and the run's name leaves it out",
    ),
    (
        "cli-resume",
        "mmap=True",
        "mmap=False",
        "the same dict read without memory-mapping: only memory differs",
    ),
    (
        "cli-resume",
        "not timed else -1",
        "else -2",
        "any negative max_epochs is no limit, and only a limit is shown",
    ),
)

_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.And: ast.Or,
    ast.Or: ast.And,
}


@dataclass
class Mutant:
    target: str
    line: int
    before: str
    after: str
    status: str = "pending"  # caught, survived, timeout (caught), error, not run (no test runs the line)
    seconds: float = 0.0
    failing: str = field(default="")
    #: The first line of the statement the mutated line belongs to (coverage.py may count a statement that spans
    #: lines at its first line only).
    statement: int = 0

    def equivalent(self) -> str | None:
        """Why this mutant cannot be caught (:data:`EQUIVALENT`), or ``None``."""
        for target, before, after, why in EQUIVALENT:
            if target == self.target and before in self.before and after in self.after:
                return why
        return None

    def label(self) -> str:
        return f"{self.target}:{self.line}: {self.before.strip()}  ->  {self.after.strip()}"


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """Nodes not to mutate: docstrings, f-strings and messages, annotations, ``__all__``."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                mark(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                mark(default)  # a signature's default: the API, not the semantics under test
            for arg in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
                mark(arg.annotation)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.JoinedStr):
            mark(node)
        if isinstance(node, ast.Raise):
            mark(node.exc)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
            "rank_zero_info",
            "rank_zero_warn",
            "warn",
            "record_decision",
            "info",
            "debug",
        ):
            mark(node)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            mark(node)
    return skip


def _functions(tree: ast.Module, names: tuple[str, ...]) -> list[ast.AST]:
    if not names:
        return [tree]
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                if qualname in names:
                    found.append(child)
                visit(child, qualname + ".")

    visit(tree, "")
    missing = set(names) - {getattr(f, "name", "") for f in found} - {n.split(".")[-1] for n in names}
    if len(found) != len(names):
        raise SystemExit(
            f"mutants: functions not found in the target: {sorted(names)} (found {len(found)}){missing}"
        )
    return found


def _replace(source_lines: list[str], node: ast.AST, text: str) -> list[str] | None:
    """The source with ``node``'s text replaced by ``text`` (single-line nodes only)."""
    if node.lineno != node.end_lineno:
        return None
    line = source_lines[node.lineno - 1]
    encoded = line.encode()
    new = encoded[: node.col_offset].decode() + text + encoded[node.end_col_offset :].decode()
    return [*source_lines[: node.lineno - 1], new, *source_lines[node.lineno :]]


_COMPOUND = (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp, ast.IfExp, ast.Lambda, ast.NamedExpr)


def _operand(source: str, node: ast.AST) -> str | None:
    text = ast.get_source_segment(source, node)
    return None if text is None else f"({text})" if isinstance(node, _COMPOUND) else text


def _operator_text(line: str, start: int, end: int, old: str, new: str) -> str | None:
    segment = line[start:end]
    if segment.count(old) != 1:
        return None
    return segment.replace(old, new)


_SYMBOLS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: " is ",
    ast.IsNot: " is not ",
    ast.In: " in ",
    ast.NotIn: " not in ",
    ast.And: " and ",
    ast.Or: " or ",
}


def make_mutants(target: Target, root: Path = REPO) -> tuple[list[str], list[tuple[Mutant, list[str]]]]:
    """The target's source lines (in the repository at ``root``) and each mutant with its mutated source lines."""
    source = (root / target.path).read_text()
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    skip = _skipped_nodes(tree)
    out: list[tuple[Mutant, list[str]]] = []
    seen: set[tuple[int, str]] = set()
    statement: dict[int, int] = {}  # id(node): the first line of the innermost statement holding it
    for stmt in (n for n in ast.walk(tree) if isinstance(n, ast.stmt)):
        for node in ast.walk(stmt):
            statement[id(node)] = stmt.lineno  # inner statements come later in the walk and win

    def add(node: ast.AST, text: str | None) -> None:
        if text is None:
            return
        new = _replace(lines, node, text)
        if new is None or (node.lineno, new[node.lineno - 1]) in seen:
            return
        seen.add((node.lineno, new[node.lineno - 1]))
        mutant = Mutant(target.name, node.lineno, lines[node.lineno - 1], new[node.lineno - 1])
        mutant.statement = statement.get(id(node), node.lineno)
        out.append((mutant, new))

    for scope in _functions(tree, target.functions):
        for node in ast.walk(scope):
            if (
                id(node) in skip
                or not hasattr(node, "lineno")
                or node.lineno != getattr(node, "end_lineno", -1)
            ):
                continue
            segment = ast.get_source_segment(source, node)
            if segment is None:
                continue
            if isinstance(node, ast.BinOp) and type(node.op) in _SWAPS:
                left, right = _operand(source, node.left), _operand(source, node.right)
                if left is not None and right is not None:
                    add(node, f"({left} {_SYMBOLS[_SWAPS[type(node.op)]].strip()} {right})")
            elif isinstance(node, ast.AugAssign) and type(node.op) in _SWAPS:
                add(
                    node,
                    _operator_text(
                        segment,
                        0,
                        len(segment),
                        _SYMBOLS[type(node.op)].strip() + "=",
                        _SYMBOLS[_SWAPS[type(node.op)]].strip() + "=",
                    ),
                )
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _SWAPS:
                left, right = _operand(source, node.left), _operand(source, node.comparators[0])
                if left is not None and right is not None:
                    symbol = _SYMBOLS[_SWAPS[type(node.ops[0])]].strip()
                    add(node, f"({left} {symbol} {right})")
            elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
                parts = [_operand(source, v) for v in node.values]
                if None not in parts:
                    add(node, f"({parts[0]}{_SYMBOLS[_SWAPS[type(node.op)]]}{parts[1]})")
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                operand = ast.get_source_segment(source, node.operand)
                if operand is not None:
                    add(node, f"({operand})")
            elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
                add(node, str(not node.value))
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, int)
                and not isinstance(node.value, bool)
            ):
                add(node, str(node.value + 1))
            elif (
                isinstance(node, ast.Constant) and isinstance(node.value, float) and node.value not in (0.0,)
            ):
                add(node, repr(node.value * 2))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("min", "max")
            ):
                other = "max" if node.func.id == "min" else "min"
                add(node, other + segment[len(node.func.id) :])
    return lines, out


#: Imported once by the runner before it forks a child per mutant: each child then starts in well under a
#: second instead of ~10 s. The pack itself and the tests are imported by each child, from its copy.
_PRELOAD = ("torch", "numpy", "lightning.pytorch", "pytest", "hypothesis", "jsonargparse", "torchmetrics")


def _preload() -> None:
    import importlib

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


_COVERAGE_INI = """\
[run]
data_file = {data}/data
parallel = true
source = {root}/lightning_gpuopt
patch =
    _exit
    fork
context = ${{PYTEST_CURRENT_TEST-}}
"""


class _TestContexts:
    """A pytest plugin: coverage.py's dynamic context is the running test's node id; each test's seconds."""

    def __init__(self, cov) -> None:
        self.cov = cov
        self.seconds: dict[str, float] = {}

    def pytest_runtest_protocol(self, item):
        self.cov.switch_context(item.nodeid)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration


def _start_coverage(root: Path, data: Path):
    """Measure this process, and every Python process it starts, into ``data``; return the Coverage."""
    import coverage

    data.mkdir(parents=True, exist_ok=True)
    ini = data / "coverage.ini"
    ini.write_text(_COVERAGE_INI.format(data=data, root=root))
    # A subprocess reads the file again: its static context is PYTEST_CURRENT_TEST, the test that started it.
    os.environ["COVERAGE_PROCESS_START"] = str(ini)
    cov = coverage.Coverage(config_file=str(ini))
    cov.start()
    return cov


def _lines_run(cov, data: Path, source: Path) -> dict[int, list[str]]:
    """Each line of ``source`` that ran: the node ids of the tests that ran it (``""``: at import)."""
    cov.stop()
    cov.save()
    import coverage

    combined = coverage.Coverage(data_file=str(data / "data"))
    combined.combine([str(data)], keep=False)
    contexts = combined.get_data().contexts_by_lineno(str(source))
    # A subprocess's context is PYTEST_CURRENT_TEST: "NODE_ID (call)" (a node id may hold " (" itself).
    phase = re.compile(r" \((setup|call|teardown)\)$")
    return {line: sorted({phase.sub("", c) for c in ids}) for line, ids in contexts.items()}


def _child(
    tests: tuple[str, ...], markers: str, root: Path, log: Path, measure: tuple[Path, str] | None = None
) -> None:
    """In a forked child: run the selection on ``root`` with pytest, exit with its status. With ``measure``
    (a JSON file, the target's path), also write which tests ran each line of the target."""
    os.setsid()  # its own process group: a timeout kills the test's own subprocesses too
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(root)
    os.environ["PYTHONPATH"] = str(root)
    os.environ["LIGHTNING_DISABLE_TIPS"] = "1"
    # This runner was imported from the repository itself (`python -m tests.tools.mutants`): forget that copy.
    sys.path[:] = [str(root)] + [p for p in sys.path if p not in ("", str(REPO))]
    for name in [n for n in sys.modules if n == "tests" or n.startswith(("tests.", "lightning_gpuopt"))]:
        del sys.modules[name]
    code = 4
    try:
        import pytest

        cov = _start_coverage(root, root / ".mutants-coverage") if measure else None
        plugins = [_TestContexts(cov)] if cov is not None else []
        code = int(
            pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-m", markers, *tests], plugins=plugins)
        )
        if measure is not None:
            lines = _lines_run(cov, root / ".mutants-coverage", root / measure[1])
            measure[0].write_text(json.dumps({"lines": lines, "seconds": plugins[0].seconds}))
            shutil.rmtree(root / ".mutants-coverage", ignore_errors=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclass
class _Running:
    mutant: Mutant | None
    root: Path
    original: str
    path: Path
    log: Path
    start: float
    timeout: float


def _start(
    mutant: Mutant | None,
    lines: list[str] | None,
    target: Target,
    root: Path,
    timeout: float,
    tests: tuple[str, ...],
    measure: Path | None,
) -> tuple[int, _Running]:
    path = root / target.path
    original = path.read_text()
    if lines is not None:
        path.write_text("".join(lines))
    log = root / "mutant.log"
    pid = os.fork()
    if pid == 0:
        _child(tests, target.markers, root, log, (measure, target.path) if measure else None)
    return pid, _Running(mutant, root, original, path, log, time.perf_counter(), timeout)


def _finish(run: _Running, status: int | None) -> None:
    """Record what the child's ``status`` (a wait status; ``None``: timed out) says, and restore the file."""
    run.path.write_text(run.original)
    mutant = run.mutant
    if mutant is None:
        return
    mutant.seconds = time.perf_counter() - run.start
    text = run.log.read_text(errors="replace") if run.log.exists() else ""
    if status is None:
        mutant.status = "timeout"
        return
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        mutant.status = "survived"
    elif code in (1, 2, 3):  # tests failed, collection failed (a broken import), or pytest's internal error
        mutant.status = "caught"
        failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
        mutant.failing = failed[0] if failed else (text.strip().splitlines() or [""])[-1]
    else:
        mutant.status, mutant.failing = "error", text[-500:]


#: An item to run: the target, the mutant (``None``: the selection as it is) and its source lines, the tests to
#: run, and where to write which tests ran each line (``None``: not measured).
_Item = tuple[Target, "Mutant | None", "list[str] | None", tuple[str, ...], "Path | None"]


def _run_all(
    items: list[_Item], roots: list[Path], timeout: Callable[[Target, tuple[str, ...]], float], show: bool
) -> None:
    """Run each item's tests in a forked child, at most one per copy of the repository at a time."""
    queue, free = list(items), list(roots)
    running: dict[int, _Running] = {}
    while queue or running:
        while queue and free:
            target, mutant, lines, tests, measure = queue.pop(0)
            pid, run = _start(mutant, lines, target, free.pop(), timeout(target, tests), tests, measure)
            running[pid] = run
        time.sleep(0.2)
        for pid, run in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.perf_counter() - run.start <= run.timeout:
                continue
            if not done:
                try:
                    os.killpg(pid, 9)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                status = None
            _finish(run, status)
            del running[pid]
            free.append(run.root)
            if show and run.mutant is not None:
                m = run.mutant
                print(f"{m.status:>8} {m.seconds:5.0f} s  {m.label()}", flush=True)


def _copy(source: Path, destination: Path) -> Path:
    ignore = shutil.ignore_patterns(".venv*", ".git", "lightning_logs", "build", "__pycache__", "*.egg-info")
    shutil.copytree(source, destination, ignore=ignore)
    return destination


def _tests_for(target: Target, mutant: Mutant, measured: dict | None) -> tuple[str, ...]:
    """The tests that run the mutant's line, fastest first (``()``: none does)."""
    if measured is None:
        return target.selection()
    lines_run, seconds = measured["lines"], measured["seconds"]
    ids = {*lines_run.get(str(mutant.line), []), *lines_run.get(str(mutant.statement), [])}
    if "" in ids:  # the line ran at import: any test may see it
        return target.selection()
    # Only the selection's own tests (a test that runs pytest in a subprocess names that run's tests too).
    ids = {
        node for node in ids if any(node == sel or node.startswith(sel + "::") for sel in target.selection())
    }
    # A subprocess's test (its context) may be unknown to pytest's timing when its id was cut: last.
    return tuple(sorted(ids, key=lambda node: (seconds.get(node, math.inf), node)))


def _key(mutant: Mutant) -> tuple[str, str, str]:
    return mutant.target, mutant.before.strip(), mutant.after.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=[t.name for t in TARGETS])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="mutants.json")
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument(
        "--limit", type=int, default=None, help="at most this many mutants per target (a trial)"
    )
    parser.add_argument(
        "--rerun", default=None, help="a previous run's JSON: run only the mutants it did not see caught"
    )
    parser.add_argument(
        "--sample",
        type=float,
        default=1.0,
        help="run this share of the mutants (random, --seed), besides those --rerun names: a quicker figure",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="print the summary of earlier runs and stop"
    )
    args = parser.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    targets = [t for t in TARGETS if not args.target or t.name in args.target]
    if args.list:
        listed = [m for t in targets for m, _ in make_mutants(t)[1][: args.limit]]
        for mutant in listed:
            print(mutant.label())
        print(f"{len(listed)} mutants")
        return 0
    try:
        import coverage  # noqa: F401
    except ImportError:
        measured = False
        print("mutants: coverage.py is not installed: each mutant runs its whole selection", flush=True)
    else:
        measured = True
    _preload()
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        # One snapshot of the repository: the mutants are made from it and every copy is it (edits made in the
        # checkout while this runs change nothing here).
        first = _copy(REPO, Path(tmp) / "copy0")
        roots = [first, *(_copy(first, Path(tmp) / f"copy{n}") for n in range(1, args.jobs))]
        work = [(t, m, lines) for t in targets for m, lines in make_mutants(t, first)[1][: args.limit]]
        made = {t.name: sum(w[0] is t and not w[1].equivalent() for w in work) for t in targets}
        before: dict[tuple[str, str, str], Mutant] = {}
        if args.rerun:
            before = {_key(m): m for m in (Mutant(**d) for d in json.loads(Path(args.rerun).read_text()))}
        caught_before = {k for k, m in before.items() if m.status in ("caught", "timeout") or m.equivalent()}
        kept = [before[_key(m)] for _, m, _ in work if _key(m) in caught_before]
        again = [w for w in work if _key(w[1]) in before and _key(w[1]) not in caught_before]
        fresh = [w for w in work if _key(w[1]) not in before]
        if args.sample < 1.0:
            rng = random.Random(args.seed)
            fresh = [w for w in fresh if rng.random() < args.sample]
        work = again + fresh
        targets = [t for t in targets if any(w[0] is t for w in work)]
        baseline = {t.name: Mutant(t.name, 0, "", "") for t in targets}
        maps = {t.name: Path(tmp) / f"{t.name}.lines.json" for t in targets}
        start = time.perf_counter()
        _run_all(
            [(t, baseline[t.name], None, t.selection(), maps[t.name] if measured else None) for t in targets],
            roots,
            lambda target, tests: 3600,
            show=False,
        )
        broken = [m for m in baseline.values() if m.status != "survived"]
        if broken:
            raise SystemExit(
                f"mutants: the selection of {broken[0].target} fails without any mutant: {broken[0].failing}"
            )
        lines_run = {t.name: json.loads(maps[t.name].read_text()) if measured else None for t in targets}

        def timeout(target: Target, tests: tuple[str, ...]) -> float:
            """Five times what the tests took without a mutant, and a minute: a mutant that hangs, not a slow
            moment."""
            whole = baseline[target.name].seconds
            seconds = (lines_run[target.name] or {}).get("seconds", {})
            took = whole if tests == target.selection() else sum(seconds.get(t, 0.0) for t in tests)
            return 5 * min(took, whole) + 60

        print(
            f"{len(work)} mutants; selections without a mutant ran in "
            + ", ".join(f"{name} {m.seconds:.0f} s" for name, m in baseline.items())
            + f" ({time.perf_counter() - start:.0f} s{', measured' if measured else ''})",
            flush=True,
        )
        items: list[_Item] = []
        for target, mutant, lines in work:
            tests = _tests_for(target, mutant, lines_run[target.name])
            if tests:
                items.append((target, mutant, lines, tests, None))
            else:
                mutant.status = "not run"
                print(f"{mutant.status:>8}    0 s  {mutant.label()}", flush=True)
        _run_all(items, roots, timeout, show=True)
    results = kept + [m for _, m, _ in work]
    _summary(results, made)
    Path(args.out).write_text(json.dumps([asdict(m) for m in results], indent=1))
    return 0


def _summary(results: list[Mutant], made: dict[str, int]) -> None:
    """The table for docs/testing.md (``made``: each target's mutants, equivalent ones left out), what was not
    caught, and the equivalent mutants with their reasons."""
    equivalent = [m for m in results if m.equivalent()]
    results = [m for m in results if not m.equivalent()]
    rows = []
    for target in [t for t in TARGETS if any(m.target == t.name for m in results)]:
        mine = [m for m in results if m.target == target.name]
        caught = sum(m.status in ("caught", "timeout") for m in mine)
        rows.append((target.name, made[target.name], len(mine), caught))
    made_all, total, caught = (sum(r[i] for r in rows) for i in (1, 2, 3))
    print("\n| target | mutants | run | caught | share of those run |\n|---|---|---|---|---|")
    for name, m, n, c in rows:
        print(f"| {name} | {m} | {n} | {c} | {100 * c / max(n, 1):.1f} % |")
    print(f"| all | {made_all} | {total} | {caught} | {100 * caught / max(total, 1):.1f} % |")
    survivors = [m for m in results if m.status not in ("caught", "timeout")]
    if survivors:
        print("\nNot caught:")
        for m in survivors:
            print(f"  [{m.status}] {m.label()}")
    if equivalent:
        print("\nEquivalent, not counted:")
        for m in equivalent:
            print(f"  {m.label()}  ({m.equivalent()}; {m.status})")


def report(paths: list[str]) -> None:
    """The summary of one or more runs' JSON (a run split by target, or resumed with ``--rerun``): the latest
    result of each mutant of this checkout's targets."""
    latest: dict[tuple[str, str, str], Mutant] = {}
    for path in paths:
        for mutant in (Mutant(**d) for d in json.loads(Path(path).read_text())):
            latest[_key(mutant)] = mutant
    made = {t.name: sum(not m.equivalent() for m, _ in make_mutants(t)[1]) for t in TARGETS}
    mine = {_key(m) for t in TARGETS for m, _ in make_mutants(t)[1]}
    _summary([m for k, m in latest.items() if k in mine], made)


if __name__ == "__main__":
    sys.exit(main())
