"""Which checkpoint ``gpuopt fit`` resumes from, and whether it belongs to this run.

``gpuopt fit`` writes a fingerprint of the run into every checkpoint (:class:`RunFingerprint`): the
model's and the datamodule's class paths, the model's parameter names, shapes and dtypes, the model's and
datamodule's init arguments, the seed and the Trainer's options, less those that may change between the legs
of one run (worker, pinning and prefetch settings, directories and paths, the Trainer's limits, devices and
output). The run's folder is named from it (:func:`run_identity`), so that the same command finds its run
again. Before ``fit`` loads or writes anything, :func:`plan_resume` reads the checkpoint ``--ckpt_path``
points at (memory-mapped, with ``weights_only``: no tensor is read) and compares. docs/resume.md explains the
rules.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint, Timer

from lightning_gpuopt._cli_errors import CommandLineError, init_parameters
from lightning_gpuopt._warnings import warn

__all__ = [
    "FINGERPRINT_KEY",
    "ResumePlan",
    "ResumeRefused",
    "RunFingerprint",
    "declared_defaults",
    "fingerprint_differences",
    "last_checkpoint",
    "plan_resume",
    "run_fingerprint",
    "run_identity",
    "run_options",
]

#: The top-level checkpoint key that holds the run's fingerprint.
FINGERPRINT_KEY = "gpuopt_run"
_FORMAT = 1

#: Init arguments that may change between the legs of one run: loading speed, and where things are.
_IGNORED_ARGUMENTS = {"num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "device_prefetch"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PATH_LIKE = re.compile(r"(^|_)(dir|dirs|directory|path|paths|root|file|files|folder|url)$")
#: Trainer options that may change between the legs of one run: its limits (raised to train on), where it runs
#: (a requeue may get other devices), and what it shows or writes.
_TRAINER_LEGS = frozenset(
    {
        "max_epochs",
        "min_epochs",
        "max_steps",
        "min_steps",
        "max_time",
        "accelerator",
        "strategy",
        "devices",
        "num_nodes",
        "plugins",
        "logger",
        "callbacks",
        "enable_checkpointing",
        "enable_progress_bar",
        "enable_model_summary",
        "enable_autolog_hparams",
        "log_every_n_steps",
        "default_root_dir",
        "profiler",
        "num_sanity_val_steps",
        "barebones",
        "detect_anomaly",
        "benchmark",
        "fast_dev_run",
        "model_registry",
    }
)
#: ``gpuopt fit``'s own options that change the optimization (the others change how it runs, not what).
_GPUOPT_OPTIONS = ("adaptive_batch",)
#: What ``seed_everything: true`` (LightningCLI's default) puts in the fingerprint: a seed drawn at each start.
#: A resume restores the first leg's random state and loader seed, so the legs are one run all the same.
RANDOM_SEED = "random"
#: Lightning's file inside a distributed (sharded) checkpoint folder that holds everything but the tensors.
_SHARDED_METADATA = "meta.pt"


class ResumeRefused(CommandLineError):
    """The checkpoint ``gpuopt fit`` would resume from is another run's (the message is one line)."""


class RunFingerprint(Callback):
    """Writes ``fingerprint`` into every checkpoint under :data:`FINGERPRINT_KEY` (``gpuopt fit`` adds it).

    Example:
        >>> callback = RunFingerprint({"format": 1, "model": "m.M"})
        >>> checkpoint = {}
        >>> callback.on_save_checkpoint(None, None, checkpoint)
        >>> checkpoint["gpuopt_run"]["model"]
        'm.M'
    """

    def __init__(self, fingerprint: dict[str, Any]) -> None:
        self.fingerprint = fingerprint

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[FINGERPRINT_KEY] = self.fingerprint


def _class_path(obj: Any) -> str | None:
    if obj is None:
        return None
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any) -> Any:
    """Config values as JSON-like data: namespaces and mappings as dicts, sequences as lists, else str."""
    if hasattr(value, "as_dict") and callable(value.as_dict):  # a jsonargparse Namespace
        value = value.as_dict()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, os.PathLike):
        return None  # a path: never part of the fingerprint
    return _ADDRESS.sub("", str(value))  # an object's address differs between processes


def _kept(name: str, value: Any) -> bool:
    return name not in _IGNORED_ARGUMENTS and not _PATH_LIKE.search(name) and value is not None


def _init_arguments(config: Any) -> dict[str, Any]:
    """The init arguments of a ``--model``/``--data`` config entry, less those that may change within a run."""
    plain = _plain(config)
    if not isinstance(plain, dict):
        return {}
    if "class_path" in plain:  # subclass mode: {"class_path": ..., "init_args": {...}, "dict_kwargs": {...}}
        plain = {**(plain.get("init_args") or {}), **(plain.get("dict_kwargs") or {})}
    return {key: value for key, value in plain.items() if _kept(key, value)}


def run_options(config: Any) -> dict[str, Any]:
    """The options of a ``gpuopt fit`` config (a subcommand's namespace) that make a run, by their dotted names.

    The Trainer's, less its limits, devices and output (:data:`_TRAINER_LEGS`) and paths; the optimizer and
    scheduler LightningCLI adds; ``gpuopt.adaptive_batch``. The model's and the datamodule's arguments and the
    seed have fields of their own in :func:`run_fingerprint`.

    Example:
        >>> run_options({"trainer": {"max_steps": 9, "precision": None}, "gpuopt": {"adaptive_batch": False}})
        {'trainer.precision': None, 'gpuopt.adaptive_batch': False}
    """
    plain = _plain(config)
    if not isinstance(plain, dict):
        return {}
    trainer = plain.get("trainer") if isinstance(plain.get("trainer"), dict) else {}
    options = {
        f"trainer.{name}": value
        for name, value in sorted(trainer.items())
        if name not in _TRAINER_LEGS and not _PATH_LIKE.search(name)
    }
    for name in ("optimizer", "lr_scheduler"):
        if name in plain:
            options[name] = plain[name]
    gpuopt = plain.get("gpuopt") if isinstance(plain.get("gpuopt"), dict) else {}
    for name in _GPUOPT_OPTIONS:
        if name in gpuopt:
            options[f"gpuopt.{name}"] = gpuopt[name]
    return options


def run_fingerprint(
    model: Any,
    datamodule: Any,
    model_config: Any = None,
    data_config: Any = None,
    seed: int | str | None = None,
    options: dict[str, Any] | None = None,
) -> dict:
    """What identifies a run: class paths, the model's parameters (name, shape, dtype), the init arguments, the
    seed and the options of :func:`run_options`.

    Computed from the model as built, before ``fit`` moves, converts or shards it, so that every leg of a
    run computes the same one. ``seed`` is ``seed_everything`` as given: a number, :data:`RANDOM_SEED`, or
    ``None`` (no seeding).

    Example:
        >>> from torch import nn
        >>> import lightning.pytorch as pl
        >>> class Tiny(pl.LightningModule):
        ...     def __init__(self, width=4):
        ...         super().__init__()
        ...         self.layer = nn.Linear(width, 1)
        >>> found = run_fingerprint(Tiny(), None, {"class_path": "Tiny", "init_args": {"width": 4}})
        >>> found["parameters"], found["model_args"]
        ([['layer.weight', [1, 4], 'float32'], ['layer.bias', [1], 'float32']], {'width': 4})
    """
    parameters = [
        [name, list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in model.named_parameters()
    ]
    return {
        "format": _FORMAT,
        "model": _class_path(model),
        "data": _class_path(datamodule),
        "parameters": parameters,
        "model_args": _init_arguments(model_config),
        "data_args": _init_arguments(data_config),
        "seed": seed,
        "options": dict(options or {}),
    }


def declared_defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls(...)``'s keyword arguments, following ``**kwargs`` up the class hierarchy (what
    LightningCLI fills in for the arguments a config leaves out)."""
    return {
        p.name: _plain(p.default) for p in init_parameters(cls) if p.default is not inspect.Parameter.empty
    }


def run_identity(
    fingerprint: Mapping[str, Any], defaults: Mapping[str, Mapping[str, Any]] | None = None
) -> str:
    """The name of a run's folder (a logger's version): ``run-`` and 8 hex digits of a hash of its fingerprint.

    Values equal to their defaults (``defaults``: per field of the fingerprint, ``{"model_args": {...}}``) are
    left out, so a new argument with a default (a release of the pack, of Lightning) leaves the name as it was;
    so is the fingerprint's format. The name is computed, not drawn: every rank, and every leg of the run,
    gets the same one.

    Example:
        >>> a = {"format": 1, "model": "m.A", "model_args": {"lr": 0.1, "width": 8}, "seed": 1}
        >>> run_identity(a) == run_identity({**a, "format": 2}), run_identity(a) == run_identity({**a, "seed": 2})
        (True, False)
        >>> run_identity(a, {"model_args": {"width": 8}}) == run_identity({**a, "model_args": {"lr": 0.1}})
        True
    """
    defaults, missing = defaults or {}, object()
    kept: dict[str, Any] = {}
    for key, value in fingerprint.items():
        if key == "format":
            continue
        if isinstance(value, Mapping) and key in defaults:
            value = {k: v for k, v in value.items() if defaults[key].get(k, missing) != v}
        kept[key] = value
    text = json.dumps(_plain(kept), sort_keys=True, separators=(",", ":"))
    return "run-" + hashlib.sha256(text.encode()).hexdigest()[:8]


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _parameter_difference(saved: list[list[Any]], current: list[list[Any]]) -> str | None:
    if saved == current:
        return None
    old, new = {p[0]: p[1:] for p in saved}, {p[0]: p[1:] for p in current}
    for name in [p[0] for p in current] + [p[0] for p in saved]:
        if old.get(name) != new.get(name):
            was = "absent" if name not in old else f"{old[name][0]} {old[name][1]}"
            now = "absent" if name not in new else f"{new[name][0]} {new[name][1]}"
            return f"parameters ({len(saved)} tensors -> {len(current)}; first: {name!r} {was} -> {now})"
    return f"parameters (their order: {len(saved)} tensors)"


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's fingerprint and this run's, one short phrase each.

    An init argument, an option or the seed counts when both runs have it: one that only one side has (a new
    argument with a default, an old one removed, a checkpoint written before the seed was recorded) leaves the
    run the same.

    Example:
        >>> a = {"model": "m.A", "data": None, "parameters": [["w", [2], "float32"]], "model_args": {"lr": 0.1}}
        >>> fingerprint_differences(a, {**a, "model_args": {"lr": 0.2, "width": 3}})
        ['model.lr 0.1 -> 0.2']
        >>> fingerprint_differences(a, {**a, "model": "m.B", "parameters": []})
        ['model class m.A -> m.B', "parameters (1 tensors -> 0; first: 'w' [2] float32 -> absent)"]
    """
    out = []
    for key, label in (("model", "model class"), ("data", "datamodule class")):
        if saved.get(key) != current.get(key):
            out.append(f"{label} {saved.get(key)} -> {current.get(key)}")
    difference = _parameter_difference(saved.get("parameters") or [], current.get("parameters") or [])
    if difference:
        out.append(difference)
    for key, prefix in (("model_args", "model."), ("data_args", "data."), ("options", "")):
        old, new = saved.get(key) or {}, current.get(key) or {}
        for name in sorted(set(old) & set(new)):
            if old[name] != new[name]:
                out.append(f"{prefix}{name} {_short(old[name])} -> {_short(new[name])}")
    if "seed" in saved and "seed" in current and saved["seed"] != current["seed"]:
        out.append(f"seed_everything {_short(saved['seed'])} -> {_short(current['seed'])}")
    return out


def last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The file ``ckpt_path="last"`` loads: the newest ``last*.ckpt`` of the Trainer's checkpoint folders.

    Lightning's rule, read before ``fit`` (the folders are those ``ModelCheckpoint.setup`` will pick:
    its ``dirpath``, else the first logger's ``save_dir/name/version/checkpoints``, else
    ``default_root_dir/checkpoints``); ``None`` when there is none.
    """
    candidates: set[str] = set()
    for callback in trainer.callbacks:
        if isinstance(callback, OnExceptionCheckpoint) and callback.ckpt_path:
            candidates.add(callback.ckpt_path)
        if not isinstance(callback, ModelCheckpoint):
            continue
        folder = callback.dirpath or _default_checkpoint_folder(trainer)
        fs = get_filesystem(folder)
        if not fs.exists(folder):
            continue
        pattern = re.compile(
            rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}"
        )  # last, last-v1, ... as Lightning
        for path in fs.ls(folder, detail=False):
            name = Path(path)
            if name.suffix == callback.FILE_EXTENSION and pattern.match(name.stem):
                candidates.add(os.path.normpath(path))
    times = {}
    for path in candidates:
        fs = get_filesystem(path)
        if fs.exists(path):
            times[path] = fs.modified(path)
    return max(times, key=times.get) if times else None  # type: ignore[arg-type]


def _default_checkpoint_folder(trainer: pl.Trainer) -> str:
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        return os.path.join(save_dir, str(logger.name), version, "checkpoints")
    return os.path.join(trainer.default_root_dir, "checkpoints")


def _read(path: str, weights_only: bool | None) -> dict[str, Any]:
    """The checkpoint's dict without reading its tensors (memory-mapped); a sharded folder's metadata file."""
    only = True if weights_only is None else weights_only  # what Lightning's own load does (torch's default)
    if "://" in path:  # a remote file: streamed, as Lightning will
        with get_filesystem(path).open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=only)
    file = Path(path) / _SHARDED_METADATA if Path(path).is_dir() else Path(path)
    try:
        return torch.load(file, map_location="cpu", weights_only=only, mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        return torch.load(file, map_location="cpu", weights_only=only)


@dataclass
class ResumePlan:
    """What :func:`plan_resume` decided: the checkpoint to load (``None``: start afresh), or nothing to do."""

    path: str | None
    #: One line for the log: the resume, or why there is nothing to do (``None``: a fresh start).
    message: str | None = None
    #: The run is finished under the current limits: ``fit`` has nothing to do.
    finished: bool = False


def _finished(checkpoint: dict[str, Any], trainer: pl.Trainer) -> str | None:
    """Why the checkpoint's run is over under this Trainer's limits; ``None`` when there is training left.

    A stop by a signal (ExactResume) never counts: it sets ``should_stop``, which is not saved.
    """
    step = int(checkpoint.get("global_step", 0))
    max_steps = trainer.max_steps
    if max_steps is not None and max_steps >= 0 and step >= max_steps:
        return f"max_steps={max_steps} reached"
    max_epochs = trainer.max_epochs
    if max_epochs is None:  # Lightning's rule at fit start (loops.utilities._parse_loop_limits)
        timed = any(isinstance(cb, Timer) for cb in trainer.callbacks)
        max_epochs = 1000 if max_steps == -1 and not timed else -1
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    epochs = int(progress.get("processed", 0))
    if max_epochs >= 0 and epochs >= max_epochs:
        return f"max_epochs={max_epochs} reached"
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("EarlyStopping") and isinstance(state, dict) and state.get("stopping_reason"):
            why = state.get("stopping_reason_message") or "its monitored metric stopped improving"
            return f"EarlyStopping stopped it: {why}"
    return None


def _seen(checkpoint: dict[str, Any], datamodule: Any) -> str:
    """The samples (or batches) of the current epoch the checkpoint's run has already trained on."""
    epoch = int(checkpoint.get("epoch", 0))
    if datamodule is not None:
        state = checkpoint.get(type(datamodule).__qualname__)
        loader = state.get("train_loader") if isinstance(state, dict) else None
        if isinstance(loader, dict) and "batches" in loader:
            same_epoch = int(loader.get("epoch", epoch)) == epoch
            batches = int(loader["batches"]) * int(loader.get("world_size", 1))
            if "max_tokens" in loader:  # batches by tokens: their sizes vary
                return f"{batches if same_epoch else 0} batches of the epoch already seen"
            samples = int(loader.get("samples", batches * int(loader.get("batch_size", 1))))
            return f"{samples if same_epoch else 0} samples of the epoch already seen"
    batches = (
        checkpoint.get("loops", {})
        .get("fit_loop", {})
        .get("epoch_loop.batch_progress", {})
        .get("current", {})
        .get("completed", 0)
    )
    return f"{int(batches)} batches of the epoch already seen"


_FIXES = "start afresh with --ckpt_path null, or give this run its own --trainer.default_root_dir or logger version"


def plan_resume(
    trainer: pl.Trainer,
    ckpt_path: str | None,
    fingerprint: dict[str, Any],
    datamodule: Any = None,
    explicit: bool = False,
    weights_only: bool | None = None,
) -> ResumePlan:
    """Decide, before ``fit`` loads or writes anything, what ``fit`` resumes from.

    Args:
        trainer: the Trainer ``fit`` will run (its callbacks and loggers locate ``"last"``; its limits say
            whether the checkpoint's run is finished).
        ckpt_path: ``None`` (a fresh start), ``"last"``, another of Lightning's names, or a path.
        fingerprint: this run's :func:`run_fingerprint`.
        datamodule: this run's datamodule (to count the samples of the epoch already seen).
        explicit: the user named the checkpoint (``--ckpt_path``): another run's checkpoint is their choice
            and gets a warning; otherwise it is refused.
        weights_only: ``--weights_only`` (how Lightning will load the file).

    Raises:
        ResumeRefused: the checkpoint is another run's and the user did not name it.
    """
    if ckpt_path is None:
        return ResumePlan(None)
    path: str | None = str(ckpt_path)
    if path == "last":
        path = last_checkpoint(trainer)
        if path is None:
            return ResumePlan(None)  # a first run: nothing to resume, nothing to say
    elif path in ("best", "hpc", "registry") or path.startswith("registry:") or not Path(path).exists():
        return ResumePlan(path)  # Lightning's own names, or a path Lightning will report on itself
    try:
        checkpoint = _read(path, weights_only)
    except Exception:
        return ResumePlan(path)
    if not isinstance(checkpoint, dict):
        return ResumePlan(path)
    saved = checkpoint.get(FINGERPRINT_KEY)
    if saved is None:
        if trainer.is_global_zero:
            warn(
                f"gpuopt fit: {path} has no run fingerprint (written before lightning_gpuopt 0.1 or outside gpuopt "
                "fit), so whether it belongs to this run is not checked; resuming from it."
            )
    else:
        differences = fingerprint_differences(saved, fingerprint)
        if differences:
            what = "; ".join(differences[:3]) + (
                f"; {len(differences) - 3} more" if len(differences) > 3 else ""
            )
            if not explicit:
                raise ResumeRefused(f"{path} is another run's checkpoint ({what}): {_FIXES}.")
            if trainer.is_global_zero:
                warn(
                    f"gpuopt fit: --ckpt_path {path} is another run's checkpoint ({what}); resuming from it as asked."
                )
    step, epoch = int(checkpoint.get("global_step", 0)), int(checkpoint.get("epoch", 0))
    finished = _finished(checkpoint, trainer)
    if finished is not None:
        return ResumePlan(
            path,
            f"gpuopt fit: {path} finished at step {step} ({finished}): nothing to do. To train on, raise "
            "--trainer.max_steps or --trainer.max_epochs; to start afresh, --ckpt_path null.",
            finished=True,
        )
    return ResumePlan(
        path,
        f"gpuopt fit: resuming from {path} at step {step}, epoch {epoch}, {_seen(checkpoint, datamodule)}.",
    )
