"""Walk a batch: its parts, its leaves, its tensors, its samples, and a copy with the leaves replaced.

The one walker of the pack: micro-batch splitting (:mod:`lightning_gpuopt.batch_split`), device
prefetch, torch.compile's dynamic batch dimension, the peak prediction and the activation estimate
all read a batch through it, so that they agree on what a batch is made of. Containers are
mappings, lists and tuples (namedtuples too) and dataclass instances; everything else is a leaf.

It lives in ``memory/`` because the memory layer needs it (the prediction's batch size and input
tensors) and may import nothing above itself; every other layer may import ``memory/``. Not used:
``torch.utils._pytree`` treats a dataclass as one leaf and is private; ``lightning_utilities``'
``apply_to_collection`` walks dataclasses but gives no path to name a part in an error, and
``memory/`` runs without Lightning's packages.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "BatchSizeError",
    "batch_nbytes",
    "is_dataclass_instance",
    "is_namedtuple",
    "is_per_sample_list",
    "leaves",
    "parts",
    "rebuild",
    "sample_count",
    "samples_in",
    "tensors",
]

_SCALARS = (str, bytes, int, float, complex, bool, type(None))


class BatchSizeError(ValueError):
    """The parts of a batch disagree on its number of samples, or none has a sample dimension."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"Cannot tell the number of samples of the batch: {reason}")
        self.reason = reason


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def is_per_sample_list(obj: Any) -> bool:
    """A list or tuple of plain values (strings, ids, numbers): one value per sample, as ``default_collate``
    leaves strings. A list of tensors or containers is a structure, walked into instead."""
    return (
        isinstance(obj, (list, tuple))
        and not is_namedtuple(obj)
        and len(obj) > 0
        and all(isinstance(v, _SCALARS) for v in obj)
    )


def parts(obj: Any) -> list[tuple[str, Any]] | None:
    """The parts of a container, each with the step of its path (``['x']``, ``.field``, ``[0]``); ``None``: a leaf.

    Example:
        >>> parts({"x": 1, "y": (2, 3)})
        [("['x']", 1), ("['y']", (2, 3))]
        >>> parts(torch.zeros(2)) is None
        True
    """
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, Mapping):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if is_namedtuple(obj):
        return [(f".{name}", getattr(obj, name)) for name in obj._fields]
    if is_dataclass_instance(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    return None


def leaves(
    obj: Any, stop: Callable[[Any], bool] | None = None, path: str = "batch"
) -> Iterator[tuple[str, Any]]:
    """Every leaf of ``obj`` with its path; ``stop(x)`` true makes ``x`` a leaf (e.g. a per-sample list).

    Example:
        >>> [p for p, _ in leaves({"x": torch.zeros(2), "ids": [0, 1]})]
        ["batch['x']", "batch['ids'][0]", "batch['ids'][1]"]
    """
    children = None if stop is not None and stop(obj) else parts(obj)
    if children is None:
        yield path, obj
        return
    for step, child in children:
        yield from leaves(child, stop, path + step)


def batch_nbytes(batch: Any, device_type: str | None = None) -> int:
    """Bytes held by the tensors of a batch (those on ``device_type`` only, when given).

    Example:
        >>> batch_nbytes({"x": torch.zeros(4, 3), "y": [torch.zeros(4, dtype=torch.int64)], "id": "a"})
        80
    """
    return sum(
        t.nbytes
        for _, t in leaves(batch)
        if isinstance(t, torch.Tensor) and (device_type is None or t.device.type == device_type)
    )


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj``, in order.

    Example:
        >>> len(tensors({"x": torch.zeros(2), "pair": (torch.zeros(1), "a")}))
        2
    """
    return [leaf for _, leaf in leaves(obj) if isinstance(leaf, torch.Tensor)]


def rebuild(obj: Any, fn: Callable[[Any], Any], stop: Callable[[Any], bool] | None = None) -> Any:
    """A copy of ``obj``'s structure (the same container types) with every leaf ``x`` replaced by ``fn(x)``.

    A mapping type that cannot be built from a dict becomes a dict; a dataclass is copied and its fields
    set (frozen ones too).

    Example:
        >>> rebuild({"x": torch.ones(2), "n": 3}, lambda v: v * 2 if isinstance(v, torch.Tensor) else v)
        {'x': tensor([2., 2.]), 'n': 3}
    """
    if (stop is not None and stop(obj)) or isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {key: rebuild(value, fn, stop) for key, value in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:  # a mapping type without a dict constructor
            return items
    if is_namedtuple(obj):
        return type(obj)(*(rebuild(v, fn, stop) for v in obj))
    if is_dataclass_instance(obj):
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            # object.__setattr__ also works for frozen dataclasses.
            object.__setattr__(new, field.name, rebuild(getattr(obj, field.name), fn, stop))
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebuild(v, fn, stop) for v in obj)
    return fn(obj)


def _sample_sizes(batch: Any) -> tuple[dict[int, str], dict[int, str]]:
    """The leading dimensions of the batch's tensors and the lengths of its per-sample lists, each with the
    path of the first part that has it."""
    tensor_sizes: dict[int, str] = {}
    list_sizes: dict[int, str] = {}
    for where, leaf in leaves(batch, stop=is_per_sample_list):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() > 0:
                tensor_sizes.setdefault(leaf.shape[0], where)
        elif is_per_sample_list(leaf):
            list_sizes.setdefault(len(leaf), where)
    return tensor_sizes, list_sizes


def sample_count(batch: Any) -> int:
    """Number of samples in ``batch``: the common leading dimension of its tensors.

    Per-sample lists of non-tensor values count when the batch holds no tensor.

    Raises:
        BatchSizeError: the parts disagree, or nothing in the batch has a sample dimension.

    Example:
        >>> sample_count({"x": torch.zeros(8, 3), "y": torch.zeros(8), "names": ["a"] * 8})
        8
    """
    tensor_sizes, list_sizes = _sample_sizes(batch)
    if len(tensor_sizes) > 1:
        found = ", ".join(f"{where} has {n}" for n, where in sorted(tensor_sizes.items()))
        raise BatchSizeError(f"tensors disagree on the number of samples ({found})")
    if tensor_sizes:
        (n,) = tensor_sizes
        bad = {m: where for m, where in list_sizes.items() if m != n}
        if bad:
            found = ", ".join(f"{where} has {m} items" for m, where in sorted(bad.items()))
            raise BatchSizeError(f"tensors have {n} samples but {found}")
        return n
    if len(list_sizes) == 1:
        (n,) = list_sizes
        return n
    if list_sizes:
        found = ", ".join(f"{where} has {n}" for n, where in sorted(list_sizes.items()))
        raise BatchSizeError(f"per-sample lists disagree on the number of samples ({found})")
    raise BatchSizeError(f"found no tensor with a sample dimension in a batch of type {type(batch).__name__}")


def samples_in(batch: Any) -> int:
    """:func:`sample_count`, never raising: where the parts disagree, the first tensor's leading dimension;
    where nothing has a sample dimension, 1.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Batch:
        ...     x: torch.Tensor
        ...     y: torch.Tensor
        >>> samples_in(Batch(torch.zeros(16, 3), torch.zeros(16))), samples_in("text")
        (16, 1)
    """
    try:
        return sample_count(batch)
    except BatchSizeError:
        return next((int(t.shape[0]) for t in tensors(batch) if t.dim() > 0), 1)
