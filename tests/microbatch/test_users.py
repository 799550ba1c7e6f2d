"""The engine asks its users: how two users' answers compose, which pairs are refused, and that nothing outside
the engine can write into it (issue 35)."""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from lightning_gpuopt import GradientNoiseScale, OOMRecovery, PrecisionSwitch
from lightning_gpuopt.microbatch import MicroBatchEngine, MicroBatchUser
from lightning_gpuopt.microbatch.errors import Refused
from lightning_gpuopt.microbatch.loss_weighting import LossWeighting
from lightning_gpuopt.microbatch.users import QUESTIONS, Users
from lightning_gpuopt.votes import Proposal, Status
from tests.helpers import TRAINER_QUIET


class Decider(MicroBatchUser):
    def decide_oom(self, failure, smallest_failed, splittable):
        return 2


class Weighs(MicroBatchUser):
    def __init__(self, mode: str = "mean") -> None:
        self._weighting = LossWeighting(mode=mode)

    def weighting(self):
        return self._weighting


class Answers(MicroBatchUser):
    """A user whose answers the test sets, and which records what it is told."""

    def __init__(self, split=True, cap=None, proposal=None, measure=False, check=False, keys=()) -> None:
        self.split, self.cap, self.proposal, self.measure, self.check, self.keys = (
            split,
            cap,
            proposal,
            measure,
            check,
            keys,
        )
        self.told: list[tuple[str, object]] = []

    def may_split(self, batch):
        return self.split

    def micro_batch_cap(self):
        return self.cap

    def next_proposal(self):
        return self.proposal

    def measure_split(self, batch_idx):
        self.told.append(("asked", batch_idx))
        return self.measure

    def measure_refused(self, why):
        self.told.append(("refused", why))

    def log_keys_to_sum(self):
        return self.keys

    def check_attempt(self, batch_idx, loss):
        self.told.append(("check", batch_idx))
        return self.check

    def k_changed(self, change):
        self.told.append(("k", change))


def _users(*users: object) -> Users:
    composed = Users(LossWeighting(source="test"))
    for user in users:
        composed.add(user)
    return composed


def test_every_question_is_a_method_of_the_protocol():
    assert set(QUESTIONS) == {
        "decide_oom",
        "weighting",
        "may_split",
        "micro_batch_cap",
        "next_proposal",
        "measure_split",
        "measure_refused",
        "log_keys_to_sum",
        "check_attempt",
        "k_changed",
        "rung_turned_on",
        "after_backward",
    }


def test_a_user_is_asked_only_what_it_overrides():
    users = _users(
        Answers(split=False), object()
    )  # an object that is no MicroBatchUser only holds the engine
    assert users.decide_oom is None
    assert users.weighting is users.fallback
    assert users.may_split("batch") is False
    assert users.checks and not users.backward_listeners


def test_a_second_oom_decider_is_refused_naming_both():
    with pytest.raises(
        Refused, match=r"^Decider and a second Decider both decide what to do after an out-of"
    ):
        _users(Decider(), Decider())

    class Other(MicroBatchUser):
        def decide_oom(self, failure, smallest_failed, splittable):
            return 3

    with pytest.raises(Refused, match=r"^Decider and Other both decide"):
        _users(Decider(), Other())


def test_equal_weightings_share_and_different_ones_are_refused():
    first, same = Weighs("mean"), Weighs("mean")
    users = _users(first, same)
    assert users.weighting is first.weighting()
    with pytest.raises(Refused, match="both weight the micro-batches' losses, differently"):
        _users(Weighs("mean"), Weighs("sum"))


def test_composed_answers():
    small = Proposal(2, Status.GROW, "grow")
    large = Proposal(4, Status.THRASH, "thrash")
    a = Answers(cap=8, proposal=small, keys=("a",))
    b = Answers(cap=3, proposal=large, keys=("b",))
    c = Answers(cap=None, keys=("a", "c"))
    users = _users(a, b, c)
    assert users.micro_batch_cap() == 3  # the smallest cap wins
    assert users.next_proposal() is large  # the most micro-batches wins
    assert users.sum_log_keys == {"a", "b", "c"}
    assert users.may_split("x")
    b.split = False
    assert not users.may_split("x")  # every user must allow a split
    assert _users(Answers()).micro_batch_cap() is None


def test_proposal_ties_go_to_the_first_user():
    first, second = Proposal(2, Status.GROW, "first"), Proposal(2, Status.THRASH, "second")
    assert _users(Answers(proposal=first), Answers(proposal=second)).next_proposal() is first


def test_measure_split_any_asks_and_a_refusal_is_told_to_every_asker_once():
    asks, quiet = Answers(measure=True), Answers(measure=False)
    users = _users(quiet, asks)
    assert users.measure_split(5)
    assert ("asked", 5) in quiet.told and ("asked", 5) in asks.told  # every asker is asked
    users.measure_refused("coupled loss")
    assert ("refused", "coupled loss") in asks.told and ("refused", "coupled loss") in quiet.told
    assert not users.asks_measure_split
    before = len(asks.told)
    assert not users.measure_split(6)
    assert len(asks.told) == before  # none is asked again in this fit


def test_checks_are_asked_in_order_until_one_sends_the_attempt_back():
    first, second, third = Answers(check=False), Answers(check=True), Answers(check=True)
    users = _users(first, second, third)
    assert any(check(7, None) for check in users.checks)
    assert ("check", 7) in first.told and ("check", 7) in second.told
    assert ("check", 7) not in third.told


def test_a_released_user_is_asked_nothing():
    keep, gone = Answers(cap=8), Answers(cap=2)
    users = _users(keep, gone)
    users.remove(gone)
    assert users.micro_batch_cap() == 8
    assert users.all == (keep,)


# ---------------------------------------------------------------------- the engine's state is read only


def _fit(*callbacks: pl.Callback, steps: int = 2, **trainer: object) -> pl.Trainer:
    fit = pl.Trainer(max_steps=steps, callbacks=list(callbacks), **{**TRAINER_QUIET, **trainer})
    fit.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=4))
    return fit


class _Writes(pl.Callback):
    """Tries each write a callback made before the engine asked its users, and keeps what each raised."""

    def __init__(self) -> None:
        self.raised: dict[str, type[BaseException] | None] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx:
            return
        engine = MicroBatchEngine.get(trainer)
        writes = {
            "k": lambda: setattr(engine, "k", 4),
            "oom_handler": lambda: setattr(engine, "oom_handler", print),
            "max_micro_batch_size": lambda: setattr(engine, "max_micro_batch_size", 1),
            "measure_split": lambda: setattr(engine, "measure_split", None),
            "compile_cause": lambda: setattr(engine, "compile_cause", "mine"),
            "del trainer": lambda: delattr(engine, "trainer"),
            "eval_k[...]": lambda: engine.eval_k.__setitem__("validation", 2),
            "history.append": lambda: engine.history.append(None),
            "rungs.append": lambda: engine.rungs.append(None),
            "active_rungs.append": lambda: engine.active_rungs.append("x"),
            "users.append": lambda: engine.users.append(self),
        }
        for name, write in writes.items():
            try:
                write()
            except (AttributeError, TypeError) as err:
                self.raised[name] = type(err)
            else:
                self.raised[name] = None
        self.k = engine.k


def test_a_write_from_outside_raises_and_changes_nothing():
    writes = _Writes()
    _fit(OOMRecovery(verbose=False), writes, steps=1)
    assert writes.raised and all(writes.raised.values()), writes.raised
    assert writes.k == 1


def test_the_refusal_names_what_to_use_instead():
    engine = MicroBatchEngine(pl.Trainer(**TRAINER_QUIET))
    with pytest.raises(
        AttributeError,
        match=r"MicroBatchEngine\.oom_handler cannot be set from outside.*"
        r"use MicroBatchUser\.decide_oom\.$",
    ):
        engine.oom_handler = print
    with pytest.raises(AttributeError, match=r"use MicroBatchEngine\.propose\.$"):
        engine.k = 2
    assert engine.k == 1


# ---------------------------------------------------------------------- pairs that share a question


def test_two_oom_deciders_are_refused_at_setup_in_one_line():
    """Two instances of one stateful callback are Lightning's to refuse; two classes that both decide on OOMs are
    the engine's, in one line naming both, before the first batch."""
    with pytest.raises(Exception, match="more than one stateful callback of type `OOMRecovery`"):
        _fit(OOMRecovery(verbose=False), OOMRecovery(verbose=False), steps=1)

    class MyRecovery(Decider, pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            self.engine = MicroBatchEngine.attach(trainer, self)

    with pytest.raises(RuntimeError) as err:
        _fit(OOMRecovery(verbose=False), MyRecovery(), steps=1)
    assert str(err.value) == (
        "OOMRecovery and MyRecovery both decide what to do after an out-of-memory error for this Trainer, and the "
        "engine takes one answer: keep one of them."
    )


def test_oom_recovery_and_batch_size_compose_k_and_its_cap():
    """MemoryAwareBatchSize's cap holds against OOMRecovery's grow-back: the cap is the engine's, k may not drop
    below it; OOMRecovery's `unsplittable` still wins over the cap's split."""
    recovery = OOMRecovery(verbose=False)
    sizer = types.SimpleNamespace()

    class Cap(MicroBatchUser, pl.Callback):  # MemoryAwareBatchSize's answer, without its search
        def on_fit_start(self, trainer, pl_module):
            self.engine = MicroBatchEngine.attach(trainer, self)

        def micro_batch_cap(self):
            return 2

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            engine = self.engine
            sizer.seen = (
                engine.effective_k(batch),
                engine.propose(4, "oom", "an OOM at 2", 4),
                engine.propose(1, "grow", "grow back", 4),
            )

        def teardown(self, trainer, pl_module, stage):
            self.engine.release(self)

    _fit(recovery, Cap(), steps=1)
    assert sizer.seen == (2, 4, 2)  # 4 samples under a cap of 2 run as 2; a grow-back to 1 is held at 2


def test_oom_recovery_and_gradient_noise_scale_compose_splits():
    """GradientNoiseScale asks for a measurement split; a batch OOMRecovery declares unsplittable runs whole."""
    recovery = OOMRecovery(verbose=False, unsplittable=True)
    noise = GradientNoiseScale(every=1, min_measurements=1)
    _fit(recovery, noise, steps=3)
    assert noise.history == []  # asked, and never split: no measurement at k = 1
    free = GradientNoiseScale(every=1, min_measurements=1)
    _fit(OOMRecovery(verbose=False), free, steps=3)
    assert free.history  # the same fit with splits allowed measures


def test_precision_switch_and_oom_recovery_both_check_attempts():
    """Both answer `check_attempt` (a non-finite step sent back, see tests/callbacks/test_precision_switch.py's
    shared-engine test); they are asked in the Trainer's callback order."""
    recovery, switch = OOMRecovery(verbose=False), PrecisionSwitch(initial="keep")
    seen = []

    class Engine(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(MicroBatchEngine.get(trainer).users)

    fp16 = {"precision": None, "plugins": [MixedPrecision("16-mixed", "cpu")]}
    _fit(recovery, switch, Engine(), steps=1, **fp16)
    assert seen == [(recovery, switch)]
    seen.clear()
    _fit(PrecisionSwitch(initial="keep"), OOMRecovery(verbose=False), Engine(), steps=1, **fp16)
    assert [type(u).__name__ for u in seen[0]] == ["PrecisionSwitch", "OOMRecovery"]
