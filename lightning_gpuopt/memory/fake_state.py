"""Fake copies of the model's state and the batch, for a trace that allocates nothing, and the precision's dtypes."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from lightning_gpuopt._compat import module_tables
from lightning_gpuopt.memory.counter import storage_key
from lightning_gpuopt.memory.walk import rebuild

__all__ = [
    "FakeState",
    "fake_batch",
    "precision_dtypes",
]


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def precision_dtypes(precision: str | int | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(dtype weights are converted to, autocast dtype) for a Lightning precision."""
    p = str(precision if precision is not None else "32-true")
    if p in ("64", "64-true", "double"):
        return torch.float64, None
    if p in ("bf16-true", "bf16"):
        return torch.bfloat16, None
    if p in ("16-true", "16", "half"):
        return torch.float16, None
    if p in ("bf16-mixed",):
        return None, torch.bfloat16
    if p in ("16-mixed",):
        return None, torch.float16
    if p in ("32-true", "32", "32-bit"):
        return None, None
    raise ValueError(
        f"`precision` must be a Lightning precision ('32-true', 'bf16-mixed', '16-mixed', 'bf16-true', "
        f"'16-true', '64-true'), got {precision!r}"
    )


def _fake_like(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    # Inside the fake mode: a fake tensor of the same shape and strides, no memory behind it.
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype or t.dtype, device=device)


class FakeState:
    """Swaps a module's parameters, buffers and plain tensor attributes for fake ones, and back.

    Shared tensors stay shared: an attribute that shares a parameter's or buffer's storage becomes a view
    of its fake, attributes sharing a storage become views of one fake of that storage (counted once, as
    buffers). What the traced step added or changed is put back as it was: attributes, the items of a
    list or dict attribute, and parameters, buffers or submodules registered during the trace (a cache
    made on the first forward). A fake still reachable after that is warned about.
    """

    def __init__(self, model: nn.Module, device: torch.device, weight_dtype: torch.dtype | None) -> None:
        self.model = model
        self.device = device
        self.weight_dtype = weight_dtype
        self.undo: list[tuple[dict, str, Any]] = []
        self.mapping: dict[int, torch.Tensor] = {}
        self.attributes: list[torch.Tensor] = []  # fakes of the storages of plain tensor attributes
        self._before: list[tuple[nn.Module, dict[str, Any], dict[str, Any], dict[str, set[str]]]] = []

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.weight_dtype if self.weight_dtype is not None and t.dtype in _FLOATS else t.dtype

    def swap(self) -> None:
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # real storage -> (real, its fake)
        modules = list(self.model.modules())
        for module in modules:
            tables = module_tables(module)
            for table, is_param in ((tables["parameters"], True), (tables["buffers"], False)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    new = self.mapping.get(id(t))
                    if new is None:
                        fake = _fake_like(t, self.device, self._dtype(t))
                        new = nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                        self.mapping[id(t)] = new
                        found = storage_key(t)
                        if found is not None:
                            shared.setdefault(found[1], (t, new))
                    self.undo.append((table, name, t))
                    table[name] = new
        bases: dict[int, torch.Tensor] = {}
        for module in modules:
            contents = {
                k: (list(v) if isinstance(v, list) else dict(v))
                for k, v in module.__dict__.items()
                if type(v) in (list, dict)
            }
            tables = {kind: set(table) for kind, table in module_tables(module).items()}
            self._before.append((module, dict(module.__dict__), contents, tables))
            for name, t in list(module.__dict__.items()):
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                    module.__dict__[name] = self._attribute(t, shared, bases)

    def _attribute(
        self,
        t: torch.Tensor,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
        bases: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        """A fake for a plain tensor attribute: a view of the fake it shares a storage with."""
        found = storage_key(t)
        key = found[1] if found is not None else None
        if key in shared:  # a parameter's or buffer's storage (spectral_norm: weight = weight_orig.data)
            real, fake = shared[key]
            if fake.dtype == t.dtype:
                with contextlib.suppress(RuntimeError):
                    offset = t.storage_offset() - real.storage_offset()
                    return fake.detach().as_strided(
                        tuple(t.shape), tuple(t.stride()), fake.storage_offset() + offset
                    )
            return _fake_like(t, self.device, t.dtype)  # not counted: it is the parameter's memory
        base = bases.get(key) if key is not None else None
        if base is None:
            numel = found[0].nbytes() // t.element_size() if found is not None else t.numel()
            base = torch.empty(max(numel, 1), dtype=t.dtype, device=self.device)
            self.attributes.append(base)
            if key is not None:
                bases[key] = base
        try:
            return base.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())
        except RuntimeError:
            return _fake_like(t, self.device, t.dtype)

    def restore(self) -> None:
        for table, name, t in reversed(self.undo):
            table[name] = t
        self.undo = []
        left = []
        for module, before, contents, tables in reversed(self._before):
            for kind, names in tables.items():  # registered during the trace: a cache, removed
                table = module_tables(module)[kind]
                for name in [k for k in table if k not in names]:
                    del table[name]
            for name in list(module.__dict__):
                value = module.__dict__[name]
                if not _holds_fake(value):
                    continue
                if name not in before:
                    del module.__dict__[name]
                elif value is not before[name]:
                    module.__dict__[name] = before[name]
                elif name in contents:  # a list or dict the step changed in place
                    old = contents[name]
                    if isinstance(value, list):
                        value[:] = old
                    else:
                        value.clear()
                        value.update(old)
                if _holds_fake(module.__dict__.get(name)):
                    left.append(f"{type(module).__name__}.{name}")
        self._before = []
        if left:
            import warnings

            warnings.warn(
                f"predict_peak could not put back {', '.join(sorted(set(left)))}: the traced step changed a "
                "container nested in it, which still holds a fake tensor. Rebuild the model (or that "
                "attribute) before training it.",
                stacklevel=3,
            )


def _holds_fake(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` is a fake tensor, or a list, tuple or dict holding one (two levels deep)."""
    if isinstance(value, torch.Tensor):
        return getattr(value, "fake_mode", None) is not None
    if depth and isinstance(value, (list, tuple)):
        return any(_holds_fake(v, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return any(_holds_fake(v, depth - 1) for v in value.values())
    return False


def fake_batch(batch: Any, device: torch.device, input_dtype: torch.dtype | None) -> Any:
    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dtype = input_dtype if input_dtype is not None and x.dtype in _FLOATS else x.dtype
        return torch.empty(tuple(x.shape), dtype=dtype, device=device)

    return rebuild(batch, convert)
