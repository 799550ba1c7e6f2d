"""The one place where static arguments are checked, with one message template.

Every message says what was expected and what was given: ``"`window` must be a positive int, got 0"``.
A leaf module like ``_warnings``: every layer may import it, it imports nothing of the pack.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

__all__ = ["choice", "fraction", "keep_options", "positive_int", "versioned_json"]


def positive_int(name: str, value: Any, *, unit: str = "", allow_none: bool = False, hint: str = "") -> Any:
    """``value`` when it is an int ≥ 1 (``None`` too with ``allow_none``); else a ``ValueError``.

    Args:
        name: the argument's name, as the user wrote it.
        value: what was given.
        unit: what the int counts (``"samples"``), said in brackets.
        allow_none: ``None`` is accepted (and said so in the message).
        hint: a sentence appended to the message (what to do instead).

    Example:
        >>> positive_int("window", 0)
        Traceback (most recent call last):
        ...
        ValueError: `window` must be a positive int, got 0
    """
    if value is None and allow_none:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = f" ({unit})" if unit else ""
        none = " or None" if allow_none else ""
        raise ValueError(
            f"`{name}` must be a positive int{what}{none}, got {value!r}{'; ' + hint if hint else ''}"
        )
    return value


def fraction(name: str, value: Any, *, closed_high: bool = True, closed_low: bool = False) -> float:
    """``value`` when it is a number in ``(0, 1]`` (the bounds as asked); else a ``ValueError``.

    Example:
        >>> fraction("threshold", 1.0, closed_high=False)
        Traceback (most recent call last):
        ...
        ValueError: `threshold` must be in (0, 1), got 1.0
    """
    low_ok = value >= 0 if closed_low else value > 0
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (low_ok and (value <= 1 if closed_high else value < 1)):
        interval = f"{'[' if closed_low else '('}0, 1{']' if closed_high else ')'}"
        raise ValueError(f"`{name}` must be in {interval}, got {value!r}")
    return float(value)


def choice(name: str, value: Any, choices: Any) -> Any:
    """``value`` when it is one of ``choices`` (a tuple, or a ``Literal[...]`` type); else a ``ValueError``.

    Example:
        >>> choice("mode", "min", Literal["micro", "max"])
        Traceback (most recent call last):
        ...
        ValueError: `mode` must be one of ('micro', 'max'), got 'min'
    """
    options = get_args(choices) if get_origin(choices) is Literal else tuple(choices)
    if value not in options or (isinstance(value, bool) and True not in options and False not in options):
        raise ValueError(f"`{name}` must be one of {options}, got {value!r}")
    return value


def keep_options(owner: object, options: Any) -> None:
    """Keep the checked ``options`` dataclass as ``owner.options``, and each of its fields as the attribute of the
    same name on ``owner``.

    A callback with many arguments checks them in one options dataclass and keeps reading them as attributes.
    """
    owner.options = options
    for field in dataclasses.fields(options):
        setattr(owner, field.name, getattr(options, field.name))


def versioned_json(file: Path, fmt: str, hint: str = "") -> dict[str, Any]:
    """The JSON object in ``file`` when its ``"format"`` is ``fmt``; else a ``ValueError`` (``hint``: what to do)."""
    data = json.loads(file.read_text())
    if data.get("format") != fmt:
        raise ValueError(
            f"{str(file)!r} has format {data.get('format')!r}; this version reads {fmt!r}"
            + (f". {hint}" if hint else "")
        )
    return data
