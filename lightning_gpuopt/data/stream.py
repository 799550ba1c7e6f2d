"""ShardedStream: a training set read shard by shard, in one canonical order per (seed, epoch), resumable anywhere.

The order of an epoch is the shards in an order drawn from ``(seed, epoch)``, their samples one after another,
shuffled within consecutive windows of ``shuffle_buffer`` samples (each window's permutation drawn from
``(seed, epoch, window)``). Sample ``p`` of that order is thus known without reading anything before its window:
:class:`GPUOptDataModule` addresses the stream by position, as it addresses a map-style dataset by index, with the
same :class:`~lightning_gpuopt.data.resume.ResumableSampler`. The ranks' ``b``-th batches together are one window
of the order whatever the number of ranks and workers, a checkpoint holds the samples its optimizer steps
consumed, and a resume on any number of ranks and workers deals the rest.

A process (a loader worker, or the main process without workers) reads a shard from its start and keeps one
window of decoded samples. Reaching a window, it skips the shards before it without opening them (their sizes
are known) and decodes from the start of the window's first shard: at most one shard before the window, plus the
window itself. A shard that ``read_shard`` returns as a sequence (``__len__`` and ``__getitem__``: a list, a Hugging
Face ``Dataset``) is read by index instead, only the samples asked for.
"""

from __future__ import annotations

import bisect
import itertools
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_gpuopt.data.resume import SeededSamples, sample_seed, seed_all

__all__ = ["ShardedStream", "StreamPositions", "restart_line"]

#: The most shards a process keeps open (those of the window it reads, when a window spans many small shards).
_OPEN_SHARDS = 64


class ShardedStream(IterableDataset):
    """A training stream of shards: ``read_shard(shard)`` gives one shard's samples, in order.

    Return it from :meth:`GPUOptDataModule.train_dataset`: the datamodule reads it by position, resumes it exactly
    mid-epoch, on any number of ranks and workers (docs/resume.md, "Streams"). Iterated directly (outside the
    datamodule), it yields epoch 0's order, every n-th sample of it in each of a loader's n workers.

    Args:
        shards: the shards (paths, URLs, ids: anything ``read_shard`` takes).
        read_shard: a function from one shard to an iterable of its samples (decoded lazily: a generator), or to a
            sequence of them.
        shuffle_buffer: samples are shuffled within consecutive windows of this many (0 or 1: in shard order).
            Each window's order comes from (seed, epoch, window), so a resume rebuilds it exactly.
        seed: the order's seed; ``None``: the run's global seed (``seed_everything``'s), as the datamodule's samplers.
        shard_sizes: each shard's number of samples, when known (an index file); else counted once at setup (by
            ``len`` of what ``read_shard`` returns where it has one, by reading the shard otherwise) and kept in the
            checkpoint.
        shuffle_shards: draw the shards' order from (seed, epoch); ``False``: the order given.

    Example:
        >>> stream = ShardedStream(["a", "b"], lambda s: (f"{s}{i}" for i in range(3)), shuffle_shards=False)
        >>> list(stream)
        ['a0', 'a1', 'a2', 'b0', 'b1', 'b2']
        >>> stream.sizes()
        [3, 3]
    """

    def __init__(
        self,
        shards: Sequence[Any],
        read_shard: Callable[[Any], Iterable[Any]],
        shuffle_buffer: int = 0,
        seed: int | None = None,
        shard_sizes: Sequence[int] | None = None,
        shuffle_shards: bool = True,
    ) -> None:
        shards = list(shards)
        if not shards:
            raise ValueError("ShardedStream needs at least one shard, got an empty list")
        if not callable(read_shard):
            raise TypeError(f"`read_shard` must be a function of one shard, got {type(read_shard).__name__}")
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise ValueError(f"`shuffle_buffer` must be an int >= 0 (samples), got {shuffle_buffer!r}")
        if shard_sizes is not None and (
            len(shard_sizes) != len(shards) or any(int(n) < 0 for n in shard_sizes)
        ):
            raise ValueError(
                f"`shard_sizes` must give one count >= 0 for each of the {len(shards)} shards, got {list(shard_sizes)}"
            )
        self.shards = shards
        self.read_shard = read_shard
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.shuffle_shards = shuffle_shards
        self._sizes = [int(n) for n in shard_sizes] if shard_sizes is not None else None

    @classmethod
    def from_hf(cls, dataset: Any, shuffle_buffer: int = 0, seed: int | None = None) -> ShardedStream:
        """A Hugging Face ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``) read by its shards
        (``dataset.shard(num_shards, index)``: one data file each for JSON lines, Parquet, CSV...), in the stream's
        order for (seed, epoch). A ``shuffle`` of the dataset's own still acts within each shard (seeded: the order
        repeats, and a resume stays exact); leave it out, and set ``shuffle_buffer`` here.

        Example:
            >>> import datasets  # doctest: +SKIP
            >>> ShardedStream.from_hf(datasets.load_dataset("json", data_files=files, streaming=True, split="train"))  # doctest: +SKIP
        """
        shards = int(getattr(dataset, "num_shards", 0) or 0)
        if shards < 1 or not callable(getattr(dataset, "shard", None)):
            raise TypeError(
                f"ShardedStream.from_hf takes a datasets.IterableDataset with shards (num_shards >= 1, shard()), got "
                f"{type(dataset).__name__}"
            )
        return cls(list(range(shards)), _HFShard(dataset, shards), shuffle_buffer=shuffle_buffer, seed=seed)

    @classmethod
    def from_tars(
        cls,
        paths: Sequence[str | os.PathLike],
        decode: Callable[[dict[str, Any]], Any] | None = None,
        **kwargs: Any,
    ) -> ShardedStream:
        """WebDataset-style tar shards: each sample is the files of one key (``0001.jpg``, ``0001.json``), given to
        ``decode`` as ``{"__key__": "0001", "jpg": bytes, "json": bytes}`` (that dict itself without ``decode``).
        Counting a shard reads its file names only. Other arguments as :class:`ShardedStream`'s.

        Example:
            >>> ShardedStream.from_tars(["data/shard-000.tar", "data/shard-001.tar"], decode=my_decode)  # doctest: +SKIP
        """
        return cls([os.fspath(p) for p in paths], _TarShard(decode), **kwargs)

    @classmethod
    def from_litdata(cls, dataset: Any, shuffle_buffer: int = 0, seed: int | None = None) -> ShardedStream:
        """A LitData ``StreamingDataset`` (``litdata.optimize``'s chunks) read by its chunks, each by index through the
        dataset itself (its download, cache and decoding): a process reads only the samples of its own batches, and
        the chunks a window spans are kept open. Its own ``shuffle`` is not used: set ``shuffle_buffer`` here.

        LitData's own ``StreamingDataLoader`` state resumes exactly at the same ranks, workers and batch size; under
        Lightning on another topology its resumed epoch lost and repeated samples (docs/resume.md, "Streams").

        Example:
            >>> import litdata  # doctest: +SKIP
            >>> ShardedStream.from_litdata(litdata.StreamingDataset("data/optimized"), shuffle_buffer=512)  # doctest: +SKIP
        """
        if not callable(getattr(dataset, "__getitem__", None)) or not hasattr(dataset, "cache"):
            raise TypeError(
                f"ShardedStream.from_litdata takes a litdata.StreamingDataset, got {type(dataset).__name__}"
            )
        if dataset.cache is None:
            dataset[0]  # opens its index
        intervals = [  # LitData's Interval(chunk_start, roi_start_idx, roi_end_idx, chunk_end)
            (int(getattr(i, "roi_start_idx", i[1])), int(getattr(i, "roi_end_idx", i[2])))
            for i in dataset.cache.get_chunk_intervals()
        ]
        return cls(
            intervals,
            _LitDataChunk(dataset),
            shuffle_buffer=shuffle_buffer,
            seed=seed,
            shard_sizes=[end - start for start, end in intervals],
        )

    def sizes(self) -> list[int]:
        """Each shard's number of samples (counted once, the first time it is asked)."""
        if self._sizes is None:
            count = getattr(self.read_shard, "count", None)
            self._sizes = [
                int(count(shard)) if callable(count) else _count(self.read_shard(shard))
                for shard in self.shards
            ]
        return list(self._sizes)

    def set_sizes(self, sizes: Sequence[int]) -> None:
        """Take the shards' sizes as known (a checkpoint's), instead of counting them."""
        if len(sizes) != len(self.shards):
            raise ValueError(
                f"the checkpoint gives sizes of {len(sizes)} shards, this stream has {len(self.shards)}: the shard "
                "list changed since it was written"
            )
        self._sizes = [int(n) for n in sizes]

    def __len__(self) -> int:
        return sum(self.sizes())

    def __iter__(self) -> Iterator[Any]:
        # Through SeededSamples: each sample under its own seed, and the caller's RNG streams left as they were.
        positions = SeededSamples(StreamPositions(self, seed=self.seed or 0), seed=self.seed or 0)
        info = torch.utils.data.get_worker_info()
        indices = range(len(self)) if info is None else range(info.id, len(self), info.num_workers)
        return (positions[(0, p)] for p in indices)


class _HFShard:
    """Shard ``i`` of a Hugging Face ``IterableDataset``, as ``read_shard``: its rows, in order.

    Read through ``iter(batch_size=...)``: iterated as an iterable, a ``datasets.IterableDataset`` in a loader worker
    keeps only the shards it assigns to that worker (``_iter_pytorch``), and a one-shard dataset is then empty in
    every worker but one.
    """

    def __init__(self, dataset: Any, shards: int, rows: int = 256) -> None:
        self.dataset, self.shards, self.rows = dataset, shards, rows

    def __call__(self, index: int) -> Iterator[Any]:
        shard = self.dataset.shard(num_shards=self.shards, index=index, contiguous=True)
        for batch in shard.iter(batch_size=self.rows):
            columns = list(batch)
            for values in zip(*(batch[c] for c in columns)):
                yield dict(zip(columns, values))


class _LitDataChunk:
    """One chunk of a LitData ``StreamingDataset`` (its global indices ``[start, end)``), as ``read_shard``: a sequence
    read through the dataset."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, interval: tuple[int, int]) -> _Indexed:
        return _Indexed(self.dataset, *interval)


class _Indexed:
    """``dataset[start:end]`` as a sequence read item by item."""

    def __init__(self, dataset: Any, start: int, end: int) -> None:
        self.dataset, self.start, self.end = dataset, start, end

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.end - self.start:
            raise IndexError(index)
        return self.dataset[self.start + index]


class _TarShard:
    """WebDataset-style tar shards, as ``read_shard``: a shard's samples are its members grouped by key, in order.

    An uncompressed tar is read by index (its headers read once, each sample's members when it is asked), so that a
    process decodes only the samples it is given; a compressed one (``.tar.gz``), which cannot be read from the
    middle, from its start.
    """

    def __init__(self, decode: Callable[[dict[str, Any]], Any] | None) -> None:
        self.decode = decode

    def __call__(self, path: str) -> _TarSamples | Iterator[Any]:
        if _compressed(path):
            return self._in_order(path)
        return _TarSamples(path, self.decode)

    def _in_order(self, path: str) -> Iterator[Any]:
        """Each file read as the tar is read (a compressed file goes back only by reading it again)."""
        with tarfile.open(path) as tar:
            for key, files in _grouped(tar, read=lambda member: _bytes(tar, member)):
                yield _decoded(self.decode, key, files)

    @staticmethod
    def count(path: str) -> int:
        """The samples in one tar file, from its member names (nothing read or decoded)."""
        with tarfile.open(path) as tar:
            return sum(1 for _ in _grouped(tar))


#: The first bytes of the compressed files ``tarfile`` opens: gzip, bzip2, xz, zstandard.
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")


def _compressed(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(6).startswith(_COMPRESSED)


class _TarSamples:
    """The samples of one uncompressed tar file, by index: its member headers are read when it is opened, a
    sample's files when it is asked."""

    def __init__(self, path: str, decode: Callable[[dict[str, Any]], Any] | None) -> None:
        self.decode = decode
        self._tar = tarfile.open(path, mode="r:")
        try:
            self._samples = list(_grouped(self._tar))
        except BaseException:
            self._tar.close()
            raise

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> Any:
        key, members = self._samples[index]
        return _decoded(self.decode, key, [(ext, _bytes(self._tar, m)) for ext, m in members])

    def close(self) -> None:
        self._tar.close()

    def __del__(self) -> None:
        tar = getattr(self, "_tar", None)
        if tar is not None:
            tar.close()


def _grouped(
    tar: tarfile.TarFile, read: Callable[[tarfile.TarInfo], Any] = lambda member: member
) -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """A tar file's files grouped by WebDataset key, in order: ``(key, [(extension, read(member)), ...])``, each
    member read as the tar reaches it."""
    key, members = None, []
    for member in tar:
        if not member.isfile():
            continue
        name, ext = _key_and_extension(member.name)
        if members and name != key:
            yield key, members  # type: ignore[misc]
            members = []
        key = name
        members.append((ext, read(member)))
    if members:
        yield key, members  # type: ignore[misc]


def _bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    return handle.read() if handle is not None else b""


def _decoded(decode: Callable[[dict[str, Any]], Any] | None, key: str, files: list[tuple[str, bytes]]) -> Any:
    sample = {"__key__": key, **dict(files)}
    return decode(sample) if decode is not None else sample


def _key_and_extension(name: str) -> tuple[str, str]:
    """``"dir/0001.seg.json"`` -> ``("dir/0001", "seg.json")``: WebDataset's key is the name up to the first dot of
    its last part."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


def _count(samples: Iterable[Any]) -> int:
    if hasattr(samples, "__len__"):
        return len(samples)  # type: ignore[arg-type]
    return sum(1 for _ in samples)


class _Reader:
    """One process's place in one shard: the shard read by index, or its iterator and the samples it gave so far."""

    def __init__(self, samples: Iterable[Any]) -> None:
        self.sequence = samples if hasattr(samples, "__len__") and hasattr(samples, "__getitem__") else None
        self.iterator = iter(samples) if self.sequence is None else None
        self.offset = 0  # the next sample the iterator gives


class StreamPositions:
    """A :class:`ShardedStream` addressed by position: item ``(epoch, p)`` is sample ``p`` of that epoch's order.

    What the datamodule's training loader reads (through
    :class:`~lightning_gpuopt.data.resume.SeededSamples`). A shard that ``read_shard`` returns as a sequence is read
    by index, the sample asked for only; from one returned as an iterator, each process keeps one window of decoded
    samples. :attr:`decoded` counts the samples this process took from what ``read_shard`` returned.

    Example:
        >>> stream = ShardedStream(["a", "b"], lambda s: [f"{s}{i}" for i in range(3)], shuffle_shards=False)
        >>> view = StreamPositions(stream, seed=0)
        >>> len(view), view[(0, 4)], view.decoded
        (6, 'b1', 1)
    """

    keyed_by_epoch = True

    def __init__(self, stream: ShardedStream, seed: int, shuffle: bool = True) -> None:
        self.stream = stream
        self.seed = seed
        self.shuffle = shuffle
        self.decoded = 0
        self._orders: dict[int, tuple[list[int], list[int]]] = {}
        #: (epoch, window, its samples in input order, their order in the epoch): shards read as iterators
        self._window: tuple[int, int, list[Any], list[int]] | None = None
        self._drawn: tuple[int, int, list[int]] | None = None  # (epoch, window, its order)
        self._readers: dict[tuple[int, int], _Reader] = {}  # (epoch, ordinal) -> reader, the most recent last
        self._window_shards = (-1, 0, -1)  # (epoch, first, last): the shards of the window read last

    @classmethod
    def of(
        cls, stream: ShardedStream, run_seed: int, shuffle: bool = True, sizes: Sequence[int] | None = None
    ) -> StreamPositions:
        """``stream`` read by position under its own seed, else ``run_seed``; ``sizes``: its shards' sizes as known
        (a checkpoint's), instead of counting them."""
        if sizes is not None:
            stream.set_sizes(sizes)
        return cls(stream, seed=stream.seed if stream.seed is not None else run_seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.stream)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, p = key
        size = max(1, self.stream.shuffle_buffer)
        window, at = divmod(int(p), size)
        if self._window is not None and self._window[:2] == (epoch, window):
            return self._window[2][self._window[3][at]]
        order = self._permutation(epoch, window)
        raw = window * size + order[at]  # the sample's place in the shards' order
        ordinal, offset = self._locate(epoch, raw)
        reader = self._reader_at(epoch, ordinal, offset)
        if reader.sequence is not None:  # read by index: only this sample
            self.decoded += 1
            seed_all(sample_seed(self.seed, epoch, raw))
            return reader.sequence[offset]
        samples = self._read_window(epoch, window * size, size)
        self._window = (epoch, window, samples, order)
        return samples[order[at]]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_readers": {}}  # a worker opens its own shards

    def _permutation(self, epoch: int, window: int) -> list[int]:
        """The order of the epoch's ``window``-th window (drawn once, kept until another window is asked); the
        shards it spans are noted, to keep them open."""
        if self._drawn is None or self._drawn[:2] != (epoch, window):
            size = max(1, self.stream.shuffle_buffer)
            n = min(size, self._order(epoch)[1][-1] - window * size)
            first, last = self._locate(epoch, window * size)[0], self._locate(epoch, window * size + n - 1)[0]
            self._window_shards = (epoch, first, last)
            if not self.shuffle or self.stream.shuffle_buffer <= 1:
                order = list(range(n))
            else:
                generator = torch.Generator().manual_seed(sample_seed(self.seed, epoch, window))
                order = torch.randperm(n, generator=generator).tolist()
            self._drawn = (epoch, window, order)
        return self._drawn[2]

    def _locate(self, epoch: int, position: int) -> tuple[int, int]:
        """Which of the epoch's shards (its ordinal in the epoch's order) holds input position ``position``, and
        where in it."""
        starts = self._order(epoch)[1]
        ordinal = bisect.bisect_right(starts, position) - 1
        return ordinal, position - starts[ordinal]

    def _order(self, epoch: int) -> tuple[list[int], list[int]]:
        """The epoch's shard order (indices into the stream's shards) and the positions where each shard starts."""
        if epoch not in self._orders:
            shards = len(self.stream.shards)
            if self.shuffle and self.stream.shuffle_shards:
                generator = torch.Generator().manual_seed(sample_seed(self.seed, epoch, -1))
                order = torch.randperm(shards, generator=generator).tolist()
            else:
                order = list(range(shards))
            sizes = self.stream.sizes()
            starts = [0, *itertools.accumulate(sizes[i] for i in order)]
            self._orders = {epoch: (order, starts)}  # one epoch at a time
        return self._orders[epoch]

    def _read_window(self, epoch: int, start: int, size: int) -> list[Any]:
        starts = self._order(epoch)[1]
        end = min(start + size, starts[-1])
        samples = []
        position = start
        while position < end:
            ordinal, offset = self._locate(epoch, position)
            take = min(end, starts[ordinal + 1]) - position
            samples += self._read(epoch, ordinal, offset, take)
            position += take
        return samples

    def _reader_at(self, epoch: int, ordinal: int, offset: int) -> _Reader:
        """A reader of the epoch's ``ordinal``-th shard that can give sample ``offset``: an open one, else the shard
        opened again. The readers of every shard the current window spans stay open (at most :data:`_OPEN_SHARDS`)."""
        key = (epoch, ordinal)
        reader = self._readers.pop(key, None)
        if reader is None or (reader.sequence is None and reader.offset > offset):
            shard = self._order(epoch)[0][ordinal]
            # What opening it draws (a list built at once): the same at every opening.
            seed_all(sample_seed(self.seed, epoch, -2 - ordinal))
            reader = _Reader(self.stream.read_shard(self.stream.shards[shard]))
            if reader.sequence is not None and len(reader.sequence) != self.stream.sizes()[shard]:  # type: ignore[arg-type]
                raise ValueError(
                    f"shard {self.stream.shards[shard]!r} has {len(reader.sequence)} samples, its size says "  # type: ignore[arg-type]
                    f"{self.stream.sizes()[shard]}: pass shard_sizes that match what read_shard gives"
                )
        self._readers[key] = reader  # the most recent last
        epoch_now, first, last = self._window_shards
        in_window = last - first + 1 if epoch_now == epoch else 0
        while len(self._readers) > min(_OPEN_SHARDS, max(2, in_window)):
            # The least recently used of the shards outside the window, else of all.
            outside = (k for k in self._readers if k[0] != epoch_now or not first <= k[1] <= last)
            _close(self._readers.pop(next(outside, next(iter(self._readers)))))
        return reader

    def _read(self, epoch: int, ordinal: int, offset: int, take: int) -> list[Any]:
        """``take`` samples of the epoch's ``ordinal``-th shard from ``offset``: by index from a sequence, else from
        the shard's iterator (opened again when it is past ``offset``), decoding what lies before. Each sample is
        decoded under the RNG seed of its place in the shards' order, so that random augmentation in ``read_shard``
        draws the same whichever process decodes it, and when."""
        reader = self._reader_at(epoch, ordinal, offset)
        start = self._order(epoch)[1][ordinal]
        out = []
        if reader.sequence is not None:
            for i in range(offset, offset + take):
                self.decoded += 1
                seed_all(sample_seed(self.seed, epoch, start + i))
                out.append(reader.sequence[i])
            return out
        assert reader.iterator is not None
        while reader.offset < offset + take:
            seed_all(sample_seed(self.seed, epoch, start + reader.offset))
            try:
                sample = next(reader.iterator)
            except BaseException as err:
                # A generator that raised is over: the shard is opened again for its next sample.
                _close(self._readers.pop((epoch, ordinal)))
                if not isinstance(err, StopIteration):
                    raise
                shard = self._order(epoch)[0][ordinal]
                raise ValueError(
                    f"shard {self.stream.shards[shard]!r} gave {reader.offset} samples, its size says "
                    f"{self.stream.sizes()[shard]}: pass shard_sizes that match what read_shard gives"
                ) from None
            self.decoded += 1
            if reader.offset >= offset:
                out.append(sample)
            reader.offset += 1
        return out


def _close(reader: _Reader) -> None:
    close = getattr(reader.sequence if reader.sequence is not None else reader.iterator, "close", None)
    if callable(close):
        close()


def restart_line(name: str, resumed: dict[str, Any] | None, batch_size: int, world: int) -> str:
    """What :class:`GPUOptDataModule` says of a training ``IterableDataset`` it cannot resume (any but a
    :class:`ShardedStream`): on a resume after some of its batches (``resumed``: the checkpoint's batches, batch size
    and ranks), how many samples are trained twice; otherwise what a mid-epoch resume would do.

    Example:
        >>> restart_line("Shards", {"batches": 20, "batch_size": 4, "world_size": 1}, 4, 1).endswith(
        ...     "the 80 sample(s) of those batches are trained on twice."
        ... )
        True
    """
    if resumed and int(resumed.get("batches", 0)) > 0:
        batches = int(resumed["batches"])
        samples = batches * int(resumed.get("batch_size", batch_size)) * int(resumed.get("world_size", world))
        return (
            f"GPUOptDataModule: resuming after {batches} training batch(es) of an epoch of {name}, an "
            f"IterableDataset: the epoch starts again from its beginning, and the {samples} sample(s) of those "
            "batches are trained on twice."
        )
    return (
        f"GPUOptDataModule: the training dataset {name} is an IterableDataset, whose place the training loader does "
        "not keep: a resume from a checkpoint taken mid-epoch starts that epoch again from its beginning (the "
        "samples read before it are trained on twice). Read its shards through lightning_gpuopt.data.ShardedStream "
        "(from_hf for Hugging Face datasets, from_litdata for LitData), or use a map-style dataset: both resume exactly."
    )
