"""compile_watch.py: the engine's view of a compiled module, driven directly with dynamo's counters replaced by a
script (``compile_watch``'s imports of ``_compiled``): the size-1 cap, and which recompilations the pack records as
its own, with their cause. tests/callbacks/test_compiled.py runs the real torch.compile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.microbatch import compile_watch
from lightning_gpuopt.microbatch.compile_watch import CompileWatch


def test_without_compiled_parts_nothing_is_capped_marked_or_counted():
    watch = CompileWatch()
    assert watch.cap(8, 8, "train") == 8 and not watch.at_cap(8, 4, "train")
    assert watch.before_attempt() is None
    chunk = torch.zeros(4, 2)
    watch.mark_dynamic([chunk, chunk], lambda c: c.shape[0])
    watch.after_attempt(SimpleNamespace(global_step=0), None, "train", 8, 2)
    assert watch.recompiles.caused == 0


def test_under_compile_micro_batches_keep_two_samples_until_two_did_not_fit():
    watch = CompileWatch()
    watch.compiled = True
    assert [watch.cap(8, k, "train") for k in (2, 4, 8)] == [2, 4, 4]
    assert watch.at_cap(8, 4, "train") and not watch.at_cap(8, 2, "train")
    assert watch.cap(3, 3, "train") == 3  # under 4 samples: no cap
    watch.allow_single("train")
    assert watch.cap(8, 8, "train") == 8 and watch.cap(8, 8, "validation") == 4  # per stage
    assert not watch.at_cap(8, 4, "train") and watch.at_cap(8, 4, "validation")


@pytest.fixture
def dynamo(monkeypatch):
    """dynamo's counters as a script: each attempt compiles ``new`` frames that the pack's change explains."""
    script = SimpleNamespace(new=0, attempt=0)

    def names(marker) -> list[str]:  # frames of their own, far from dynamo's per-frame limit
        return [f"frame {script.attempt}.{i}" for i in range(script.new)]

    def marker():
        script.attempt += 1
        return (script.attempt, None)

    monkeypatch.setattr(compile_watch, "compile_marker", marker)
    monkeypatch.setattr(compile_watch, "compilations_since", names)
    monkeypatch.setattr(compile_watch, "caused_compilations", lambda marker: (script.new, names(marker)))
    return script


def test_recompilations_are_recorded_with_the_change_that_caused_them(dynamo):
    watch, trainer = CompileWatch(), SimpleNamespace(global_step=5)
    watch.compiled = True

    def attempt(stage: str, k: int, new: int, n: int = 8) -> None:
        dynamo.new = new
        watch.after_attempt(trainer, watch.before_attempt(), stage, n, k)

    attempt("train", 1, new=3)  # the first attempt compiles the model itself: not the pack's
    attempt("train", 1, new=0)
    attempt("train", 2, new=1)
    attempt("train", 4, new=2)
    attempt("train", 2, new=1)
    attempt("train", 2, new=1)  # same k and no cause given: not the pack's
    watch.set_cause("precision 32-true → bf16-mixed", ("train", "validation"))
    assert watch.cause("validation") == "precision 32-true → bf16-mixed"
    attempt("train", 2, new=1)
    attempt("validation", 1, new=1)  # a stage's first attempt: the model's own, and its cause is used up
    attempt("validation", 2, new=1)
    assert watch.cause("train") is None and watch.cause("validation") is None
    causes = [d.data["cause"] for d in decisions(trainer)]
    assert causes == [
        "split 8 → 4 (batch dimension dynamic from now on)",
        "split 4 → 2",
        "growing back 2 → 4",
        "precision 32-true → bf16-mixed",
        "split 8 → 4 in validation (batch dimension dynamic from now on)",
    ]
    assert [d.kind for d in decisions(trainer)] == ["recompilation"] * 5
    assert decisions(trainer)[1].message == "recompiled after split 4 → 2 (2 frames)"
    assert watch.recompiles.caused == 6
    assert sum(watch.recompiles.per_frame.values()) == 11  # every compilation counts toward dynamo's limit
