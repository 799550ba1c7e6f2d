"""Mistakes on the ``gpuopt`` command line, said in one line: what was expected, what was given, what to do.

jsonargparse reports a bad option after the whole usage (about 55 lines) and wraps the real error in
several layers ("Does not validate against any of the Union subtypes ..."); an error raised while the
classes are built comes out as two chained tracebacks. :func:`explain_parse_error` and
:func:`explain_instantiation_error` read the innermost error of such a chain and say it in one line, with
"did you mean" for an unknown option, argument or class. ``gpuopt`` prints that line and exits with
status 2; ``--debug`` shows the traceback instead (docs/cli.md).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CommandLineError",
    "did_you_mean",
    "directory_on_path",
    "explain_instantiation_error",
    "explain_parse_error",
    "init_parameters",
    "join_negative_values",
    "split_debug",
    "top_level_help",
]

_PACKAGE = Path(__file__).resolve().parent


class CommandLineError(ValueError):
    """A mistake on the command line, or a run ``gpuopt`` will not start; the message is one line.

    ``gpuopt`` prints it and exits with status 2 (``--debug``: the traceback instead).
    """


def split_debug(args: Sequence[str]) -> tuple[list[str], bool]:
    """``args`` without ``--debug`` (wherever it stands), and whether it was there.

    Example:
        >>> split_debug(["fit", "--debug", "--config", "a.yaml"])
        (['fit', '--config', 'a.yaml'], True)
    """
    kept = [a for a in args if a != "--debug"]
    return kept, len(kept) != len(args)


_NEGATIVE_VALUE = re.compile(r"^-\d")


def join_negative_values(args: Sequence[str]) -> list[str]:
    """``--option -5GB`` as ``--option=-5GB``: argparse takes a value that starts with ``-`` and is not a
    plain number for an option of its own ("expected one argument"). No option name starts with a digit.

    Example:
        >>> join_negative_values(["--gpuopt.device_memory", "-5GB", "--trainer.max_steps", "3"])
        ['--gpuopt.device_memory=-5GB', '--trainer.max_steps', '3']
    """
    out: list[str] = []
    for arg in args:
        previous = out[-1] if out else ""
        if _NEGATIVE_VALUE.match(arg) and previous.startswith("--") and "=" not in previous:
            out[-1] = f"{previous}={arg}"
        else:
            out.append(arg)
    return out


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``": did you mean 'x'?"`` for the closest choice, or ``""`` when none is close.

    Example:
        >>> "batchsize" + did_you_mean("batchsize", ["batch_size", "num_workers"])
        "batchsize: did you mean 'batch_size'?"
    """
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f": did you mean {close[0]!r}?" if close else ""


def _chain(error: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _plain_types(text: str) -> str:
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    expected = re.match(r"Expected a (\S+)\. Got value: (.*)$", text)
    if expected:
        return f"expected {expected.group(1)}, got {expected.group(2)!r}"
    return re.sub(r"^Not of type \w+: ", "", text)


def directory_on_path(directory: str | None = None) -> bool:
    """Whether ``directory`` (default: the current one) is on ``sys.path`` (``""`` counts as the current)."""
    here = os.path.abspath(directory or os.getcwd())
    return any(os.path.abspath(p or os.getcwd()) == here for p in sys.path)


def _import_class(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def init_parameters(cls: type) -> list[inspect.Parameter]:
    """The parameters of ``cls(...)``, following ``**kwargs`` up the class hierarchy (what LightningCLI fills in),
    each name once, the nearest class's first."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = list(inspect.signature(init).parameters.values())[1:]
        except (TypeError, ValueError):
            break
        for p in parameters:
            found.setdefault(p.name, p)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            break
    return list(found.values())


def _init_parameters(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` takes, following ``**kwargs`` up the class hierarchy."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in init_parameters(cls) if p.kind in kinds]


def _explain_import(class_path: str, error: BaseException) -> str:
    """Why ``class_path`` does not import: its module is not on the path, a module it imports is missing, the
    module has no such class, or importing it raised."""
    module = class_path.rpartition(".")[0] or class_path
    here = os.getcwd()
    where = f"the current directory {here} is {'' if directory_on_path(here) else 'not '}on sys.path"
    if isinstance(error, ModuleNotFoundError) and error.name:
        if module == error.name or module.startswith(error.name + "."):
            top = error.name.split(".")[0]
            return (
                f"no module named {error.name!r} ({where}): run gpuopt from the folder that holds {top}.py or "
                f"{top}/, or add that folder to PYTHONPATH"
            )
        return f"importing {module} failed: it imports {error.name!r}, which is not installed (--debug shows where)"
    if isinstance(error, AttributeError) or "has no attribute" in str(error):
        name = class_path.rpartition(".")[2]
        try:
            found = importlib.import_module(module)
            classes = [k for k, v in vars(found).items() if inspect.isclass(v) and not k.startswith("_")]
        except Exception:
            classes = []
        return f"module {module} has no class {name!r}{did_you_mean(name, classes)}"
    return f"importing {module} raised {type(error).__name__}: {_first_line(error)} (--debug shows the traceback)"


def explain_parse_error(
    error: BaseException, options: Sequence[str] = (), command: str = "gpuopt fit"
) -> str:
    """One line for an error jsonargparse raised while reading the command line and config files.

    Args:
        error: the error (with its chain of causes).
        options: the subcommand's option strings, for "did you mean" on an unknown one.
        command: the command whose ``--help`` lists the options.

    Example:
        >>> explain_parse_error(ValueError("unrecognized arguments: --trainer.max_stepz 5"), ["--trainer.max_steps"])
        "unknown option --trainer.max_stepz: did you mean '--trainer.max_steps'? (gpuopt fit --help lists them)"
    """
    chain = _chain(error)
    texts = [str(e) for e in chain]
    key = next((m.group(1) for t in texts if (m := re.search(r'Parser key "([^"]+)"', t))), None)
    option = f"--{key}" if key else None
    class_paths = [m.group(1) for t in texts for m in re.finditer(r"class_path '([^']+)'", t)]
    class_path = class_paths[-1] if class_paths else None
    root = chain[-1]
    text = _first_line(root)
    prefix = f"{option} {class_path}" if option and class_path else option or class_path

    if class_path and (isinstance(root, ImportError) or re.search(r"has no attribute", " ".join(texts))):
        return f"{prefix}: {_explain_import(class_path, root)}"
    unknown = re.search(r"Option '([^']+)' is not accepted", text)
    if unknown and class_path:
        name = unknown.group(1)
        try:
            accepted = _init_parameters(_import_class(class_path))
        except Exception:
            accepted = []
        where = f"{option}.{name}: " if option else ""
        if not accepted:
            return f"{where}{class_path} takes no arguments, got {name!r}"
        more = ", ..." if len(accepted) > 12 else ""
        listed = f" (it takes: {', '.join(accepted[:12])}{more})"
        return f"{where}{class_path} takes no argument {name!r}{did_you_mean(name, accepted)}{listed}"
    unrecognized = re.match(r"unrecognized arguments: (.*)$", text)
    if unrecognized:
        given = [a.split("=")[0] for a in unrecognized.group(1).split() if a.startswith("-")]
        first = given[0] if given else unrecognized.group(1)
        return f"unknown option {first}{did_you_mean(first, options)} ({command} --help lists them)"
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", text)
    if choice:
        choices = re.findall(r"'([^']*)'", choice.group(2))
        return (
            f"unknown subcommand {choice.group(1)!r}{did_you_mean(choice.group(1), choices)} (gpuopt --help)"
        )
    text = _plain_types(text)
    if option and text.startswith(f'Parser key "{key}": '):
        text = text[len(f'Parser key "{key}": ') :]
    return f"{prefix}: {text}" if prefix else text


def explain_instantiation_error(error: BaseException) -> str | None:
    """One line for a validation error the pack raised while the classes were built; ``None`` for any other
    error (a bug in the user's code keeps its traceback).

    Example:
        >>> explain_instantiation_error(KeyError("x")) is None
        True
    """
    root = _chain(error)[-1]
    if not isinstance(root, (ValueError, TypeError)):
        return None
    frames = []
    tb = root.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if not frames or not Path(frames[-1].f_code.co_filename).resolve().is_relative_to(_PACKAGE):
        return None
    owner = next(
        (
            type(f.f_locals["self"]).__name__
            for f in reversed(frames)
            if f.f_code.co_name == "__init__" and "self" in f.f_locals
        ),
        None,
    )
    text = " ".join(str(root).split())
    return f"{owner}: {text}" if owner else text


def top_level_help(description: str) -> str:
    """``gpuopt --help``: every subcommand, the pack's own (``plan``, ``report``) with Lightning's."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="gpuopt",
        description=description,
        epilog="`gpuopt SUBCOMMAND --help` lists the options of a subcommand; docs/cli.md has them all.",
    )
    parser.add_argument("-c", "--config", help="a config file (yaml or json), before or after the subcommand")
    parser.add_argument("--print_config", action="store_true", help="print the whole config and exit")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of its one line"
    )
    subcommands = parser.add_subparsers(title="subcommands", metavar="SUBCOMMAND")
    for name, text in (
        ("fit", "train: Trainer.fit with the pack's callbacks, then a summary line"),
        ("validate", "one evaluation epoch over the validation set"),
        ("test", "one evaluation epoch over the test set"),
        ("predict", "run the model on the predict set"),
        ("plan", "the memory plan: which strategy fits the model on these devices, and why; no training"),
        ("report", "a finished run's report: print its table and draw its picture again (RUN_DIR)"),
    ):
        subcommands.add_parser(name, help=text)
    return parser.format_help()
