"""Bytes for people: the one formatter the pack's messages and tables use."""

from __future__ import annotations

__all__ = ["ByteSize", "format_bytes", "parse_bytes"]


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


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: str | int | float) -> int:
    """Bytes from ``80GB`` (10⁹), ``80GiB`` (2³⁰), ``80e9``, ``1.5 TB`` or a plain number.

    Raises:
        ValueError: not a positive number of bytes with a known unit; the message lists the units.

    Example:
        >>> parse_bytes("80GB"), parse_bytes("80GiB"), parse_bytes("80e9"), parse_bytes(1024)
        (80000000000, 85899345920, 80000000000, 1024)
    """
    if isinstance(value, bool):
        raise ValueError(f"A memory size must be bytes like 80GB, 80GiB or 80e9, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        text = str(value).strip().replace("_", "")
        i = len(text)
        while i > 0 and text[i - 1].isalpha():
            i -= 1
        number_text, unit = text[:i].strip(), text[i:].strip().lower()
        if unit in ("e",):  # "80e" is not a number
            number_text, unit = text, ""
        try:
            number = float(number_text)
        except ValueError:
            number = float("nan")
    if unit not in _UNITS or not number > 0 or number == float("inf"):
        raise ValueError(
            f"A memory size must be a positive number of bytes with an optional unit (B, kB, MB, GB, TB: powers "
            f"of 1000; KiB, MiB, GiB, TiB: powers of 1024), like 80GB, 80GiB or 80e9; got {value!r}"
        )
    return round(number * _UNITS[unit])


class ByteSize(int):
    """An int of bytes parsed by :func:`parse_bytes`: the type of ``--gpuopt.device_memory``.

    Example:
        >>> ByteSize("80GB")
        80000000000
    """

    def __new__(cls, value: str | int | float) -> ByteSize:
        return super().__new__(cls, parse_bytes(value))
