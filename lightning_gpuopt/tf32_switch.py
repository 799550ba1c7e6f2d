"""The process-global TF32 setting of ``torch.backends.cuda.matmul``: a side effect, not a decision.

PrecisionSwitch turns TF32 matmuls on at setup when ``precision.tf32_wanted`` says so, and restores the
setting at teardown; nothing else in the pack touches it.
"""

from __future__ import annotations

import torch

__all__ = ["restore_tf32", "turn_on_tf32"]


def _new_tf32_api() -> bool:
    """torch >= 2.9 sets TF32 per backend with ``fp32_precision``; older torch with ``allow_tf32``."""
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


def turn_on_tf32() -> str | bool | None:
    """Turn TF32 matmuls on unless something already chose; returns the setting to restore (``None``: unchanged).

    On torch >= 2.9 through ``torch.backends.cuda.matmul.fp32_precision = "tf32"``, only while it (and
    ``torch.backends.fp32_precision``) is still ``"none"``, the untouched default; on older torch
    through ``torch.backends.cuda.matmul.allow_tf32``, only while it is off.
    """
    matmul = torch.backends.cuda.matmul
    if _new_tf32_api():
        before = matmul.fp32_precision
        if before != "none" or getattr(torch.backends, "fp32_precision", "none") != "none":
            return None
        matmul.fp32_precision = "tf32"
        return before
    if matmul.allow_tf32:
        return None
    matmul.allow_tf32 = True
    return False


def restore_tf32(previous: str | bool | None) -> None:
    """Undo :func:`turn_on_tf32` with the value it returned."""
    if previous is None:
        return
    matmul = torch.backends.cuda.matmul
    if isinstance(previous, str):
        matmul.fp32_precision = previous
    else:
        matmul.allow_tf32 = previous
