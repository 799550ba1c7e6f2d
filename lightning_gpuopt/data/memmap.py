"""MemmapDataset: arrays written once to memory-mapped files, served without loading them into RAM."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_gpuopt._validate import choice, versioned_json

__all__ = ["MemmapDataset"]

_FORMAT = "lightning_gpuopt.memmap/1"
_MANIFEST = "memmap.json"
_CHUNK_BYTES = 64 * 2**20  # rows copied per write step: bounded memory whatever the array size
#: How samples are read: copied out of the file, or as views of the memory map.
Access = Literal["read", "mmap"]


def _as_numpy(value: Any, label: str) -> np.ndarray:
    if isinstance(value, Tensor):
        if value.dtype == torch.bfloat16:
            raise TypeError(
                f"{label} is a bfloat16 tensor, which numpy cannot store; write it as float32 "
                "(`t.float()`) or as its raw bits (`t.view(torch.int16)`) and convert after loading"
            )
        value = value.detach().cpu().numpy()
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.hasobject or array.dtype.kind in "USV":
        raise TypeError(
            f"{label} must hold numbers or booleans, got dtype {array.dtype}; encode strings as integers"
        )
    if array.ndim == 0:
        raise ValueError(f"{label} must have a sample dimension (dim 0), got a scalar")
    return array


class _ArrayFile:
    """One ``.npy`` file opened in this process for reading rows, by positioned reads or through a mapping."""

    def __init__(self, path: Path, access: str) -> None:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran_order, dtype = read_header(f)
            self.offset = f.tell()
        if fortran_order:
            raise ValueError(
                f"{str(path)!r} is stored in Fortran order; write it again with `MemmapDataset.write`"
            )
        self.path, self.shape, self.dtype = path, shape, dtype
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        if access == "mmap":
            self.array = np.load(path, mmap_mode="r")
            self.file = None
        else:
            self.array = None
            self.file = open(path, "rb", buffering=0)  # kept open for this process's reads

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """A fresh array of the given rows (ascending), read with one read per run of consecutive rows."""
        out = np.empty((len(rows), *self.shape[1:]), dtype=self.dtype)
        if self.array is not None:
            out[...] = self.array[rows]
            return out
        if self.row_bytes == 0:
            return out
        raw = out.reshape(len(rows), -1).view(np.uint8)
        start = 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1:
                end += 1
            self._read_into(
                memoryview(raw[start:end]).cast("B"), self.offset + int(rows[start]) * self.row_bytes
            )
            start = end
        return out

    def _read_into(self, view: memoryview, position: int) -> None:
        while view.nbytes:
            if hasattr(os, "preadv"):  # positioned: no shared file offset to race on
                got = os.preadv(self.file.fileno(), [view], position)
            else:  # pragma: no cover - platforms without preadv
                self.file.seek(position)
                got = self.file.readinto(view)
            if not got:
                raise EOFError(f"{str(self.path)!r} ended early; the dataset is damaged, write it again")
            view, position = view[got:], position + got


class MemmapDataset(Dataset):
    """Samples read from arrays stored once as memory-mapped ``.npy`` files; the files are never loaded whole.

    Write the arrays with :meth:`write` (positional arrays give tuple samples, like ``TensorDataset``;
    named arrays give dict samples). Each array is one ``.npy`` file, which ``np.load(file,
    mmap_mode="r")`` maps as well. Sample ``i`` is row ``i`` of every array, read into a fresh tensor:
    only the bytes asked for are read, never the file. Batched reads (``__getitems__``, which
    DataLoader uses) read a batch's rows in file order, one read per run of consecutive rows.

    ``access="read"`` (the default) reads rows with positioned reads (``os.preadv``) from the page
    cache, so a process's resident memory holds the samples it returned and nothing else, however
    much of the file it has read. ``access="mmap"`` reads through a memory mapping instead: about
    twice as fast for small warm rows, but every page touched stays mapped, so the resident set of
    each worker grows towards the file size over an epoch (shared, reclaimable page cache, but
    counted as RSS by monitors and RSS-based job limits).

    The files are opened lazily, once per process: constructing the dataset reads only the small
    manifest, and each DataLoader worker (forked or spawned) opens the files itself on first access.
    Pickling carries the path, never an open file or mapping.

    Args:
        path: the folder :meth:`write` wrote.
        transform: applied to every sample (the tuple or dict of tensors) before it is returned.
        access: ``"read"`` (positioned reads) or ``"mmap"`` (a memory mapping).

    Raises:
        FileNotFoundError: ``path`` holds no MemmapDataset (or a file of it is missing).
        ValueError: the manifest is not one this version reads, or ``access`` is unknown.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> ds = MemmapDataset.write(folder, torch.arange(12.0).reshape(6, 2), torch.arange(6))
        >>> len(ds), ds[4]
        (6, (tensor([8., 9.]), tensor(4)))
        >>> named = MemmapDataset.write(folder + "/named", image=np.zeros((3, 2, 2), np.uint8), label=[0, 1, 2])
        >>> sorted(named[2]), named[2]["label"]
        (['image', 'label'], tensor(2))
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        transform: Callable[[Any], Any] | None = None,
        access: Access = "read",
    ) -> None:
        if transform is not None and not callable(transform):
            raise TypeError(f"`transform` must be a callable(sample) or None, got {type(transform).__name__}")
        choice("access", access, Access)
        self.access = access
        self.path = Path(path)
        manifest_path = self.path / _MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"No MemmapDataset at {str(self.path)!r} (no {_MANIFEST}); create one with "
                "`MemmapDataset.write(path, *arrays)` first."
            )
        manifest = versioned_json(
            manifest_path, _FORMAT, "Write the dataset again with `MemmapDataset.write`."
        )
        self.transform = transform
        self.length = int(manifest["length"])
        self.names: list[str] | None = manifest["names"]
        self._files = [self.path / entry["file"] for entry in manifest["arrays"]]
        self.shapes = [tuple(entry["shape"]) for entry in manifest["arrays"]]
        self.dtypes = [np.dtype(entry["dtype"]) for entry in manifest["arrays"]]
        for file in self._files:
            if not file.is_file():
                raise FileNotFoundError(
                    f"MemmapDataset at {str(self.path)!r} is missing {file.name}; write it again."
                )
        self._arrays: list[_ArrayFile] | None = None
        self._pid: int | None = None

    @classmethod
    def write(
        cls,
        path: str | os.PathLike[str],
        *arrays: Any,
        overwrite: bool = False,
        transform: Callable[[Any], Any] | None = None,
        access: Literal["read", "mmap"] = "read",
        **named_arrays: Any,
    ) -> MemmapDataset:
        """Write arrays to ``path`` (a folder) as memory-mappable files and return the dataset reading them.

        Arrays are numpy arrays (memory-mapped ones too, so data larger than RAM converts chunk by
        chunk), tensors, or anything ``np.asarray`` takes, all with the same length along dim 0. The
        manifest is written last, so an interrupted write leaves no readable dataset behind.

        Args:
            path: the folder to write; created if needed.
            *arrays: arrays whose rows form tuple samples.
            overwrite: replace a dataset already at ``path``.
            transform: passed to the returned dataset.
            access: passed to the returned dataset.
            **named_arrays: arrays whose rows form dict samples (instead of ``*arrays``); any name but
                ``overwrite``, ``transform`` and ``access``.

        Raises:
            ValueError: no arrays, both positional and named ones, or different lengths.
            TypeError: an array of strings, objects or bfloat16.
            FileExistsError: a dataset exists at ``path`` and ``overwrite`` is False.
        """
        if bool(arrays) == bool(named_arrays):
            raise ValueError(
                "`MemmapDataset.write` takes either positional arrays (tuple samples) or named arrays (dict "
                f"samples), got {len(arrays)} positional and {len(named_arrays)} named"
            )
        names = list(named_arrays) if named_arrays else None
        values: Sequence[Any] = list(named_arrays.values()) if named_arrays else arrays
        labels = (
            [f"array {name!r}" for name in names] if names else [f"array {i}" for i in range(len(values))]
        )
        prepared = [_as_numpy(v, label) for v, label in zip(values, labels)]
        lengths = {len(a) for a in prepared}
        if len(lengths) != 1:
            found = ", ".join(f"{label}: {len(a)}" for label, a in zip(labels, prepared))
            raise ValueError(f"All arrays must have the same length along dim 0, got {found}")
        folder = Path(path)
        if (folder / _MANIFEST).exists():
            if not overwrite:
                raise FileExistsError(
                    f"A MemmapDataset already exists at {str(folder)!r}; pass `overwrite=True` to replace it, "
                    "or open it with `MemmapDataset(path)`."
                )
            (folder / _MANIFEST).unlink()
        folder.mkdir(parents=True, exist_ok=True)
        entries = []
        for i, array in enumerate(prepared):
            file = f"{i:03d}.npy"
            target = np.lib.format.open_memmap(folder / file, mode="w+", dtype=array.dtype, shape=array.shape)
            rows = max(1, _CHUNK_BYTES // max(1, array[:1].nbytes))
            for start in range(0, len(array), rows):
                target[start : start + rows] = array[start : start + rows]
            target.flush()
            del target
            entries.append({"file": file, "dtype": array.dtype.str, "shape": list(array.shape)})
        manifest = {"format": _FORMAT, "length": lengths.pop(), "names": names, "arrays": entries}
        partial = folder / (_MANIFEST + ".partial")
        partial.write_text(json.dumps(manifest, indent=1))
        os.replace(partial, folder / _MANIFEST)
        return cls(folder, transform=transform, access=access)

    # ------------------------------------------------------------------ reading

    @property
    def nbytes(self) -> int:
        """Bytes of array data on disk (what loading the arrays into RAM would take)."""
        return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes))

    def __len__(self) -> int:
        return self.length

    def _opened(self) -> list[_ArrayFile]:
        pid = os.getpid()
        if self._arrays is None or self._pid != pid:  # a new process (a worker) opens the files itself
            self._arrays = [_ArrayFile(file, self.access) for file in self._files]
            self._pid = pid
        return self._arrays

    def _sample(self, values: list[Tensor]) -> Any:
        sample: Any = dict(zip(self.names, values)) if self.names is not None else tuple(values)
        return self.transform(sample) if self.transform is not None else sample

    def _index(self, index: Any) -> int:
        if isinstance(index, Tensor):
            index = index.item()
        i = int(index)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"index {index} is out of range for a MemmapDataset of {self.length} samples")
        return i

    def __getitem__(self, index: int) -> Any:
        row = np.array([self._index(index)], dtype=np.int64)
        return self._sample([torch.from_numpy(array.rows(row)[0, ...]) for array in self._opened()])

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        rows = np.fromiter((self._index(i) for i in indices), dtype=np.int64, count=len(indices))
        order = np.argsort(rows, kind="stable")
        in_order = bool((order == np.arange(len(order))).all())
        columns = []
        for array in self._opened():
            block = array.rows(rows[order])  # in file order ...
            if not in_order:
                unsorted = np.empty_like(block)
                unsorted[order] = block  # ... put back in the order asked for
                block = unsorted
            columns.append(torch.from_numpy(block))
        return [self._sample([column[j] for column in columns]) for j in range(len(rows))]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = None  # never pickle a mapping: each process opens its own
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        layout = ", ".join(
            f"{name}: {dtype}{list(shape)}"
            for name, shape, dtype in zip(self.names or range(len(self.shapes)), self.shapes, self.dtypes)
        )
        return f"MemmapDataset({str(self.path)!r}, {self.length} samples; {layout})"
