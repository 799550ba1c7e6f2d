"""A training IterableDataset other than a ShardedStream (issue 37): the pack cannot resume it mid-epoch, and says so
instead of repeating samples silently, also when it has a state_dict of its own (Hugging Face's: the loader's
workers hold the place, not the copy the datamodule sees). At setup, one line says what a mid-epoch resume will do; on such a resume,
one line says how many samples are trained on twice, and that figure is what the resumed epoch repeats (8 shards
of 25 ids, batches of 4, a checkpoint after 20 steps: 80), with 0 and 2 loader workers."""

from __future__ import annotations

import collections
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import IterableDataset, get_worker_info

from lightning_gpuopt import GPUOptDataModule
from tests.helpers import TRAINER_QUIET


class Shards(IterableDataset):
    """8 shards of 25 ids; each loader worker reads every n-th shard."""

    def __iter__(self):
        info = get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        for shard in range(me, 8, workers):
            yield from (torch.tensor(shard * 25 + i) for i in range(25))


class StatefulShards(Shards):
    """The same, with a state of its own that a resume never sees (as a Hugging Face IterableDataset's)."""

    def state_dict(self) -> dict:
        return {"shard": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


class Stream(GPUOptDataModule):
    def __init__(self, workers: int, stateful: bool = False) -> None:
        super().__init__(batch_size=4, num_workers=workers, persistent_workers=False)
        self.stateful = stateful

    def train_dataset(self):
        return StatefulShards() if self.stateful else Shards()


class Ids(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen += batch.tolist()
        return (self.w * batch.float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "an IterableDataset" in r.getMessage()]


@pytest.mark.parametrize(("workers", "stateful"), [(0, False), (2, False), (2, True)])
def test_a_stream_says_what_a_resume_repeats_and_the_figure_is_right(tmp_path, caplog, workers, stateful):
    caplog.set_level(logging.INFO)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=20, save_top_k=-1)
    first = Ids()
    trainer = pl.Trainer(max_steps=20, callbacks=[saves], **{**TRAINER_QUIET, "enable_checkpointing": True})
    trainer.fit(first, Stream(workers, stateful))
    (setup,) = _lines(caplog)
    name = "StatefulShards" if stateful else "Shards"
    assert setup.startswith(f"GPUOptDataModule: the training dataset {name} is an IterableDataset")
    assert "starts that epoch again from its beginning" in setup and "\n" not in setup
    caplog.clear()
    resumed = Ids()
    trainer = pl.Trainer(max_epochs=1, **TRAINER_QUIET)
    trainer.fit(resumed, Stream(workers, stateful), ckpt_path=str(tmp_path / "epoch=0-step=20.ckpt"))
    (line,) = _lines(caplog)
    counts = collections.Counter(first.seen + resumed.seen)
    repeated = sum(n - 1 for n in counts.values())
    assert sorted(counts) == list(range(200)) and repeated == 80
    assert f"the {repeated} sample(s) of those batches are trained on twice" in line
    assert line.startswith(f"GPUOptDataModule: resuming after 20 training batch(es) of an epoch of {name}")
