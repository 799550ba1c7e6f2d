"""batches.py: what differs per batch, driven by short real fits with fake users: a training batch's micro-batch
backwards, each told to the users with its share of the batch, and an evaluation batch's chunks put back together
in order after an OOM there."""

from __future__ import annotations

import lightning.pytorch as pl
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
