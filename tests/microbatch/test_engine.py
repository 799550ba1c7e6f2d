"""engine.py: the facade, driven with fake users and a stand-in Trainer (a module, a single-device strategy, its
callbacks and step; evaluation-only attach needs no more): one engine per Trainer shared by its users, the patches
gone with the last user, the state saved as plain values and resumed once, announced to the users."""

from __future__ import annotations

from types import SimpleNamespace

from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_gpuopt.microbatch.engine import EngineState, MicroBatchEngine
from lightning_gpuopt.microbatch.rungs import Rung
from lightning_gpuopt.microbatch.users import MicroBatchUser
from lightning_gpuopt.votes import Source


class Told(MicroBatchUser):
    """A user that records what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple] = []

    def k_changed(self, change):
        self.told.append(("k", change.k_before, change.k_after, change.source))

    def rung_turned_on(self, rung, reason):
        self.told.append(("rung", rung.name, reason))


class Halves(Rung):
    """A rung with state of its own."""

    name = "halves"

    def __init__(self) -> None:
        super().__init__()
        self.factor, self.applied = 1, 0

    def apply(self, trainer, reason):
        self.applied += 1
        return True

    def state_dict(self):
        return {"factor": self.factor}

    def load_state_dict(self, state):
        self.factor = state["factor"]


def _trainer(callbacks=()) -> SimpleNamespace:
    return SimpleNamespace(
        lightning_module=BoringModel(),
        strategy=SingleDeviceStrategy("cpu"),
        callbacks=list(callbacks),
        global_step=4,
    )


def test_one_engine_per_trainer_shared_by_its_users_and_gone_with_the_last():
    trainer = _trainer()
    first, second = Told(), Told()
    engine = MicroBatchEngine.attach(trainer, first, training=False)
    assert MicroBatchEngine.attach(trainer, second, training=False) is engine is MicroBatchEngine.get(trainer)
    assert engine.users == (first, second) and engine.installed("eval") and not engine.installed("train")
    assert "validation_step" in vars(trainer.strategy)  # evaluation runs through the engine's loop
    engine.release(first)
    assert MicroBatchEngine.get(trainer) is engine and engine.users == (second,)
    engine.release(second)
    assert MicroBatchEngine.get(trainer) is None and "validation_step" not in vars(trainer.strategy)


def test_the_state_is_plain_values_and_a_resume_announces_it_once():
    trainer = _trainer()
    holder = EngineState.ensure(trainer)
    engine = MicroBatchEngine.attach(trainer, Told(), training=False)
    engine.propose(4, Source.OOM, "OOM")
    engine.restore_eval_k({"validation": 2})
    rung = Halves()
    rung.factor = 3
    engine.add_rung(rung)
    assert engine.turn_on("halves", "OOM at step 4") is True
    state = engine.state_dict()
    assert state == {
        "k": 4,
        "eval_k": [["validation", 2]],
        "rungs": ["halves"],
        "rung_state": {"halves": {"factor": 3}},
    }
    engine.release(engine.users[0])
    assert (
        holder.state_dict() == state
    )  # what a checkpoint written after the fit holds: the engine's last state

    restored = EngineState()
    restored.load_state_dict(state)
    later = _trainer([restored])
    user = Told()
    engine = MicroBatchEngine.attach(later, user, training=False)
    fresh = Halves()
    engine.add_rung(fresh)
    assert engine.resume() == state
    assert engine.k == 4 and dict(engine.eval_k) == {"validation": 2} and engine.active_rungs == ("halves",)
    assert fresh.active and fresh.factor == 3 and fresh.applied == 1
    assert user.told == [("k", 1, 4, Source.RESUME), ("rung", "halves", "restored from checkpoint")]
    engine.propose(8, Source.OOM, "OOM after the resume")
    assert engine.resume() == state  # once: a second caller gets the state...
    assert engine.k == 8 and len(user.told) == 3  # ...and k is not put back
    engine.release(user)


def test_an_expected_recompilation_is_the_cause_every_stage_sees_next():
    trainer = _trainer()
    engine = MicroBatchEngine.attach(trainer, Told(), training=False)
    assert engine.compile_cause is None and engine.compiled is False
    engine.expect_recompile("precision 32-true → bf16-mixed")
    assert engine.compile_cause == "precision 32-true → bf16-mixed"
    engine.release(engine.users[0])
