"""Exact mid-epoch resume of GPUOptDataModule's training loader (the 40-sample case of issue 17)."""

from __future__ import annotations

import collections

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_gpuopt import GPUOptDataModule
from lightning_gpuopt.data import BatchTransfer, InFlight
from lightning_gpuopt.data.resume import (
    ResumableSampler,
    SeededSamples,
    capture_rng,
    restore_rng,
    sample_seed,
)
from tests.helpers import TRAINER_QUIET, IndexedData40, RecordingRegressor


class HostClone(BatchTransfer):
    """Device prefetch's machinery on CPU: batches are copied ahead of use, as on CUDA."""

    def start(self, batch):
        return InFlight(batch, nbytes=1)

    def ready(self, item):
        return item.batch


class PrefetchingIndexedData(IndexedData40):
    def _batch_transfer(self, stage):
        return HostClone()


class OneCycleRegressor(RecordingRegressor):
    """Reads `estimated_stepping_batches` in `configure_optimizers`, as warm-up and OneCycle schedules do."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Killed(Exception):
    pass


class KillAfter(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Killed


def _fit(dm_cls, tmp_path, num_workers, kill=None, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    model = OneCycleRegressor()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    callbacks = [checkpoint] + ([KillAfter(kill)] if kill else [])
    quiet = {**TRAINER_QUIET, "enable_checkpointing": True}
    trainer = pl.Trainer(max_epochs=1, callbacks=callbacks, default_root_dir=tmp_path, **quiet)
    dm = dm_cls(batch_size=4, num_workers=num_workers, persistent_workers=False)
    if kill:
        with pytest.raises(Killed):
            trainer.fit(model, dm)
    else:
        trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize(
    ("dm_cls", "num_workers"),
    [(IndexedData40, 0), (IndexedData40, 2), (PrefetchingIndexedData, 0)],
    ids=["in-process", "two-workers", "device-prefetch"],
)
def test_killed_after_step_6_and_resumed_from_step_4_sees_every_sample_once(dm_cls, num_workers, tmp_path):
    reference = _fit(dm_cls, tmp_path / "ref", num_workers)
    killed = _fit(dm_cls, tmp_path / "run", num_workers, kill=6)
    resumed = _fit(dm_cls, tmp_path / "run2", num_workers, ckpt_path=tmp_path / "run" / "step=4.ckpt")
    seen = [i for b in killed.train_ids[:4] + resumed.train_ids for i in b]
    counts = collections.Counter(seen)
    repeated = sum(c - 1 for c in counts.values() if c > 1)
    missing = 40 - len(counts)
    assert (len(counts), repeated, missing) == (40, 0, 0)
    # In the order the uninterrupted run used, and shuffled.
    assert killed.train_ids[:4] + resumed.train_ids == reference.train_ids
    assert seen != sorted(seen)


def test_sampler_skips_the_samples_every_rank_consumed():
    shards = [ResumableSampler(range(10), num_replicas=2, rank=r, shuffle=True, seed=3) for r in (0, 1)]
    full = [[i for _, i in s] for s in shards]
    assert sorted(full[0] + full[1]) == list(range(10))
    shards[1].skip(epoch=0, samples=4)  # 2 on each of the 2 ranks: the first 4 of the epoch's order
    assert [i for _, i in shards[1]] == full[1][2:]
    shards[1].set_epoch(1)  # the resumed epoch is over: the next one starts at its beginning
    assert len(list(shards[1])) == 5


def test_padding_when_the_dataset_does_not_divide_by_the_world_size():
    shards = [
        [i for _, i in ResumableSampler(range(5), num_replicas=2, rank=r, shuffle=False)] for r in (0, 1)
    ]
    assert shards == [[0, 2, 4], [1, 3, 0]]  # DistributedSampler's padding: sample 0 twice in this epoch


def test_random_augmentation_is_a_function_of_sample_and_epoch():
    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return float(torch.rand(()))

    view = SeededSamples(Noisy(), seed=1)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = view.__getitems__([(0, 1), (0, 2)])
    assert torch.equal(torch.get_rng_state(), before)  # loading leaves the training step's stream alone
    assert view.__getitems__([(0, 2)]) == a[1:]
    assert view.__getitems__([(1, 2)]) != a[1:]


class NoisyIndexed(torch.utils.data.Dataset):
    """Sample i is (i, noise): the noise draws from torch's, Python's and NumPy's global RNGs, as augmentation does."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        import random

        import numpy as np

        return i, float(torch.rand(())) + random.random() + float(np.random.rand())


class NoisyData(GPUOptDataModule):
    def train_dataset(self):
        return NoisyIndexed()

    def val_dataset(self):
        return NoisyIndexed()


def _epochs(seed: int, workers: int, stage: str = "train", epochs: int = 2) -> list[list[tuple[int, float]]]:
    pl.seed_everything(seed, verbose=False)
    dm = NoisyData(batch_size=4, num_workers=workers, persistent_workers=False)
    loader = dm.train_dataloader() if stage == "train" else dm.val_dataloader()
    out = []
    for epoch in range(epochs):
        if stage == "train":
            loader.sampler.set_epoch(epoch)
        out.append([(int(i), float(x)) for ids, xs in loader for i, x in zip(ids, xs)])
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_the_seed_decides_order_and_augmentation_and_the_workers_do_not(workers):
    runs = {seed: _epochs(seed, workers) for seed in (0, 1, 2)}
    assert runs[0] == _epochs(0, 0)  # the same seed: the same order and draws, with or without workers
    for a, b in ((0, 1), (0, 2), (1, 2)):
        for epoch in range(2):
            order_a, order_b = ([i for i, _ in runs[s][epoch]] for s in (a, b))
            assert order_a != order_b, f"seeds {a} and {b} gave epoch {epoch} the same order"
            noise_a, noise_b = (dict(runs[s][epoch]) for s in (a, b))
            assert all(noise_a[i] != noise_b[i] for i in noise_a), (
                f"seeds {a} and {b} drew the same augmentation"
            )
    epoch0, epoch1 = (dict(e) for e in runs[0])
    assert all(epoch0[i] != epoch1[i] for i in epoch0)  # each epoch draws anew


@pytest.mark.parametrize("workers", [0, 2])
def test_evaluation_loading_leaves_the_training_streams_alone_and_repeats(workers):
    pl.seed_everything(3, verbose=False)
    dm = NoisyData(batch_size=4, num_workers=workers, persistent_workers=False)
    loader = dm.val_dataloader()
    import random

    import numpy as np

    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    validations = [[(int(i), float(x)) for ids, xs in loader for i, x in zip(ids, xs)] for _ in range(2)]
    # Neither building iterators nor loading in this process drew from the streams training uses.
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
    assert validations[0] == validations[1] == _epochs(3, 0, stage="val", epochs=1)[0]


def test_sample_seeds_are_splitmix64_and_use_the_63_bits_numpy_takes():
    # The seeds are part of a checkpoint's meaning: a run resumed by another version of the pack must draw the
    # same augmentation. splitmix64's reference outputs for state 0 pin the mixer.
    from lightning_gpuopt.data.resume import _mix

    golden = 0x9E3779B97F4A7C15
    assert [_mix((i * golden) & ((1 << 64) - 1)) for i in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    seeds = [sample_seed(7, epoch, index) for epoch in range(3) for index in range(200)]
    assert len(set(seeds)) == len(seeds)
    assert max(seeds) < 2**63 and max(seeds) > 2**62  # the top bit numpy allows is in use


def test_capture_and_restore_cover_torch_python_and_numpy():
    import random

    import numpy as np

    state = capture_rng()

    def draws():
        return float(torch.rand(())), random.random(), float(np.random.rand())

    first = draws()
    restore_rng(state)
    assert draws() == first
    restore_rng({})  # an empty state leaves every stream alone
    assert draws() != first


def test_the_users_dataset_attributes_stay_reachable_through_the_loaders_dataset():
    class WithLengths(NoisyIndexed):
        lengths = [3, 1, 4]

    dm = NoisyData(batch_size=4, num_workers=0)
    dm.train_dataset = WithLengths  # type: ignore[method-assign]
    dm.val_dataset = WithLengths  # type: ignore[method-assign]
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert loader.dataset.lengths == [3, 1, 4]
        with pytest.raises(AttributeError):
            loader.dataset.no_such_attribute  # noqa: B018
