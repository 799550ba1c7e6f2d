"""Bytes for people: the one formatter the pack's messages and tables use, and the one reader of sizes."""

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
    for unit, scale in (
        ("EiB", 2**60),
        ("PiB", 2**50),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


#: Units by their lower-case spelling: SI (powers of 1000) and binary (powers of 1024, with or without "B").
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}
#: A bare prefix: 10^x or 2^x? Refused, with both spellings offered: (SI spelling, binary spelling, power of 1000).
_AMBIGUOUS = {
    "k": ("k", "K", 1),
    "m": ("M", "M", 2),
    "g": ("G", "G", 3),
    "t": ("T", "T", 4),
    "p": ("P", "P", 5),
}
#: No device has more memory than this; a larger size is a typo (``1e30``, a unit given twice).
MAX_BYTES = 2**50
_LIKE = "like 80GB, 80GiB or 80e9"


def _split(text: str) -> tuple[str, str]:
    """``"80 GiB"`` -> ``("80", "GiB")``; ``"80e9"`` -> ``("80e9", "")``."""
    i = len(text)
    while i > 0 and text[i - 1].isalpha():
        i -= 1
    number, unit = text[:i].strip(), text[i:].strip()
    if unit.lower() == "e":  # "80e" is not a number with a unit
        return text, ""
    return number, unit


def parse_bytes(value: str | int | float, name: str = "A memory size") -> int:
    """Bytes from ``80GB`` (10⁹), ``80GiB`` or ``80Gi`` (2³⁰), ``80e9``, ``1.5 TB`` or a plain number.

    Units are read without regard to case (``80gb`` is ``80GB``). A bare prefix (``80G``) is refused:
    it could mean either power, and the message offers both spellings. The one reader of sizes: the CLI's
    ``--gpuopt.device_memory`` and ``SimulatedMemory(limit_bytes=...)`` take the same spellings.

    Args:
        value: the size.
        name: what the error messages call it (an argument's name, such as ```limit_bytes```).

    Raises:
        ValueError: not a positive number of bytes up to 1 PiB with a known unit; one line that says
            what was expected and what was given.

    Example:
        >>> parse_bytes("80GB"), parse_bytes("80GiB"), parse_bytes("80e9"), parse_bytes(1024)
        (80000000000, 85899345920, 80000000000, 1024)
        >>> parse_bytes("80G")
        Traceback (most recent call last):
        ...
        ValueError: A memory size of '80G' is ambiguous: write 80GB (80·10^9 bytes) or 80GiB (80·2^30 bytes)
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes {_LIKE}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
        number_text = repr(value)
    else:
        text = str(value).strip().replace("_", "")
        number_text, unit = _split(text)
        try:
            number = float(number_text)
        except ValueError:
            number = float("nan")
    key = unit.lower()
    if key in _AMBIGUOUS and number == number:
        si, binary, power = _AMBIGUOUS[key]
        raise ValueError(
            f"{name} of {value!r} is ambiguous: write {number_text}{si}B ({number_text}·10^{3 * power} "
            f"bytes) or {number_text}{binary}iB ({number_text}·2^{10 * power} bytes)"
        )
    if key not in _UNITS or number != number or number in (float("inf"), float("-inf")):
        raise ValueError(
            f"{name} must be a number of bytes with an optional unit (B, kB, MB, GB, TB: powers of 1000; "
            f"KiB, MiB, GiB, TiB: powers of 1024), {_LIKE}; got {value!r}"
        )
    size = number * _UNITS[key]
    if size < 0:
        raise ValueError(f"{name} must be positive, got {value!r} (sizes look {_LIKE})")
    if round(size) == 0:
        raise ValueError(f"{name} must be at least 1 byte, got {value!r} (sizes look {_LIKE})")
    if size > MAX_BYTES:
        raise ValueError(
            f"{name} must be at most 1 PiB (no device has more), got {value!r}: check the exponent or "
            f"the unit (sizes look {_LIKE})"
        )
    return round(size)


class ByteSize(int):
    """An int of bytes parsed by :func:`parse_bytes`: the type of ``--gpuopt.device_memory``.

    Example:
        >>> ByteSize("80GB")
        80000000000
    """

    def __new__(cls, value: str | int | float) -> ByteSize:
        return super().__new__(cls, parse_bytes(value))
