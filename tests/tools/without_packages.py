"""Run a Python script as if some packages were not installed (the GPU machine's image has no jsonargparse, no torchdata).

    python tests/tools/without_packages.py jsonargparse,torchdata SCRIPT [ARGS...]

Imports of the named top-level packages raise ``ModuleNotFoundError`` and their distribution metadata is
not found (``importlib.metadata`` raises ``PackageNotFoundError``), so both ``import x`` and
requirement checks such as Lightning's ``RequirementCache("jsonargparse[signatures]")`` see them missing.
"""

from __future__ import annotations

import importlib.metadata
import runpy
import sys


def hide(names: set[str]) -> None:
    """Make the packages ``names`` (top-level import names = distribution names here) look uninstalled."""

    class Blocker:
        def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
            if fullname.partition(".")[0] in names:
                raise ModuleNotFoundError(
                    f"No module named {fullname!r} (hidden by {__file__})", name=fullname
                )

    sys.meta_path.insert(0, Blocker())
    from_name = importlib.metadata.Distribution.from_name.__func__

    def hidden_from_name(cls: type, name: str) -> importlib.metadata.Distribution:
        if name.lower().replace("-", "_") in names:
            raise importlib.metadata.PackageNotFoundError(name)
        return from_name(cls, name)

    importlib.metadata.Distribution.from_name = classmethod(hidden_from_name)
    for name in list(sys.modules):
        if name.partition(".")[0] in names:
            del sys.modules[name]


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: without_packages.py NAME[,NAME...] SCRIPT [ARGS...]")
    hide({n.strip().lower().replace("-", "_") for n in sys.argv[1].split(",") if n.strip()})
    script = sys.argv[2]
    sys.argv = sys.argv[2:]
    if script == "-c":
        exec(compile(sys.argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
