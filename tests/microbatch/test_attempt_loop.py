"""attempt_loop.py: the one attempt loop, driven by short real fits (the Trainer's steps are what it patches) with
fake users in place of OOMRecovery and PrecisionSwitch, and a module that runs out of memory on any micro-batch of
more than 4 samples: the user decides the retry, the loop applies it, a check sends an attempt back, and without
a decider an OOM passes through unchanged."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_gpuopt.microbatch import MicroBatchEngine, MicroBatchOOMError, MicroBatchUser
from lightning_gpuopt.votes import Source
from tests.helpers import TRAINER_QUIET


class Tight(BoringModel):
    """Out of memory in the forward of more than ``fits`` samples; records each training step's samples."""

    def __init__(self, fits: int = 4) -> None:
        super().__init__()
        self.fits, self.seen = fits, []

    def training_step(self, batch, batch_idx):
        self.seen.append((batch_idx, batch.shape[0]))
        if batch.shape[0] > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return super().training_step(batch, batch_idx)


class User(MicroBatchUser, pl.Callback):
    """Attaches to the engine for the fit; decides OOMs by doubling k (``double``), or gives up; sends back the
    first attempt of each batch in ``send_back``."""

    def __init__(self, decide: str = "double", send_back=()) -> None:
        self.decide, self.send_back, self.failures, self.checked = decide, set(send_back), [], []

    def on_fit_start(self, trainer, pl_module):
        MicroBatchEngine.attach(trainer, self)

    def teardown(self, trainer, pl_module, stage):
        MicroBatchEngine.get(trainer).release(self)

    def decide_oom(self, failure, smallest_failed, splittable):
        self.failures.append(failure)
        if self.decide == "give up" and len(self.failures) == 1:  # once: were it retried, the fit would go on
            raise MicroBatchOOMError(f"nothing left to split at step {failure.step}")
        return 2 * failure.k

    def check_attempt(self, batch_idx, loss):
        self.checked.append((batch_idx, loss is not None))
        if batch_idx in self.send_back:
            self.send_back.discard(batch_idx)
            return True
        return False


class Listener(MicroBatchUser, pl.Callback):
    """Holds the engine and decides nothing."""

    def on_fit_start(self, trainer, pl_module):
        MicroBatchEngine.attach(trainer, self)

    def teardown(self, trainer, pl_module, stage):
        MicroBatchEngine.get(trainer).release(self)


def _fit(model: BoringModel, user: pl.Callback, steps: int = 2) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, callbacks=[user], **TRAINER_QUIET)
    trainer.fit(model, DataLoader(RandomDataset(32, 64), batch_size=8))
    return trainer


def test_an_oom_is_decided_by_the_user_and_the_same_batch_retried_at_its_k():
    model, user = Tight(), User()
    history = []

    class Keep(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            history.extend(MicroBatchEngine.get(trainer).history)

    trainer = pl.Trainer(max_steps=2, callbacks=[user, Keep()], **TRAINER_QUIET)
    trainer.fit(model, DataLoader(RandomDataset(32, 64), batch_size=8))
    [failure] = user.failures
    assert (failure.phase, failure.batch_size, failure.k, failure.micro_batch_size) == ("forward", 8, 1, 8)
    assert [(c.k_before, c.k_after, c.source) for c in history] == [(1, 2, Source.OOM)]
    # batch 0 failed whole; the loss-weighting check ran before the first split (2 samples whole, then 1 + 1); then
    # batch 0 ran as two micro-batches of 4, and batch 1 at the new k
    assert model.seen == [(0, 8), (0, 2), (0, 1), (0, 1), (0, 4), (0, 4), (1, 4), (1, 4)]
    assert trainer.global_step == 2
    assert user.checked == [(0, True), (1, True)]  # asked once per kept attempt, with the batch's loss


def test_a_check_that_sends_the_attempt_back_runs_the_batch_again():
    model, user = Tight(fits=8), User(send_back={0})
    trainer = _fit(model, user)
    assert model.seen == [(0, 8), (0, 8), (1, 8)]
    assert user.checked == [(0, True), (0, True), (1, True)] and trainer.global_step == 2


def test_the_deciders_refusal_ends_the_fit_with_its_error():
    model, user = Tight(), User(decide="give up")
    with pytest.raises(MicroBatchOOMError, match="nothing left to split at step 0"):
        _fit(model, user)
    assert model.seen == [(0, 8)]


def test_without_a_decider_an_oom_passes_through_unchanged():
    model = Tight()
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 1\.00 GiB") as caught:
        _fit(model, Listener())
    assert type(caught.value) is torch.OutOfMemoryError and model.seen == [(0, 8)]
