"""Bytes for people: the one formatter the pack's messages and tables use."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float) -> str:
    """Human-readable bytes in binary units.

    Example:
        >>> format_bytes(3 * 2**30)
        '3.00 GiB'
        >>> format_bytes(512)
        '512 B'
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
