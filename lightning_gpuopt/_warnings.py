"""The package's warning category, so users can filter everything this pack says in one line."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

__all__ = ["GPUOptWarning", "moved_names", "warn"]


class GPUOptWarning(UserWarning):
    """Warnings issued by lightning_gpuopt.

    Example:
        >>> import warnings
        >>> warnings.filterwarnings("ignore", category=GPUOptWarning)
    """


def warn(message: str, stacklevel: int = 2) -> None:
    """Issue a :class:`GPUOptWarning` (de-duplicated by Python's default filter per call site)."""
    warnings.warn(message, GPUOptWarning, stacklevel=stacklevel + 1)


def moved_names(module: str, moves: Mapping[str, str]) -> Callable[[str], object]:
    """A module's ``__getattr__`` for names that moved: ``moves`` maps an old name to its new ``package.module.name``.

    An old name still resolves for one release, with a ``DeprecationWarning`` naming where it is now. The new home is
    imported by name when the old one is asked for, so the old module imports nothing of it.

    Example:
        >>> __getattr__ = moved_names("mine", {"old": "math.pi"})
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = __getattr__("old")
        >>> round(value, 2), str(caught[0].message)
        (3.14, 'mine.old moved to math.pi; the old path goes in the next release.')
    """

    def __getattr__(name: str) -> object:
        new = moves.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to {new}; the old path goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        home, _, attribute = new.rpartition(".")
        return getattr(importlib.import_module(home), attribute)

    return __getattr__
