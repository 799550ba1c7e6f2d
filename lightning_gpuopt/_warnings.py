"""The package's warning category, so users can filter everything this pack says in one line."""

from __future__ import annotations

import warnings

__all__ = ["GPUOptWarning", "warn"]


class GPUOptWarning(UserWarning):
    """Warnings issued by lightning_gpuopt.

    Example:
        >>> import warnings
        >>> warnings.filterwarnings("ignore", category=GPUOptWarning)
    """


def warn(message: str, stacklevel: int = 2) -> None:
    """Issue a :class:`GPUOptWarning` (de-duplicated by Python's default filter per call site)."""
    warnings.warn(message, GPUOptWarning, stacklevel=stacklevel + 1)
