"""The engine as a contract: callbacks read it through public reads only, and it keeps its state itself."""

from __future__ import annotations

import ast
import re

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.microbatch import MicroBatchEngine
from tests.helpers import REPO, TRAINER_QUIET

PACKAGE = REPO / "lightning_gpuopt"
# Another component reached through a local name, then one of its private attributes.
_PRIVATE_READ = re.compile(r"\b(engine|_engine|monitor|holder|switch|finder|recovery)\._[a-z]\w*")


def test_no_component_reads_another_components_private_attributes():
    offenders = []
    for path in [*PACKAGE.glob("callbacks/*.py"), PACKAGE / "cli.py", *PACKAGE.glob("strategy/*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _PRIVATE_READ.search(line) and "self._engine = " not in line:
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


class _Seen(pl.Callback):
    def __init__(self) -> None:
        self.reads: list[tuple[int, int, bool, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        engine = MicroBatchEngine.get(trainer)
        self.reads.append(
            (
                engine.effective_k(batch),
                engine.micro_batch_size(batch),
                engine.installed("train"),
                engine.installed("test"),
            )
        )


def test_public_reads_tell_the_split_of_a_batch():
    seen = _Seen()
    recovery = OOMRecovery(verbose=False)
    trainer = pl.Trainer(max_steps=2, callbacks=[recovery, seen], **TRAINER_QUIET)

    class Split(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                MicroBatchEngine.get(trainer).propose(2, "test", "split the second batch")

    trainer.callbacks.insert(0, Split())
    trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=4))
    assert seen.reads == [(1, 4, True, False), (2, 2, True, False)]
    assert recovery.k == 2


# ---------------------------------------------------------------------- nothing outside the engine writes into it

#: Calls that change a list, dict or set in place.
_MUTATING = frozenset(
    "append extend insert remove pop popitem clear setdefault update add discard sort reverse "
    "__setitem__ __delitem__".split()
)


def _is_engine(node: ast.AST) -> bool:
    """An expression that holds the engine: a name or attribute called ``engine``/``_engine``, or
    ``MicroBatchEngine.get(...)``/``.attach(...)``."""
    if isinstance(node, ast.Name):
        return node.id.endswith("engine")
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("engine")
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "MicroBatchEngine"
    )


def _reaches_engine_state(node: ast.AST) -> bool:
    """``node`` is something held by the engine (``engine.x``, ``engine.x[i]``, ``engine.x.y``), not the engine."""
    depth = 0
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if _is_engine(node) and depth:
            return True
        node, depth = node.value, depth + 1
    return depth > 0 and _is_engine(node)


def engine_writes(source: str) -> list[int]:
    """The lines of ``source`` that assign, delete or mutate in place something the engine holds."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _MUTATING:
                targets = [node.func.value]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
        ):
            if node.args and _is_engine(node.args[0]):
                lines.append(node.lineno)
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        if any(_reaches_engine_state(t) for t in flat):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_syntax_check_flags_each_kind_of_write():
    planted = """
engine.k = 2
self._engine.oom_handler = f
engine.eval_k["validation"] = 2
engine.eval_k.setdefault("test", 1)
MicroBatchEngine.get(trainer).listeners.append(f)
engine.ladder.listeners.append(f)
a, engine.max_micro_batch_size = 1, 2
engine.sum_log_keys |= {"x"}
del engine.measure_split
setattr(self._engine, "k", 3)
"""
    assert engine_writes(planted) == list(range(2, 12))
    allowed = """
self._engine = engine
engine = MicroBatchEngine.attach(trainer, self)
engine.propose(2, "oom", "why")
k = engine.k
self.history.append(engine.history[-1])
"""
    assert engine_writes(allowed) == []


def test_no_code_outside_the_engine_writes_into_it():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "microbatch" in path.relative_to(PACKAGE).parts:
            continue
        for line in engine_writes(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE)}:{line}")
    assert not offenders, "writes into the engine from outside microbatch/: " + ", ".join(offenders)
