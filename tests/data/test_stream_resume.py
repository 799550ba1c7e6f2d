"""ShardedStream (issue 37): a training stream of shards in one canonical order per (seed, epoch), read by
position, resumed exactly mid-epoch on any number of ranks and workers.

The order is swept with Hypothesis (shard sizes, window sizes, epochs): every sample once per epoch, a position
read alone equal to the same position read in order. A resume at 90 % of the epoch decodes at most one shard plus
one shuffle window. The issue's acceptance run (tests/resume_child.py over gloo): 16 shards of 1,250 samples, a
shuffle buffer of 512, stopped three times in one epoch and resumed as 2 ranks x 2 workers -> 1 x 1 -> 2 x 0 ->
1 x 2: every sample exactly once.
"""

from __future__ import annotations

import collections
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gpuopt import GPUOptDataModule
from lightning_gpuopt.data import ShardedStream
from lightning_gpuopt.data.stream import StreamPositions
from tests import resume_child
from tests.helpers import assert_same_training, run_ranks

SHARD = 1250


def _ids(shard_sizes: list[int]):
    starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
    return lambda s: (starts[s] + i for i in range(shard_sizes[s]))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    window=st.integers(0, 12),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_an_epoch_is_every_sample_once_and_any_position_reads_alone_as_in_order(sizes, window, epoch, data):
    stream = ShardedStream(list(range(len(sizes))), _ids(sizes), shuffle_buffer=window, seed=3)
    in_order = StreamPositions(stream, seed=3)
    order = [in_order[(epoch, p)] for p in range(len(in_order))]
    assert sorted(order) == list(range(sum(sizes)))
    if sum(sizes):
        p = data.draw(st.integers(0, sum(sizes) - 1), label="position")
        alone = StreamPositions(stream, seed=3)
        assert alone[(epoch, p)] == order[p]
        assert alone.decoded <= max(sizes) + max(1, window)  # one shard before the window, then the window
        by_index = StreamPositions(
            ShardedStream(stream.shards, lambda s: list(_ids(sizes)(s)), window, 3), seed=3
        )
        assert by_index[(epoch, p)] == order[p] and by_index.decoded == 1  # a sequence: only that sample


def test_epochs_and_seeds_draw_other_orders_and_a_window_stays_a_window():
    stream = ShardedStream(list(range(4)), _ids([25] * 4), shuffle_buffer=10, seed=0)
    view = StreamPositions(stream, seed=0)
    first, second = ([view[(e, p)] for p in range(100)] for e in (0, 1))
    assert first != second and sorted(first) == sorted(second) == list(range(100))
    other_seed = StreamPositions(stream, seed=1)
    assert [other_seed[(0, p)] for p in range(100)] != first
    shard_of = [i // 25 for i in first]  # a window of 10 mixes at most two neighbouring shards
    assert all(len(set(shard_of[w : w + 10])) <= 2 for w in range(0, 100, 10))


@pytest.mark.parametrize("as_list", [False, True])
def test_random_augmentation_in_read_shard_draws_the_same_whoever_decodes_a_sample_and_when(as_list):
    """Noise drawn inside read_shard (a process decodes a whole window from an iterator, whichever of its positions
    came first) is the same for a sample read in order, backwards, or by every other position; and iterating the
    stream leaves the caller's RNG streams as they were."""

    def noisy(shard: int):
        samples = ((shard * 10 + i, torch.rand(()).item()) for i in range(10))
        return list(samples) if as_list else samples

    stream = ShardedStream(list(range(5)), noisy, shuffle_buffer=8, seed=1)
    reads = []
    for positions in (range(50), reversed(range(50)), [*range(1, 50, 2), *range(0, 50, 2)]):
        view = StreamPositions(stream, seed=1)
        reads.append(dict(view[(2, p)] for p in positions))
    assert reads[0] == reads[1] == reads[2] and len(set(reads[0].values())) == 50
    torch.manual_seed(0)
    expected = torch.rand(())
    torch.manual_seed(0)
    list(stream)
    assert torch.rand(()) == expected


@pytest.mark.parametrize("as_list", [False, True])
def test_a_window_wider_than_its_shards_opens_each_shard_once(as_list):
    """A window of 64 over shards of 10: read in the epoch's order, each shard is opened once (the readers of every
    shard a window touches stay open; a tar reopened reads its headers again)."""
    opened = collections.Counter()

    def read(shard: int):
        opened[shard] += 1
        samples = (shard * 10 + i for i in range(10))
        return list(samples) if as_list else samples

    stream = ShardedStream(list(range(16)), read, shuffle_buffer=64, seed=0, shard_sizes=[10] * 16)
    view = StreamPositions(stream, seed=0)
    assert sorted(view[(0, p)] for p in range(160)) == list(range(160))
    assert opened == {shard: 1 for shard in range(16)}


def test_an_error_while_decoding_a_shard_is_raised_as_it_is_and_the_shard_read_again():
    failing = {"left": 1}

    def read(shard: int):
        for i in range(10):
            if shard == 1 and i == 3 and failing["left"]:
                failing["left"] -= 1
                raise OSError("disk hiccup")
            yield shard * 10 + i

    view = StreamPositions(ShardedStream([0, 1], read, shuffle_shards=False), seed=0)
    with pytest.raises(OSError, match="disk hiccup"):
        view[(0, 13)]
    assert view[(0, 13)] == 13  # not "shard 1 gave 3 samples, its size says 10"
    assert [view[(0, p)] for p in range(20)] == list(range(20))


class _Stream(GPUOptDataModule):
    def train_dataset(self):
        return ShardedStream(list(range(16)), _ids([SHARD] * 16), shuffle_buffer=512)


def _loader(
    state: dict | None = None,
    data_class: type = _Stream,
    batch_size: int = 100,
    workers: int = 0,
    ranks: int = 1,
    rank: int = 0,
):
    data = data_class(batch_size=batch_size, num_workers=workers, pin_memory=False, device_prefetch=False)
    data.trainer = SimpleNamespace(
        world_size=ranks, global_rank=rank, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    if state is not None:
        data.load_state_dict({"train_loader": state})
    return data.train_dataloader()


def test_a_resume_at_90_percent_decodes_at_most_one_shard_plus_the_shuffle_buffer():
    whole = [int(i) for batch in _loader() for i in batch]
    assert sorted(whole) == list(range(16 * SHARD))
    state = {"epoch": 0, "batches": 180, "batch_size": 100, "samples": 18_000, "seed": 0, "world_size": 1}
    loader = _loader({**state, "shard_sizes": [SHARD] * 16, "configured_batch_size": 100})
    batches = iter(loader)
    first = next(batches)
    decoded = loader.dataset.dataset.decoded
    assert decoded <= SHARD + 512, decoded
    rest = [int(i) for i in first] + [int(i) for batch in batches for i in batch]
    assert rest == whole[18_000:] and len(loader) == 200  # 180 counted by the fit loop, 20 left


def _leg(root: Path, ranks: int, workers: int, *args: object, source: tuple = ("--stream", 16)) -> None:
    common = (*source, "--shuffle-buffer", 512, "--length", 16 * SHARD, "--batch-size", 100)
    if ranks == 1:  # in this process: no process to start
        root.mkdir(parents=True, exist_ok=True)
        resume_child.main(
            [str(root), *map(str, common), "--workers", str(workers), "--no-dropout", *map(str, args)]
        )
        return
    run_ranks(
        Path(resume_child.__file__),
        root,
        *common,
        *("--devices", ranks, "--workers", workers, "--no-dropout", *args),
        ranks=1,
        result="params.pt",
        timeout=400,
    )


def _write_shards(folder: Path, form: str) -> tuple:
    """16 shards of 1,250 records ``{"id": i}``: JSON lines for Hugging Face datasets, or tar files of
    ``{i}.json`` members (WebDataset's layout); the child's ``--stored`` arguments."""
    import io
    import json
    import tarfile

    folder.mkdir()
    for shard in range(16):
        ids = range(shard * SHARD, (shard + 1) * SHARD)
        if form == "jsonl":
            (folder / f"part-{shard:02d}.jsonl").write_text(
                "".join(json.dumps({"id": i}) + "\n" for i in ids)
            )
            continue
        with tarfile.open(folder / f"part-{shard:02d}.tar", "w") as tar:
            for i in ids:
                payload = json.dumps({"id": i}).encode()
                info = tarfile.TarInfo(f"{i:06d}.json")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return ("--stored", str(folder / f"part-*.{form}"))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["jsonl", "tar"])
def test_stopped_three_times_in_one_epoch_on_other_ranks_and_workers_every_sample_once(tmp_path, form):
    """Optimizer batch 200 (2 ranks x 100, then 1 x 200, ...): SIGTERM at steps 25, 50 and 75 of the 100, resumed as
    2 ranks x 2 workers -> 1 x 1 -> 2 x 0 -> 1 x 2. Hugging Face datasets streaming local JSON lines through
    ``ShardedStream.from_hf`` (a ShardedStream of the child's own shards where datasets is not installed), and
    WebDataset-style tar shards through ``ShardedStream.from_tars``."""
    if form == "jsonl" and importlib.util.find_spec("datasets") is None:
        source: tuple = ("--stream", 16)
    else:
        source = _write_shards(tmp_path / "shards", form)
    run = tmp_path / "run"
    # The uninterrupted run: the optimizer batch of 200 on one rank (the same order and steps as on 2 ranks x 100,
    # whose equality the elastic tests hold), in this process.
    _leg(tmp_path / "straight", 1, 0, "--batch-size", 200, source=source)
    _leg(run, 2, 2, "--term-batch", 25, source=source)
    _leg(run, 1, 1, "--term-batch", 50, "--resume", source=source)
    _leg(run, 2, 0, "--term-batch", 75, "--resume", source=source)
    _leg(run, 1, 2, "--resume", source=source)
    seen = collections.Counter()
    sizes = {}
    for rank in (0, 1):
        lines = (run / f"ids_rank{rank}.txt").read_text().splitlines()
        sizes[rank] = collections.Counter(len(line.split()[2].split(",")) for line in lines)
        for line in lines:
            seen.update(int(i) for i in line.split()[2].split(","))
    assert sorted(seen) == list(range(16 * SHARD)) and set(seen.values()) == {1}, seen.most_common(3)
    # Each leg trained its part (a stop follows the signal's batch): batches 0-25 and 51-75 on 2 ranks x 100, 26-50
    # and 76-99 on one rank x 200.
    assert sizes == {0: {100: 26 + 25, 200: 25 + 24}, 1: {100: 26 + 25}}
    # The optimizer batch kept at 200 samples, in the order of the uninterrupted run: the same training.
    theta0 = {n: p.detach().to(torch.float64) for n, p in _model().named_parameters()}
    params = [
        {n: p.to(torch.float64) for n, p in torch.load(r / "params.pt").items()}
        for r in (run, tmp_path / "straight")
    ]
    assert_same_training(theta0, *params, floor=1e-9, elementwise=True)


def _model():
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    return resume_child.DropoutRegressor(dropout=0.0)


def _resumes_exactly(data_class: type, total: int, consumed: int, workers: int = 0) -> list:
    """The epoch through ``data_class``'s loader (batches of 5), and a resume past ``consumed`` samples: the rest
    of the same order."""
    whole = [x for batch in _loader(None, data_class, 5, workers) for x in _ids_of(batch)]
    state = {
        "epoch": 0,
        "batches": consumed // 5,
        "batch_size": 5,
        "samples": consumed,
        "seed": 0,
        "world_size": 1,
    }
    resumed = _loader({**state, "configured_batch_size": 5}, data_class, 5, workers)
    rest = [x for batch in resumed for x in _ids_of(batch)]
    assert sorted(whole) == list(range(total)) and rest == whole[consumed:]
    return whole


def _ids_of(batch) -> list[int]:
    return [int(i) for i in (batch["id"] if isinstance(batch, dict) else batch)]


@pytest.mark.parametrize("form", ["json", "parquet"])
def test_a_hugging_face_stream_of_local_shards_resumes_exactly(tmp_path, form):
    datasets = pytest.importorskip("datasets")
    files = []
    for shard in range(4):
        rows = datasets.Dataset.from_dict({"id": list(range(shard * 25, shard * 25 + 25))})
        path = tmp_path / f"part-{shard}.{form}"
        rows.to_json(path) if form == "json" else rows.to_parquet(path)
        files.append(str(path))
    streaming = datasets.load_dataset(form, data_files=files, streaming=True, split="train")

    class HF(GPUOptDataModule):
        def train_dataset(self):
            return ShardedStream.from_hf(streaming, shuffle_buffer=8)

    # Loader workers: a datasets.IterableDataset iterated in a worker keeps only the shards it gives that worker
    # (a one-shard read was empty in the second worker), so the adapter reads it otherwise.
    whole = _resumes_exactly(HF, 100, 45, workers=2)
    assert whole != sorted(whole)  # shards and windows shuffled


def _write_tars(folder: Path, shards: int, size: int, suffix: str = ".tar") -> list[Path]:
    """WebDataset-style tar shards: sample ``i`` is ``{i:05d}.json`` (``{"id": i}``) and ``{i:05d}.txt`` (``i``
    bytes)."""
    import io
    import json
    import tarfile

    paths = []
    for shard in range(shards):
        path = folder / f"shard-{shard:03d}{suffix}"
        with tarfile.open(path, "w:gz" if suffix.endswith("gz") else "w") as tar:
            for i in range(shard * size, shard * size + size):
                for ext, payload in (("json", json.dumps({"id": i}).encode()), ("txt", b"x" * i)):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        paths.append(path)
    return paths


class _Decode:
    """Decodes a tar sample to its id, noting each decode in a file of the process that did it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, sample: dict) -> int:
        import json
        import os

        assert len(sample["txt"]) == int(sample["__key__"])
        with open(self.folder / f"decoded-{os.getpid()}", "a") as f:
            f.write(sample["__key__"] + "\n")
        return json.loads(sample["json"])["id"]

    def keys(self) -> list[str]:
        return [key for path in self.folder.glob("decoded-*") for key in path.read_text().split()]


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_webdataset_style_tar_shards_resume_exactly_and_are_counted_from_names_only_with_workers(
    tmp_path, suffix
):
    paths = _write_tars(tmp_path, 3, 10, suffix)
    (tmp_path / "log").mkdir()
    decode = _Decode(tmp_path / "log")
    stream = ShardedStream.from_tars(paths, decode)
    assert stream.sizes() == [10, 10, 10] and decode.keys() == []  # counted from the member names

    class Tars(GPUOptDataModule):
        def train_dataset(self):
            return ShardedStream.from_tars(paths, decode, shuffle_buffer=4)

    _resumes_exactly(Tars, 30, 15, workers=2)


def test_uncompressed_tar_shards_are_decoded_once_in_an_epoch_over_all_ranks_and_workers(tmp_path):
    """Read by index, a tar sample is decoded only by the worker whose batch holds it: over 2 ranks x 2 workers, every
    sample once (read from their starts, as gzip-compressed tars are, the four workers decode about 4x as many)."""
    paths = _write_tars(tmp_path, 4, 40)
    (tmp_path / "log").mkdir()
    decode = _Decode(tmp_path / "log")

    class Tars(GPUOptDataModule):
        def train_dataset(self):
            return ShardedStream.from_tars(paths, decode, shuffle_buffer=16)

    used = [
        i
        for rank in (0, 1)
        for batch in _loader(None, Tars, 5, 2, ranks=2, rank=rank)
        for i in _ids_of(batch)
    ]
    assert sorted(used) == list(range(160))
    assert sorted(int(key) for key in decode.keys()) == list(range(160))


def _write_litdata(folder: Path, samples: int, chunk: int) -> Path:
    """A LitData dataset of records ``{"id": i}`` in chunks of ``chunk`` (what ``litdata.optimize`` writes, written in
    this process)."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(folder), chunk_size=chunk)
    for i in range(samples):
        writer[i] = {"id": i}
    writer.done()
    writer.merge(1)
    return folder


def test_a_litdata_dataset_read_by_its_chunks_resumes_exactly_and_decodes_each_sample_once(tmp_path):
    """Chunks read by index through the StreamingDataset: a resume past 95 samples with 2 loader workers goes on in
    the same order, and over 2 ranks x 2 workers each sample is read once."""
    litdata = pytest.importorskip("litdata")
    folder = _write_litdata(tmp_path / "optimized", 200, 25)

    class Counted(litdata.StreamingDataset):
        def __getitem__(self, index):
            with open(tmp_path / f"read-{os.getpid()}", "a") as f:
                f.write(f"{index}\n")
            return super().__getitem__(index)

    class Lit(GPUOptDataModule):
        def train_dataset(self):
            return ShardedStream.from_litdata(Counted(str(folder)), shuffle_buffer=16)

    whole = _resumes_exactly(Lit, 200, 95, workers=2)
    assert whole != sorted(whole)
    for path in tmp_path.glob("read-*"):
        path.unlink()
    used = [
        i for rank in (0, 1) for batch in _loader(None, Lit, 5, 2, ranks=2, rank=rank) for i in _ids_of(batch)
    ]
    main = tmp_path / f"read-{os.getpid()}"  # this process opened the index, reading sample 0
    read = [int(i) for path in tmp_path.glob("read-*") if path != main for i in path.read_text().split()]
    assert sorted(used) == list(range(200)) and sorted(read) == list(range(200))


def test_a_tar_shard_written_by_webdataset_reads_as_its_samples(tmp_path):
    webdataset = pytest.importorskip("webdataset")
    path = tmp_path / "shard-000.tar"
    with webdataset.TarWriter(str(path)) as sink:
        for i in range(7):
            sink.write({"__key__": f"sample{i:04d}", "cls": str(i).encode(), "txt": b"t" * i})
    stream = ShardedStream.from_tars([path], lambda s: (s["__key__"], int(s["cls"]), len(s["txt"])))
    assert stream.sizes() == [7]
    assert list(stream) == [(f"sample{i:04d}", i, i) for i in range(7)]
