"""MemmapDataset: written once, read sample by sample from the mapping, lazily per process."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import MemmapDataset
from lightning_gpuopt.memory import get_probe


@pytest.mark.parametrize("access", ["read", "mmap"])
def test_tuple_samples_keep_values_dtypes_and_shapes(tmp_path, access):
    images = torch.arange(5 * 3 * 2 * 2, dtype=torch.uint8).reshape(5, 3, 2, 2)
    labels = torch.tensor([4, 3, 2, 1, 0])
    flags = np.array([True, False, True, True, False])
    ds = MemmapDataset.write(tmp_path / "d", images, labels, flags, access=access)
    assert ds.access == access
    assert len(ds) == 5 and ds.names is None and ds.nbytes == images.nbytes + labels.nbytes + flags.nbytes
    x, y, f = ds[1]
    assert torch.equal(x, images[1]) and x.dtype == torch.uint8
    assert y.item() == 3 and y.dtype == torch.int64 and f.dtype == torch.bool and not f
    assert torch.equal(ds[-1][0], images[4])
    x[0, 0, 0] = 255  # samples are copies: writable, and the file is untouched
    assert MemmapDataset(tmp_path / "d", access=access)[1][0][0, 0, 0] == images[1, 0, 0, 0]
    with pytest.raises(IndexError, match="index 5 is out of range for a MemmapDataset of 5 samples"):
        ds[5]


@pytest.mark.parametrize("access", ["read", "mmap"])
def test_named_arrays_give_dict_samples_and_batched_reads_keep_the_asked_order(tmp_path, access):
    ds = MemmapDataset.write(
        tmp_path,
        image=np.arange(40, dtype=np.float32).reshape(10, 4),
        label=np.arange(10) * 10,
        access=access,
    )
    samples = ds.__getitems__([7, 2, 9, 2, 3, 4])  # unsorted, a repeat, a run of consecutive rows
    assert [s["label"].item() for s in samples] == [70, 20, 90, 20, 30, 40]
    assert [s["image"][0].item() for s in samples] == [28.0, 8.0, 36.0, 8.0, 12.0, 16.0]
    batch = next(iter(DataLoader(ds, batch_size=4)))  # DataLoader fetches through __getitems__
    assert batch["image"].shape == (4, 4) and batch["label"].tolist() == [0, 10, 20, 30]


def test_transform_is_applied_to_every_sample(tmp_path):
    ds = MemmapDataset.write(tmp_path, np.ones((4, 2), np.float32), transform=lambda s: (s[0] * 3,))
    assert ds[0][0].tolist() == [3.0, 3.0] and ds.__getitems__([1])[0][0].tolist() == [3.0, 3.0]
    with pytest.raises(TypeError, match="`transform` must be a callable"):
        MemmapDataset(tmp_path, transform=3)


def test_writes_larger_arrays_in_chunks_from_a_memory_map(tmp_path, monkeypatch):
    from lightning_gpuopt.data import memmap as memmap_mod

    monkeypatch.setattr(memmap_mod, "_CHUNK_BYTES", 64)  # several chunks for a small array
    source = np.lib.format.open_memmap(tmp_path / "src.npy", mode="w+", dtype=np.int32, shape=(50, 3))
    source[:] = np.arange(150).reshape(50, 3)
    ds = MemmapDataset.write(tmp_path / "out", np.load(tmp_path / "src.npy", mmap_mode="r"))
    assert np.array_equal(np.stack([ds[i][0].numpy() for i in range(50)]), np.arange(150).reshape(50, 3))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((), {}, ValueError, r"either positional arrays .* got 0 positional and 0 named"),
        ((np.zeros(3),), {"y": np.zeros(3)}, ValueError, r"got 1 positional and 1 named"),
        ((np.zeros(3), np.zeros(4)), {}, ValueError, r"same length along dim 0, got array 0: 3, array 1: 4"),
        ((np.array(["a", "b"]),), {}, TypeError, r"array 0 must hold numbers or booleans, got dtype <U1"),
        (
            (torch.zeros(2, dtype=torch.bfloat16),),
            {},
            TypeError,
            r"bfloat16 tensor, which numpy cannot store",
        ),
        ((np.float32(1.0),), {}, ValueError, r"must have a sample dimension"),
    ],
    ids=["nothing", "both", "lengths", "strings", "bfloat16", "scalar"],
)
def test_bad_writes_are_clear_errors(tmp_path, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        MemmapDataset.write(tmp_path, *args, **kwargs)


def test_existing_missing_and_foreign_datasets(tmp_path):
    MemmapDataset.write(tmp_path / "d", np.zeros(3))
    with pytest.raises(FileExistsError, match="pass `overwrite=True`"):
        MemmapDataset.write(tmp_path / "d", np.ones(2))
    assert len(MemmapDataset.write(tmp_path / "d", np.ones(2), overwrite=True)) == 2
    with pytest.raises(
        FileNotFoundError, match=r"No MemmapDataset at .*MemmapDataset.write\(path, \*arrays\)"
    ):
        MemmapDataset(tmp_path / "nothing")
    manifest = tmp_path / "d" / "memmap.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": "other/9"}))
    with pytest.raises(ValueError, match="has format 'other/9'"):
        MemmapDataset(tmp_path / "d")
    with pytest.raises(ValueError, match=r"`access` must be one of \('read', 'mmap'\), got 'disk'"):
        MemmapDataset(tmp_path / "d", access="disk")


def test_opens_lazily_and_pickles_without_the_mapping(tmp_path):
    ds = MemmapDataset.write(tmp_path, np.arange(1000, dtype=np.float64).reshape(100, 10))
    assert ds._arrays is None  # constructing read the manifest only
    ds[3]
    assert ds._arrays is not None
    data = pickle.dumps(ds)
    assert len(data) < 2000  # the path and layout, not 8 kB of samples
    clone = pickle.loads(data)
    assert clone._arrays is None and clone[3][0].tolist() == ds[3][0].tolist()


ROWS, COLS = 16384, 2048  # int32: 128 MiB on disk
BATCH = 512


class ResidentProbe(Dataset):
    """Reads from a MemmapDataset inside a worker; returns per sample whether row i held i, and the worker's RSS.

    Only small values travel back to the main process, so the worker's resident memory is what it
    holds for reading, not what it ships.
    """

    def __init__(self, ds: MemmapDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitems__(self, indices):
        samples = self.ds.__getitems__(indices)
        rss = get_probe("cpu").reserved
        return [(i, bool((s[0] == i).all()), os.getpid(), rss) for i, s in zip(indices, samples)]


def _worker_growth(ds: MemmapDataset) -> tuple[list[int], set[int], int]:
    """Read every sample once through 2 workers, in file order; (ids, worker pids, largest RSS growth).

    File order makes each batch touch pages no earlier batch touched (a shuffled order lets the
    kernel's fault-around map most of the file within the first batches), so what a worker keeps
    of the file shows as growth.

    A worker's growth is its resident memory after its last batch minus after its second one: the
    first batches pay for start-up (imports, allocator arenas, the batch buffers that the allocator
    keeps for reuse), which is not the file.
    """
    order = list(range(ROWS))
    loader = DataLoader(ResidentProbe(ds), batch_size=BATCH, sampler=order, num_workers=2)
    seen, batches, first, last = [], {}, {}, {}
    for ids, correct, pids, rss in loader:
        assert bool(correct.all()), "a worker read a row that is not its sample"
        seen += ids.tolist()
        pid, value = int(pids[0]), int(rss[0])
        batches[pid] = batches.get(pid, 0) + 1
        if batches[pid] == 2:
            first[pid] = value
        last[pid] = value
    assert seen == order  # every sample once, in the order asked for
    return seen, set(first), max(last[pid] - first[pid] for pid in first)


@pytest.mark.slow
def test_workers_read_every_sample_while_resident_memory_stays_far_below_the_file(tmp_path):
    rows = np.broadcast_to(np.arange(ROWS, dtype=np.int32)[:, None], (ROWS, COLS))  # row i is all i; no RAM
    before = get_probe("cpu").reserved
    ds = MemmapDataset.write(tmp_path, rows)
    size = ds.nbytes
    assert size == ROWS * COLS * 4 and os.path.getsize(tmp_path / "000.npy") > size
    assert get_probe("cpu").reserved - before < size / 4  # writing went through the mapping, chunk by chunk
    _, pids, growth = _worker_growth(ds)
    assert len(pids) == 2 and os.getpid() not in pids
    # Each worker read half the file (64 MiB); what it keeps resident must stay far below that.
    assert growth < size / 8, (
        f"a worker grew by {growth / 2**20:.0f} MiB reading half of a {size / 2**20:.0f} MiB file"
    )
    assert ds._arrays is None  # the main process never opened the files: each worker opened its own

    # The test can fail: reading through a memory mapping keeps every page touched resident.
    mapped = MemmapDataset(tmp_path, access="mmap")
    _, _, mapped_growth = _worker_growth(mapped)
    assert mapped_growth > size / 4, f"mmap access grew by {mapped_growth / 2**20:.0f} MiB only"
