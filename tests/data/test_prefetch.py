"""Device prefetch: the iterator logic on CPU with a recording transfer, Lightning's paths, and real CUDA."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from lightning_gpuopt import GPUOptDataModule, GPUOptWarning, OOMRecovery
from lightning_gpuopt.data import (
    BatchTransfer,
    CudaStreamTransfer,
    DevicePrefetcher,
    DevicePrefetchLoader,
    InFlight,
    PrefetchStats,
    batch_nbytes,
)
from tests.helpers import TRAINER_QUIET, IndexedRegression, RecordingRegressor


class RecordingTransfer(BatchTransfer):
    """Stands in for the device copy: clones every tensor and logs each call, in order."""

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.copies: list[Any] = []
        self.fail_at = fail_at
        self.error = error or torch.OutOfMemoryError(
            "CUDA out of memory (simulated). Tried to allocate 2.00 MiB"
        )

    def start(self, batch: Any) -> InFlight:
        n = sum(1 for kind, _ in self.events if kind == "start")
        if n == self.fail_at:
            raise self.error
        copy = apply_to_collection(batch, torch.Tensor, torch.clone)
        self.events.append(("start", n))
        self.copies.append(copy)
        return InFlight(copy, nbytes=batch_nbytes(copy), token=n)

    def ready(self, item: InFlight) -> Any:
        self.events.append(("ready", item.token))
        return item.batch


class Counting:
    """An iterator over ``items`` that counts how many were read (to check read-ahead)."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.read = items, 0

    def __iter__(self):
        for item in self.items:
            self.read += 1
            yield item


def _ids(batches) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


@pytest.mark.parametrize("depth", [1, 2, 3], ids=["depth1", "depth2", "depth3"])
def test_prefetcher_yields_the_same_batches_in_the_same_order_as_plain_iteration(depth):
    loader = DataLoader(
        IndexedRegression(50), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    plain = list(loader)
    loader.generator.manual_seed(3)
    transfer = RecordingTransfer()
    prefetched = list(DevicePrefetcher(loader, transfer, depth=depth))
    assert _ids(prefetched) == _ids(plain)
    for a, b in zip(prefetched, plain):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert [id(b) for b in prefetched] == [id(c) for c in transfer.copies]  # what was copied is what came out


@pytest.mark.parametrize("depth", [1, 2], ids=["depth1", "depth2"])
def test_next_copy_is_queued_before_the_current_batch_is_handed_out(depth):
    source = Counting([torch.full((2,), float(i)) for i in range(6)])
    transfer = RecordingTransfer()
    prefetcher = DevicePrefetcher(source, transfer, depth=depth)
    assert source.read == 0  # nothing is read before the first batch is asked for
    for i, batch in enumerate(prefetcher):
        assert int(batch[0]) == i
        events = transfer.events
        # This batch was made ready exactly once, after its copy began, and before it was handed out ...
        assert events.count(("ready", i)) == 1 and events.index(("start", i)) < events.index(("ready", i))
        # ... and the copies of the next `depth` batches are already queued (they overlap this step).
        started = {n for kind, n in events if kind == "start"}
        assert started == set(range(min(6, i + 1 + depth)))
        assert source.read == min(6, i + 1 + depth)  # never more than `depth` batches read ahead
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_bad_depth_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`depth` must be a positive int, got 0"):
        DevicePrefetcher([], RecordingTransfer(), depth=0)
    with pytest.raises(ValueError, match=r"`prefetch_depth` must be a positive int, got 0"):
        DevicePrefetchLoader(IndexedRegression(4), transfer=RecordingTransfer(), prefetch_depth=0)


def test_out_of_memory_in_a_copy_falls_back_to_host_batches_and_loses_nothing():
    batches = [torch.full((3,), float(i)) for i in range(5)]
    transfer = RecordingTransfer(fail_at=2)
    stats = PrefetchStats()
    with pytest.warns(GPUOptWarning, match=r"Device prefetch ran out of memory .* Nothing is lost"):
        out = list(DevicePrefetcher(batches, transfer, stats=stats))
    assert [int(b[0]) for b in out] == [0, 1, 2, 3, 4]
    assert [out[i] is transfer.copies[i] for i in range(2)] == [True, True]  # copied before the OOM
    assert all(out[i] is batches[i] for i in (2, 3, 4))  # the host batches, for Lightning to move
    assert stats.disabled and stats.reserved_bytes == 0


def test_other_errors_in_a_copy_propagate():
    with pytest.raises(RuntimeError, match="illegal memory access"):
        list(
            DevicePrefetcher(
                [torch.zeros(1)], RecordingTransfer(fail_at=0, error=RuntimeError("illegal memory access"))
            )
        )


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: str


class OwnTo:
    """An object with its own `.to`: its tensors are invisible to record_stream."""

    def __init__(self) -> None:
        self.t = torch.zeros(2)

    def to(self, device):
        return self


@pytest.mark.parametrize(
    "batch",
    [
        {"x": torch.ones(2, 3), "meta": ["a", "b"]},
        Pair(torch.ones(2), torch.zeros(2)),
        Sample(torch.ones(2), "s"),
    ],
    ids=["dict", "namedtuple", "dataclass"],
)
def test_structures_come_out_whole_and_equal(batch):
    out = list(DevicePrefetcher([batch], RecordingTransfer()))
    assert type(out[0]) is type(batch)
    assert batch_nbytes(out[0]) == batch_nbytes(batch) > 0


def test_cuda_transfer_leaves_batches_with_custom_to_objects_on_the_host_without_touching_cuda():
    transfer = CudaStreamTransfer("cuda:0")  # constructing needs no GPU; the stream is made on first copy
    batch = {"x": torch.ones(2), "obj": OwnTo()}
    item = transfer.start(batch)
    assert item.on_device is False and item.batch is batch
    with pytest.raises(ValueError, match=r"`device` must be a CUDA device, got 'cpu'"):
        CudaStreamTransfer("cpu")


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(10):
            yield i, torch.full((4,), float(i))


def test_loader_reports_device_bytes_held_ahead():
    stats = PrefetchStats()
    loader = DevicePrefetchLoader(
        IndexedRegression(20, dim=8), batch_size=5, transfer=RecordingTransfer(), prefetch_stats=stats
    )
    assert [len(b[0]) for b in loader] == [5, 5, 5, 5]
    per_batch = 5 * 8 + 5 * 8 * 4 + 5 * 1 * 4  # int64 ids, float32 x (dim 8), float32 y
    assert (stats.batches, stats.max_batch_bytes, stats.batches_ahead) == (4, per_batch, 1)
    assert stats.reserved_bytes == per_batch
    # Without a length Lightning reads one batch ahead itself: two batches ahead in all.
    unsized = DevicePrefetchLoader(Stream(), batch_size=2, transfer=RecordingTransfer(), prefetch_depth=2)
    list(unsized)
    assert unsized.prefetch_stats.batches_ahead == 3


def test_loader_without_transfer_is_a_plain_loader():
    loader = DevicePrefetchLoader(IndexedRegression(6), batch_size=3)
    assert not isinstance(iter(loader), DevicePrefetcher)
    assert _ids(loader) == [[0, 1, 2], [3, 4, 5]]


def test_lightning_reinstantiation_keeps_the_prefetch_settings():
    """What Lightning does under DDP (distributed sampler) and in predict: re-create the loader."""
    transfer, stats = RecordingTransfer(), PrefetchStats()
    loader = DevicePrefetchLoader(
        IndexedRegression(12), batch_size=4, transfer=transfer, prefetch_stats=stats
    )
    new = _update_dataloader(loader, SequentialSampler(range(6)))
    assert type(new) is DevicePrefetchLoader and new.transfer is transfer and new.prefetch_stats is stats
    assert _ids(new) == [[0, 1, 2, 3], [4, 5]]


# ---------------------------------------------------------------------------- through Trainer.fit (CPU)


class PrefetchingData(GPUOptDataModule):
    """GPUOptDataModule with the CPU stand-in transfer injected, as if training ran on a GPU."""

    def __init__(self, n: int = 40, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n = n
        self.transfer = RecordingTransfer()

    def train_dataset(self):
        return IndexedRegression(self.n)

    def predict_dataset(self):
        return IndexedRegression(10)

    def _batch_transfer(self, stage):
        return self.transfer


class PointerRecorder(RecordingRegressor):
    """Also records which tensor storage each training step received, to compare with the copies."""

    def __init__(self) -> None:
        super().__init__()
        self.pointers: list[int] = []

    def training_step(self, batch, batch_idx):
        self.pointers.append(batch[1].untyped_storage().data_ptr())
        return super().training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return batch[0]


@pytest.mark.parametrize("num_workers", [0, 2], ids=["in-process", "two-workers"])
def test_fit_trains_on_the_prefetched_batches_every_sample_once(num_workers):
    dm = PrefetchingData(n=40, batch_size=8, num_workers=num_workers)
    model = PointerRecorder()
    pl.Trainer(max_epochs=2, **TRAINER_QUIET).fit(model, dm)
    assert isinstance(dm.trainer.train_dataloader, DevicePrefetchLoader)
    copies = [c[1].untyped_storage().data_ptr() for c in dm.transfer.copies]
    assert model.pointers == copies  # the steps got the copied batches, in order, each once
    for epoch in range(2):
        seen = [i for b in model.train_ids[epoch * 5 : (epoch + 1) * 5] for i in b]
        assert collections.Counter(seen) == collections.Counter(range(40))
    assert (
        dm.prefetched_batch_bytes == 8 * 8 + 8 * 8 * 4 + 8 * 4
        and dm.device_prefetch_bytes == dm.prefetched_batch_bytes
    )


def test_engine_splits_the_prefetched_batch_inside_the_step():
    dm = PrefetchingData(n=32, batch_size=8, num_workers=0, shuffle=False)
    model = RecordingRegressor()
    recovery = OOMRecovery(verbose=False)
    recovery.load_state_dict({"k": 2})  # two micro-batches per batch from the first step
    pl.Trainer(max_epochs=1, callbacks=[recovery], **TRAINER_QUIET).fit(model, dm)
    assert [len(c[0]) for c in dm.transfer.copies] == [8, 8, 8, 8]  # whole batches were copied
    assert [len(ids) for ids in model.train_ids] == [4] * 8  # the engine split each into two
    assert [i for ids in model.train_ids for i in ids] == list(range(32))


def test_predict_reinstantiates_the_loader_and_still_prefetches():
    dm = PrefetchingData(batch_size=4, num_workers=0)
    predictions = pl.Trainer(**TRAINER_QUIET).predict(PointerRecorder(), datamodule=dm)
    assert [p.tolist() for p in predictions] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(dm.transfer.copies) == 3


# ---------------------------------------------------------------------------- real CUDA


@pytest.mark.cuda
def test_cuda_prefetch_matches_plain_iteration_and_frees_its_memory():
    loader = DataLoader(IndexedRegression(256, dim=64), batch_size=32, pin_memory=True)
    transfer = CudaStreamTransfer("cuda:0")
    prefetched = list(DevicePrefetcher(loader, transfer))
    for got, want in zip(prefetched, loader):
        assert all(t.is_cuda for t in got)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
    del prefetched
    # cuBLAS takes its workspace (32 MiB on Hopper) from the caching allocator on the first matmul of a
    # stream and keeps it: take it before measuring, so that only the prefetcher's memory is compared.
    (torch.ones(2, 2, device="cuda:0") @ torch.ones(2, 2, device="cuda:0")).sum().item()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):  # a steady state: record_stream'd blocks come back, nothing accumulates
        for batch in DevicePrefetcher(loader, transfer):
            (batch[1] @ batch[1].T).sum().item()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 2**20


@pytest.mark.cuda
def test_cuda_fit_prefetches_by_default_with_the_engine_splitting():
    class Data(GPUOptDataModule):
        def train_dataset(self):
            return IndexedRegression(64)

    dm = Data(batch_size=16, num_workers=0)
    model = RecordingRegressor()
    recovery = OOMRecovery(verbose=False)
    recovery.load_state_dict({"k": 2})
    trainer = pl.Trainer(max_epochs=1, callbacks=[recovery], **{**TRAINER_QUIET, "accelerator": "cuda"})
    trainer.fit(model, dm)
    assert dm.resolved_device_prefetch() is True and isinstance(
        trainer.train_dataloader, DevicePrefetchLoader
    )
    assert sorted(i for ids in model.train_ids for i in ids) == list(range(64))
    assert dm.device_prefetch_bytes == dm.prefetched_batch_bytes == 16 * 8 + 16 * 8 * 4 + 16 * 4
