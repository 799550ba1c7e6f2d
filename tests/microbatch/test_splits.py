"""splits.py: k, the evaluation k and their history, driven with a fake user and a stand-in Trainer (only its
``global_step`` is read): the precedence of proposals, the users' cap, what a batch runs as, and the record."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_gpuopt.microbatch.compile_watch import CompileWatch
from lightning_gpuopt.microbatch.loss_weighting import LossWeighting
from lightning_gpuopt.microbatch.splits import KChange, Splits
from lightning_gpuopt.microbatch.users import MicroBatchUser, Users
from lightning_gpuopt.votes import Source


class Capped(MicroBatchUser):
    """A user with a cap on the micro-batch (None: none), that may forbid splits, and records the k changes."""

    def __init__(self, cap: int | None = None, split: bool = True) -> None:
        self.cap, self.split, self.changes = cap, split, []

    def micro_batch_cap(self):
        return self.cap

    def may_split(self, batch):
        return self.split

    def k_changed(self, change):
        self.changes.append(change)


def _splits(*users: MicroBatchUser, compiled: bool = False) -> tuple[Splits, SimpleNamespace]:
    composed = Users(LossWeighting(source="test"))
    for user in users:
        composed.add(user)
    watch = CompileWatch()
    watch.compiled = compiled
    trainer = SimpleNamespace(global_step=7)
    return Splits(trainer, watch, composed.may_split, composed.micro_batch_cap, composed.k_changed), trainer


def test_a_change_is_recorded_and_told_to_every_user_in_order():
    first, second = Capped(), Capped()
    splits, trainer = _splits(first, second)
    assert splits.propose(4, "oom", "OOM in backward", batch_size=64) == 4
    trainer.global_step = 9
    assert splits.propose(4, Source.GROW_BACK, "same k") == 4  # no change: nothing recorded
    assert splits.propose(2, "grow back", "room again", batch_size=64) == 2
    expected = [
        KChange(7, 1, 4, 64, Source.OOM, "OOM in backward"),
        KChange(9, 4, 2, 64, Source.GROW_BACK, "room again"),
    ]
    assert splits.history == expected
    assert first.changes == expected and second.changes == expected
    assert splits.history[0].stage == "train" and splits.history[0].source is Source.OOM


def test_lowering_k_is_capped_by_the_smallest_cap_but_an_oom_is_not():
    splits, _ = _splits(Capped(cap=32), Capped(cap=16))
    splits.propose(8, Source.OOM, "OOM")
    # fewer micro-batches than 64 / 16 would exceed the smallest cap: lowered only to 4
    assert splits.propose(1, Source.GROW_BACK, "grow", batch_size=64) == 4
    assert [c.k_after for c in splits.history] == [8, 4]
    assert splits.propose(3, Source.GROW_BACK, "grow", batch_size=64) == 4  # still capped: no change
    assert len(splits.history) == 2
    assert splits.propose(2, Source.OOM, "an OOM's answer stands", batch_size=64) == 2
    assert splits.propose(1, Source.GROW_BACK, "batch size unknown: no cap") == 1


def test_a_callers_own_source_stays_a_string_and_k_must_be_positive():
    splits, _ = _splits()
    splits.propose(2, "my callback", "why")
    assert splits.history[-1].source == "my callback" and not isinstance(splits.history[-1].source, Source)
    with pytest.raises(ValueError, match="k"):
        splits.propose(0, Source.OOM, "none")
    assert splits.k == 2


@pytest.mark.parametrize(
    ("k", "cap", "split", "n", "expected"),
    [
        (1, None, True, 64, 1),
        (2, 16, True, 64, 4),  # raised to keep micro-batches within the cap
        (8, 16, True, 64, 8),
        (8, None, True, 5, 5),  # at most one micro-batch per sample
        (4, 16, False, 64, 1),  # a user does not allow the split: whole
    ],
    ids=["k1", "cap-raises", "k-above-cap", "one-per-sample", "unsplittable"],
)
def test_what_a_training_batch_runs_as(k, cap, split, n, expected):
    splits, _ = _splits(Capped(cap=cap, split=split))
    splits.propose(k, Source.OOM, "set")
    assert splits.effective_k(n, batch=None) == expected


def test_under_compile_no_micro_batch_of_one_sample_while_two_may_fit():
    splits, _ = _splits(compiled=True)
    splits.propose(8, Source.OOM, "set")
    assert splits.effective_k(8, batch=None) == 4
    assert splits.effective_k(3, batch=None) == 3  # below 4 samples the cap does not apply
    splits.watch.allow_single("train")
    assert splits.effective_k(8, batch=None) == 8


def test_evaluation_k_per_stage_and_its_restore():
    user = Capped()
    splits, _ = _splits(user)
    assert splits.eval_k_of("validation", 16, batch=None) == 1
    splits.set_eval_k("validation", 4, "OOM in validation", batch_size=16)
    assert splits.eval_k_of("validation", 16, batch=None) == 4
    assert splits.eval_k_of("validation", 3, batch=None) == 3
    assert splits.eval_k_of("test", 16, batch=None) == 1
    assert splits.k == 1  # the training k is another number
    assert user.changes == [KChange(7, 1, 4, 16, Source.OOM, "OOM in validation", "validation")]
    splits.restore_eval_k({"validation": 2, "test": 3})  # a checkpoint's: only where none is set, unannounced
    assert splits.eval_k == {"validation": 4, "test": 3}
    assert len(user.changes) == 1 == len(splits.history)
    user.split = False
    assert splits.eval_k_of("validation", 16, batch=None) == 1
