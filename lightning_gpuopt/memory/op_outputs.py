"""Which outputs of an ATen operator are new storages: shared by the prediction's counter and SimulatedMemory's dispatch backend."""

from __future__ import annotations

import torch

from lightning_gpuopt._compat import op_schema

__all__ = ["alias_mask"]

# torch.tensor(...) builds its storage below any mode and hands it over through lift_fresh, whose
# schema says "alias of the input": the storage is new all the same.
_FRESH_OPS = {torch.ops.aten.lift_fresh.default}
_alias_masks: dict = {}


def alias_mask(func) -> tuple[bool, ...]:
    """Per return of ``func``: whether its schema says it aliases an input (a view or in-place result)."""
    mask = _alias_masks.get(func)
    if mask is None:
        mask = tuple(ret.alias_info is not None for ret in op_schema(func).returns)
        if func in _FRESH_OPS:
            mask = tuple(False for _ in mask)
        _alias_masks[func] = mask
    return mask
