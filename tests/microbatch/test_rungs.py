"""rungs.py: the recovery ladder past more micro-batches, driven with recording rungs and a stand-in Trainer (a
rung gets it, the ladder only passes it on): order, the refusals of a bad rung, turning on, spent rungs, undo."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_gpuopt.microbatch.rungs import ActivationCheckpointing, Ladder, Rung
from lightning_gpuopt.oom_policy import OOMFailure


class Recording(Rung):
    """A rung that records its calls; ``changes``: what apply returns."""

    def __init__(self, name: str, changes: bool = True) -> None:
        super().__init__()
        self.name, self.changes, self.calls = name, changes, []

    def apply(self, trainer, reason):
        self.calls.append(("apply", trainer, reason))
        return self.changes

    def undo(self, trainer):
        self.calls.append(("undo", trainer))


def _failure(phase: str) -> OOMFailure:
    return OOMFailure(0, 0, phase, 8, 8, 1, None, None, None, None, "CUDA out of memory")


def test_a_rung_by_default_helps_forward_and_backward_only_and_keeps_no_state():
    rung = Recording("r")
    assert [rung.applies(_failure(p)) for p in ("forward", "backward", "optimizer step")] == [
        True,
        True,
        False,
    ]
    assert rung.state_dict() == {} and rung.describe() == "r" and rung.active is False
    with pytest.raises(NotImplementedError):
        Rung().apply(SimpleNamespace(), "why")


def test_the_ladder_keeps_the_order_rungs_were_added_once_per_name_and_refuses_unnamed_ones():
    ladder = Ladder(SimpleNamespace())
    a, b = Recording("a"), Recording("b")
    ladder.add(a)
    ladder.add(b)
    ladder.add(Recording("a"))  # a second rung of one name: the first stays
    assert ladder.rungs == [a, b] and ladder.names() == ["a", "b"] and ladder.index("b") == 1
    for bad in (Recording(""), object()):
        with pytest.raises(TypeError, match="a recovery rung must be a named `Rung`"):
            ladder.add(bad)
    with pytest.raises(ValueError, match=r"no recovery rung named 'c' in this run's ladder \(\['a', 'b'\]\)"):
        ladder.index("c")


def test_turn_on_applies_tells_the_listeners_and_a_rung_that_changes_nothing_is_spent():
    trainer = SimpleNamespace()
    ladder = Ladder(trainer)
    a, idle, b = Recording("a"), Recording("idle", changes=False), Recording("b")
    for rung in (a, idle, b):
        ladder.add(rung)
    told = []
    ladder.listeners.append(lambda rung, reason: told.append((rung.name, reason)))
    assert ladder.available() == [a, idle, b]
    assert (
        ladder.turn_on([1], "OOM at step 3") is False
    )  # nothing changed: spent, not asked again in this fit
    assert ladder.available() == [a, b] and not idle.active and told == []
    assert ladder.turn_on([2, 0], "OOM at step 4") is True
    assert ladder.active == ["b", "a"] and a.active and b.active  # in the order they were turned on
    assert told == [("b", "OOM at step 4"), ("a", "OOM at step 4")]
    assert a.calls == [("apply", trainer, "OOM at step 4")]
    assert ladder.available() == []
    assert ladder.turn_on([0], "again") is False and len(a.calls) == 1  # on already: not applied twice
    ladder.turn_off()
    assert a.calls[-1] == ("undo", trainer) and b.calls[-1] == ("undo", trainer)
    assert idle.calls == [("apply", trainer, "OOM at step 3")]  # never on: never undone
    assert not a.active and not b.active


def test_activation_checkpointing_wraps_the_matching_modules_and_undoes_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    trainer = SimpleNamespace(lightning_module=model)
    rung = ActivationCheckpointing([nn.Linear])
    x = torch.ones(3, 4)
    before = model(x)
    assert rung.apply(trainer, "OOM") is True
    assert rung.modules == [model[0], model[2]]
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
    assert rung.describe() == "activation checkpointing of 2 module(s) (Linear)"
    torch.testing.assert_close(model(x), before)
    rung.undo(trainer)
    assert rung.modules == [] and "forward" not in vars(model[0])
