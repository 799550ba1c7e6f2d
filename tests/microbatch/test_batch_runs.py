"""batches.py: what differs per batch, driven by short real fits with fake users: a training batch's micro-batch
backwards, each told to the users with its share of the batch, and an evaluation batch's chunks put back together
in order after an OOM there."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_gpuopt.microbatch import MicroBatchEngine, MicroBatchUser
from tests.helpers import TRAINER_QUIET


class Listens(MicroBatchUser, pl.Callback):
    """Splits every training batch in two from the start and records each micro-batch's backward."""

    def __init__(self) -> None:
        self.told = []

    def on_fit_start(self, trainer, pl_module):
        MicroBatchEngine.attach(trainer, self).propose(2, "test", "two micro-batches", batch_size=8)

    def teardown(self, trainer, pl_module, stage):
        MicroBatchEngine.get(trainer).release(self)

    def after_backward(self, told):
        grads = [p.grad is not None for p in told.params]
        self.told.append(
            (told.index, told.count, told.weight, told.samples, told.first_in_window, told.accumulate)
        )
        assert all(grads)  # this batch's micro-batches so far are in .grad


def test_each_micro_batch_backward_is_told_with_its_share_and_window():
    """(index, count, weight, the batch's samples, first in its accumulation window, accumulate) per backward."""
    user = Listens()
    trainer = pl.Trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[user], **TRAINER_QUIET)
    trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=8))
    assert user.told == [
        (0, 2, 0.5, 8, True, 2),
        (1, 2, 0.5, 8, True, 2),
        (0, 2, 0.5, 8, False, 2),
        (1, 2, 0.5, 8, False, 2),
    ]


class TightPredict(BoringModel):
    """Out of memory when predicting more than 4 samples at once; a prediction is the batch's rows, doubled."""

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        if batch.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return 2 * batch


class Decides(MicroBatchUser, pl.Callback):
    """Holds the engine for predict and answers an OOM with twice the k."""

    def on_predict_start(self, trainer, pl_module):
        MicroBatchEngine.attach(trainer, self, training=False)

    def on_predict_end(self, trainer, pl_module):
        self.eval_k = dict(MicroBatchEngine.get(trainer).eval_k)
        MicroBatchEngine.get(trainer).release(self)

    def decide_oom(self, failure, smallest_failed, splittable):
        return 2 * failure.k


def test_an_evaluation_batch_runs_as_chunks_put_back_together_in_order():
    data = RandomDataset(32, 16)
    user = Decides()
    trainer = pl.Trainer(callbacks=[user], **TRAINER_QUIET)
    predictions = trainer.predict(TightPredict(), DataLoader(data, batch_size=8))
    assert user.eval_k == {"predict": 2}
    assert len(predictions) == 2
    torch.testing.assert_close(torch.cat(predictions), 2 * torch.stack([data[i] for i in range(16)]))


class Splits(Listens):
    """Splits every training batch into ``k`` micro-batches; records the loss Lightning's hooks see."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.losses, self.before_backward = k, [], []

    def on_fit_start(self, trainer, pl_module):
        MicroBatchEngine.attach(trainer, self).propose(
            self.k, "test", f"{self.k} micro-batches", batch_size=8
        )

    def after_backward(self, told):
        self.told.append((told.index, told.count, told.measuring))

    def on_before_backward(self, trainer, pl_module, loss):
        self.before_backward.append(loss.requires_grad)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class Records(pl.Callback):
    def __init__(self) -> None:
        self.losses, self.before_backward = [], []

    on_before_backward = Splits.on_before_backward
    on_train_batch_end = Splits.on_train_batch_end


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_sees_the_whole_batchs_loss_at_any_split(accumulate):
    """The loss Lightning's hooks and progress bar get is the batch's loss, whatever the split (micro-batches of
    unequal size included: 8 samples in 3 are 3, 3 and 2), and it requires grad in on_before_backward, as the
    user's own loss does in plain Lightning."""
    seen = {}
    for k in (None, 1, 2, 3):
        pl.seed_everything(0)
        user = Records() if k is None else Splits(k)
        trainer = pl.Trainer(
            max_steps=2, accumulate_grad_batches=accumulate, callbacks=[user], **TRAINER_QUIET
        )
        trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=8))
        assert user.before_backward == [True] * (2 * accumulate)
        seen[k] = user.losses
        if k is not None:
            assert {count for _, count, _ in user.told} == {k}
    for k in (1, 2, 3):
        torch.testing.assert_close(seen[k], seen[None], rtol=1e-6, atol=0)


class Measures(Splits):
    """Asks for a measurement split of every batch, proposing nothing."""

    def on_fit_start(self, trainer, pl_module):
        MicroBatchEngine.attach(trainer, self)

    def measure_split(self, batch_idx):
        return True


def test_a_backward_is_told_measuring_only_in_a_split_made_for_a_measurement():
    told = {}
    for user in (Measures(1), Splits(2)):
        trainer = pl.Trainer(max_steps=1, callbacks=[user], **TRAINER_QUIET)
        trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=8))
        told[type(user).__name__] = user.told
    assert told == {"Measures": [(0, 2, True), (1, 2, True)], "Splits": [(0, 2, False), (1, 2, False)]}
