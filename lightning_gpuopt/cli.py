"""The ``gpuopt`` command: a LightningCLI for any LightningModule and LightningDataModule, by class path.

Examples:
    gpuopt fit --config examples/configs/default.yaml
    gpuopt fit --model lightning.pytorch.demos.boring_classes.DemoModel \\
               --data lightning.pytorch.demos.boring_classes.BoringDataModule --trainer.max_steps 5
    gpuopt plan --config examples/configs/default.yaml --trainer.devices 8   # the memory plan, no training
    gpuopt report lightning_logs/default/run-805e1e93   # the run's report table and picture, again
    python -m lightning_gpuopt fit --help
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt import _compat
from lightning_gpuopt._cli_errors import (
    CommandLineError,
    did_you_mean,
    directory_on_path,
    explain_instantiation_error,
    explain_parse_error,
    join_negative_values,
    split_debug,
    top_level_help,
)
from lightning_gpuopt._cli_report import report_command
from lightning_gpuopt._cli_resume import (
    RANDOM_SEED,
    ResumePlan,
    RunFingerprint,
    declared_defaults,
    plan_resume,
    run_fingerprint,
    run_identity,
    run_options,
)
from lightning_gpuopt._summary import RunSummary
from lightning_gpuopt.callbacks import (
    AdaptiveBatchSize,
    ExactResume,
    GPUOptReport,
    GradientNoiseScale,
    MemoryAwareBatchSize,
    OOMRecovery,
    PrecisionSwitch,
)
from lightning_gpuopt.callbacks.exact_resume import StepBoundaryCheckpoint
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory.units import ByteSize
from lightning_gpuopt.microbatch import unsupported_strategy
from lightning_gpuopt.strategy import StrategyPlan, optimizer_of, sample_batch_of, select_strategy
from lightning_gpuopt.support import Feature

__all__ = ["CommandLineError", "GPUOptCLI", "main", "plan_command", "report_command", "run"]

_DESCRIPTION = (
    "gpuopt: train any LightningModule with lightning_gpuopt's memory, precision and data tuning. "
    "Pick the model and data by class path (--model, --data) or in a config file (--config). "
    "`gpuopt plan --config X.yaml [--trainer.devices N]` prints the memory plan (which strategy, why) without "
    "training; `gpuopt report RUN_DIR` prints a finished run's report table and draws its picture again."
)


#: The subcommands LightningCLI runs; ``plan`` and ``report`` are the pack's own (:func:`main`).
_TRAINER_SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: ``--ckpt_path``'s default in ``gpuopt fit``: this run's own last checkpoint with ``--gpuopt.resume``, else none.
AUTO_CKPT_PATH = "auto"


def _require_jsonargparse() -> None:
    """The command line needs jsonargparse (LightningCLI's parser); the Python API does not."""
    from lightning_utilities.core.imports import RequirementCache

    if not RequirementCache("jsonargparse[signatures]>=4.27.7"):
        raise ModuleNotFoundError(
            "The gpuopt command line (GPUOptCLI) needs 'jsonargparse[signatures]>=4.27.7', which is not installed: "
            "pip install 'jsonargparse[signatures]>=4.27.7', or use the Python API (callbacks on a Trainer), "
            "which works without it."
        )
    _register_byte_size()


def _register_byte_size() -> None:
    """Let jsonargparse read ``--gpuopt.device_memory 80GB`` (a ByteSize), and write it back as plain bytes."""
    from jsonargparse.typing import register_type

    try:
        register_type(ByteSize, serializer=int, deserializer=ByteSize)
    except ValueError:  # registered already
        pass


class GPUOptCLI(LightningCLI):
    """LightningCLI with the pack's defaults: ``fit``, ``validate``, ``test`` and ``predict``.

    Any LightningModule (``--model``) and LightningDataModule (``--data``) can be given by class
    path, not only the pack's own. Options of the pack are under ``--gpuopt.*``.

    ``fit`` gets the pack's callbacks where the strategy runs them, unless ``--trainer.callbacks`` already
    has one: OOMRecovery, MemoryAwareBatchSize (``mode="micro"``), PrecisionSwitch (``initial="keep"`` when a
    precision is given), GPUOptReport, and ExactResume with a ``StepBoundaryCheckpoint`` (``--ckpt_path auto``
    resumes this run's newest ``last*.ckpt``, :meth:`before_fit`); GradientNoiseScale and AdaptiveBatchSize on
    request. With ``--gpuopt.resume``, a CSV or TensorBoard logger without a version of the user's is given the
    run's identity (:attr:`run_identity`, a hash of its config) as its version, so that the same command finds
    the run's folder again. On several devices with ``--trainer.strategy auto`` the strategy comes from
    :func:`~lightning_gpuopt.select_strategy`. docs/cli.md lists every ``--gpuopt.*`` option and its default.

    Args:
        *args: passed to :class:`~lightning.pytorch.cli.LightningCLI`.
        **kwargs: passed to :class:`~lightning.pytorch.cli.LightningCLI`; ``model_class`` and
            ``datamodule_class`` default to any subclass, and the saved ``config.yaml`` is overwritten.

    Example:
        >>> from lightning_gpuopt.cli import GPUOptCLI
        >>> cli = GPUOptCLI(run=False, args=["--model", "lightning.pytorch.demos.boring_classes.BoringModel",
        ...     "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"])
        >>> type(cli.model).__name__
        'BoringModel'
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _require_jsonargparse()
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        parser_kwargs = dict(kwargs.pop("parser_kwargs", None) or {})
        parser_kwargs.setdefault("description", _DESCRIPTION)
        # A prefix of an option is a mistake ("--trainer.max_epoch"), not that option: argparse's abbreviations off.
        parser_kwargs.setdefault("allow_abbrev", False)
        shared = {
            key: parser_kwargs[key] for key in ("exit_on_error", "allow_abbrev") if key in parser_kwargs
        }
        for name in _TRAINER_SUBCOMMANDS:  # the subcommands' parsers read and report the same way
            parser_kwargs[name] = {**shared, **parser_kwargs.get(name, {})}
        kwargs["parser_kwargs"] = parser_kwargs
        self.summary: RunSummary | None = None
        #: The memory plan behind the strategy (``gpuopt fit`` on several devices, ``gpuopt plan``); ``None`` otherwise.
        self.plan: StrategyPlan | None = None
        #: What ``fit`` resumes from (``gpuopt fit``, decided in :meth:`before_fit`); ``None`` before.
        self.resume: ResumePlan | None = None
        self._fingerprint: dict[str, Any] | None = None
        #: The name of this run's folder, from its config (``gpuopt fit``; ``None`` before, or elsewhere).
        self.run_identity: str | None = None
        self._seed: int | str | None = None
        self._parsers: list[LightningArgumentParser] = []
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ parsing: one line per mistake

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        self._parsers.append(parser)  # the main parser, then one per subcommand (for "did you mean")
        return parser

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        if add_subcommands:
            # `--ckpt_path null` then means "start afresh", apart from the default (before_fit)
            self.parser.set_defaults({"fit.ckpt_path": AUTO_CKPT_PATH})

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, and with ``parser_kwargs={"exit_on_error": False}`` (what ``gpuopt`` passes) turn jsonargparse's
        error into a :class:`CommandLineError` of one line."""
        from argparse import ArgumentError

        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            words = [a for a in (args if isinstance(args, list) else sys.argv[1:]) if isinstance(a, str)]
            subcommand = next((w for w in words if w in _TRAINER_SUBCOMMANDS), None)
            command = f"gpuopt {subcommand}" if subcommand else "gpuopt plan"
            raise CommandLineError(explain_parse_error(err, self._options(subcommand), command)) from err
        # the seed as given, before LightningCLI replaces `true` with the one it draws (part of the run's identity)
        subcommand = self.config.get("subcommand")
        seed = (self.config.get(subcommand) if subcommand else self.config).get("seed_everything")
        self._seed = RANDOM_SEED if seed is True else None if seed is False else seed

    def _options(self, subcommand: str | None) -> list[str]:
        """The option strings of ``subcommand``'s parser (the main parser's without one)."""
        parsers = [
            p for p in self._parsers if subcommand and p.prog.split()[-1] == subcommand
        ] or self._parsers[:1]
        return _compat.parser_option_strings(parsers[0])

    def instantiate_classes(self) -> None:
        """Build the model, the datamodule and the Trainer; a validation error of the pack's becomes one line."""
        try:
            super().instantiate_classes()
        except CommandLineError:
            raise
        except Exception as err:
            line = explain_instantiation_error(err)
            if line is None:
                raise
            raise CommandLineError(line) from err

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--gpuopt.summary",
            type=bool,
            default=True,
            help="After fit, print one line with the final validation metrics, training samples/s and peak memory.",
        )
        parser.add_argument(
            "--gpuopt.oom_recovery",
            type=bool,
            default=True,
            help="Add OOMRecovery to fit on a single device, under DDP or under FSDP2 (re-split a batch that runs out of memory "
            "and retry on every rank), "
            "unless trainer.callbacks has one.",
        )
        parser.add_argument(
            "--gpuopt.batch_size_search",
            type=bool,
            default=True,
            help="Add MemoryAwareBatchSize to fit on a single device, under DDP or FSDP2 (measure a few real steps, use the "
            "largest micro-batch that fits; batch_size kept), unless trainer.callbacks has one.",
        )
        parser.add_argument(
            "--gpuopt.precision_switch",
            type=bool,
            default=True,
            help="Add PrecisionSwitch to fit (the fastest precision the hardware runs natively, a more stable one on "
            "non-finite values), unless trainer.callbacks has one; it keeps --trainer.precision when that is given.",
        )
        parser.add_argument(
            "--gpuopt.noise_scale",
            type=bool,
            default=False,
            help="Add GradientNoiseScale to fit (measures the gradient noise scale B_simple: is a larger batch worth "
            "it? logged as gpuopt/noise_scale and shown in the report), unless trainer.callbacks has one.",
        )
        parser.add_argument(
            "--gpuopt.adaptive_batch",
            type=bool,
            default=False,
            help="Add AdaptiveBatchSize to fit (opt-in, it changes the optimization: grows the optimizer batch through "
            "accumulation while the noise scale says it pays, learning rate scaled), unless trainer.callbacks has one.",
        )
        parser.add_argument(
            "--gpuopt.report",
            type=bool,
            default=True,
            help="Add GPUOptReport to fit (summary table, gpuopt_report.json and gpuopt_report.png in the run's log "
            "directory), unless trainer.callbacks has one.",
        )
        parser.add_argument(
            "--gpuopt.select_strategy",
            type=bool,
            default=True,
            help="On several devices with trainer.strategy 'auto', pick the strategy from memory needs "
            "(select_strategy: DDP, FSDP sharding, offload) and print the plan.",
        )
        parser.add_argument(
            "--gpuopt.device_memory",
            type=ByteSize | None,
            default=None,
            help="Memory per device to plan against instead of the device's own (to plan for another machine): "
            "bytes, or with a unit: 80GB, 80GiB, 80e9.",
        )

        parser.add_argument(
            "--gpuopt.resume",
            type=bool,
            default=True,
            help="Survive preemption in fit: add ExactResume (SIGTERM/SIGUSR1 stop at the next optimizer step with a "
            "checkpoint, exit 0; RNG restored), keep last.ckpt every --gpuopt.checkpoint_minutes, and with "
            "--ckpt_path auto (the default) resume this run's last checkpoint.",
        )
        parser.add_argument(
            "--gpuopt.elastic",
            type=Literal["keep_optimizer_batch", "keep_per_rank"],
            default="keep_optimizer_batch",
            help="With --gpuopt.resume, resuming on another number of GPUs: keep the optimizer batch (the data's "
            "batch_size per rank becomes the checkpoint's ranks x batch_size over this run's ranks) or keep batch_size "
            "per rank (the optimizer batch changes). Sets the ExactResume that --gpuopt.resume adds; an ExactResume in "
            "trainer.callbacks keeps its own.",
        )
        parser.add_argument(
            "--gpuopt.checkpoint_minutes",
            type=float,
            default=15.0,
            help="With --gpuopt.resume: write last.ckpt at least this often (minutes of training wall time), at an "
            "optimizer-step boundary.",
        )

    # ------------------------------------------------------------------ fit: resume, then train

    def before_fit(self) -> None:
        """Decide what ``fit`` resumes from, before anything is loaded or written (docs/resume.md).

        ``--ckpt_path auto`` (the default) is this run's own last checkpoint with ``--gpuopt.resume``, else
        none; another run's is refused (:class:`~lightning_gpuopt._cli_resume.ResumeRefused`). A checkpoint
        the user names (a path, or ``last``) is their choice: another run's gets a warning. A finished run
        says so, and ``fit`` does nothing.
        """
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        given = config.get("ckpt_path")
        auto = given == AUTO_CKPT_PATH
        if auto:
            given = "last" if self._gpuopt_option("resume") else None
        fingerprint = self._fingerprint or self._run_fingerprint()
        self.resume = plan_resume(
            self.trainer,
            given,
            fingerprint,
            datamodule=self.datamodule,
            explicit=not auto,
            weights_only=config.get("weights_only"),
        )
        config["ckpt_path"] = self.resume.path
        if self.resume.message:
            rank_zero_info(self.resume.message)
        if self.resume.path is not None and not self.resume.finished and self.trainer.is_global_zero:
            for logger in self.trainer.loggers:  # the resumed run's rows go on after the earlier legs'
                if isinstance(logger, CSVLogger):
                    _compat.continue_csv_metrics(logger)

    def fit(self, model: Any, datamodule: Any = None, **kwargs: Any) -> None:
        """``Trainer.fit``, unless the run has finished already (then nothing is loaded or written)."""
        if self.resume is not None and self.resume.finished:
            return
        self.trainer.fit(model, datamodule=datamodule, **kwargs)

    def after_fit(self) -> None:
        """Print the summary line (the report's figures when a GPUOptReport ran: one measure, docs/report.md)."""
        if self.summary is not None and not (self.resume is not None and self.resume.finished):
            self.summary.finish(self.trainer)

    def _run_fingerprint(self) -> dict[str, Any]:
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        return run_fingerprint(
            self.model,
            self.datamodule,
            config.get("model"),
            config.get("data"),
            seed=self._seed,
            options=run_options(config),
        )

    def _run_identity(self, fingerprint: dict[str, Any]) -> str:
        """The name of this run's folder: a hash of its fingerprint, less the values equal to their defaults."""
        parser = next(p for p in self._parsers if p.prog.split()[-1] == self.subcommand)
        try:
            options = run_options(parser.get_defaults())
        except Exception:  # a parser that cannot list its defaults: every option counts in the name
            options = {}
        defaults = {
            "model_args": declared_defaults(type(self.model)),
            "data_args": declared_defaults(type(self.datamodule)) if self.datamodule is not None else {},
            "options": options,
        }
        return run_identity(fingerprint, defaults)

    def _name_the_run_folder(self, trainer: Trainer) -> None:
        """Give the Trainer's CSV and TensorBoard loggers that have no version of the user's this run's
        identity as their version, so that the same command finds the run's folder (and ``last.ckpt``) again."""
        self.run_identity = self._run_identity(self._fingerprint or self._run_fingerprint())
        for logger in trainer.loggers:
            if isinstance(logger, (CSVLogger, TensorBoardLogger)) and _compat.logger_version(logger) is None:
                _compat.set_logger_version(logger, self.run_identity)
        # Another logger (a tracking service's) names its folder itself, often afresh at each start: the stop
        # line then names the checkpoint instead.
        found_again = not trainer.loggers or isinstance(trainer.loggers[0], (CSVLogger, TensorBoardLogger))
        for callback in trainer.callbacks:
            if isinstance(callback, ExactResume):
                callback.same_command_resumes = found_again

    def _section(self, key: str) -> Any:
        """The instantiated config's ``key`` (``trainer``, ...) of this subcommand."""
        config = self.config_init.get(str(self.subcommand), self.config_init)
        return config.get(key) or {}

    def _add_resume(self, trainer: Trainer) -> None:
        if not any(isinstance(cb, ExactResume) for cb in trainer.callbacks):
            trainer.callbacks.append(
                ExactResume(elastic=self._gpuopt_option("elastic") or "keep_optimizer_batch")
            )
        if trainer.checkpoint_callback is None or any(
            isinstance(cb, StepBoundaryCheckpoint) for cb in trainer.callbacks
        ):
            return  # checkpointing is off, or a boundary checkpoint is there already
        minutes = float(self._gpuopt_option("checkpoint_minutes"))
        if not minutes > 0:
            raise CommandLineError(
                f"--gpuopt.checkpoint_minutes must be > 0, got {minutes}; use --gpuopt.resume false for no "
                "time-based last.ckpt"
            )
        trainer.callbacks.append(
            StepBoundaryCheckpoint(
                save_top_k=0, save_last=True, train_time_interval=timedelta(minutes=minutes)
            )
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        fitting = self.subcommand in (None, "fit")
        if fitting and self._gpuopt_option("select_strategy"):
            trainer_config = self._section("trainer")
            world = _world_size(trainer_config)
            if trainer_config.get("strategy", "auto") == "auto" and "strategy" not in kwargs and world > 1:
                self.plan = self.strategy_plan(trainer_config)
                kwargs["strategy"] = self.plan.strategy
                if self.subcommand == "fit":
                    rank_zero_info(self.plan.table())
        trainer = super().instantiate_trainer(**kwargs)
        if self.plan is not None and fitting:
            record_decision(
                trainer,
                "strategy",
                "select_strategy",
                f"{self.plan.pick}: {self.plan.reason}",
                pick=self.plan.pick,
                world_size=self.plan.world_size,
                num_nodes=self.plan.num_nodes,
                device_memory=self.plan.device_memory,
                table=self.plan.table(),
            )
        if fitting and self._gpuopt_option("batch_size_search"):
            self._add_if_supported(trainer, MemoryAwareBatchSize)
        if fitting and self._gpuopt_option("oom_recovery"):
            self._add_oom_recovery(trainer)
        if fitting and self._gpuopt_option("precision_switch"):
            self._add_precision_switch(trainer)
        if fitting and (self._gpuopt_option("noise_scale") or self._gpuopt_option("adaptive_batch")):
            if not any(isinstance(cb, GradientNoiseScale) for cb in trainer.callbacks):
                trainer.callbacks.append(GradientNoiseScale())
        if fitting and self._gpuopt_option("adaptive_batch"):
            if not any(isinstance(cb, AdaptiveBatchSize) for cb in trainer.callbacks):
                trainer.callbacks.append(AdaptiveBatchSize())
        if fitting and self._gpuopt_option("report"):
            if not any(isinstance(cb, GPUOptReport) for cb in trainer.callbacks):
                trainer.callbacks.append(GPUOptReport())
        if fitting and self._gpuopt_option("resume"):
            self._add_resume(trainer)
        if self.subcommand == "fit":
            self._fingerprint = self._run_fingerprint()
            trainer.callbacks.append(RunFingerprint(self._fingerprint))
            if self._gpuopt_option("resume"):
                self._name_the_run_folder(trainer)
        if fitting and self._gpuopt_option("summary"):
            report = next((cb for cb in trainer.callbacks if isinstance(cb, GPUOptReport)), None)
            self.summary = RunSummary(steps=_report_steps(report) if report is not None else None)
            trainer.callbacks.append(self.summary)
        return trainer

    def _add_precision_switch(self, trainer: Trainer) -> None:
        if any(isinstance(cb, PrecisionSwitch) for cb in trainer.callbacks):
            return
        config = self._section("trainer")
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        given = config.get("precision") is not None or any(isinstance(p, Precision) for p in plugins)
        trainer.callbacks.append(PrecisionSwitch(initial="keep" if given else "auto"))

    def strategy_plan(self, trainer_config: dict[str, Any] | None = None) -> StrategyPlan:
        """The memory plan for this command line's model, data, devices and precision (:func:`select_strategy`).

        Raises:
            StrategyPlanError: nothing fits; the error carries the plan.
        """
        config = trainer_config if trainer_config is not None else self._section("trainer")
        devices, nodes = _world_size(config, per_node=True), int(config.get("num_nodes") or 1)
        memory = self._gpuopt_option("device_memory")
        device = None
        if memory is None and not _on_cuda(config):
            from lightning_gpuopt.memory import get_probe

            memory = get_probe("cpu").total // devices  # the processes of one node share its RAM
            device = "cpu"
        return select_strategy(
            self.model,
            devices=devices,
            num_nodes=nodes,
            precision=str(config.get("precision") or "32-true"),
            optimizer=optimizer_of(self.model),
            sample_batch=sample_batch_of(self.datamodule),
            micro_batch_size=int(getattr(self.datamodule, "batch_size", 1) or 1),
            device_memory=memory,
            device=device,
            features=self._planned_features(),
        )

    def _planned_features(self) -> list[Feature]:
        """The pack's callbacks this fit adds, most important first (the plan keeps them running when it can)."""
        features = []
        if self._gpuopt_option("oom_recovery"):
            features.append(Feature.OOM_RECOVERY)
        if self._gpuopt_option("batch_size_search"):
            features.append(Feature.BATCH_SIZE_SEARCH)
        return features

    @staticmethod
    def _add_oom_recovery(trainer: Trainer) -> None:
        GPUOptCLI._add_if_supported(trainer, OOMRecovery)

    @staticmethod
    def _add_if_supported(trainer: Trainer, callback: type) -> None:
        """Add ``callback()`` (a micro-batching callback) unless the Trainer has one or its strategy cannot run it."""
        if any(isinstance(cb, callback) for cb in trainer.callbacks):
            return
        feature = Feature.OOM_RECOVERY if callback is OOMRecovery else Feature.BATCH_SIZE_SEARCH
        reason = unsupported_strategy(trainer.strategy, feature)
        if reason is not None:
            rank_zero_info(f"gpuopt: {callback.__name__} not added: {reason}")
            return
        trainer.callbacks.append(callback())

    def _gpuopt_option(self, name: str) -> Any:
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        return config.get(f"gpuopt.{name}")


def _report_steps(report: GPUOptReport) -> Callable[[], list[dict[str, Any]]]:
    """The steps of ``report``'s record, read after ``fit`` (the summary's figures are the table's)."""
    return lambda: list(report.report.get("steps", []))


def _on_cuda(config: dict[str, Any]) -> bool:
    import torch

    accelerator = str(config.get("accelerator") or "auto")
    return accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def _world_size(config: dict[str, Any], per_node: bool = False) -> int:
    """Processes a trainer config asks for (devices × nodes), from the raw config values."""
    devices = config.get("devices", "auto")
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        count = int(devices)
    elif isinstance(devices, int):
        count = devices
    else:
        count = -1
    if count == -1:  # "auto" or -1: every visible GPU, else one process
        import torch

        count = torch.cuda.device_count() if _on_cuda(config) else 1
    count = max(1, count)
    return count if per_node else count * int(config.get("num_nodes") or 1)


def plan_command(args: list[str]) -> int:
    """``gpuopt plan [fit options]``: print the memory plan (strategy and why) for a config, without training.

    Returns the exit status: 0, or 1 when nothing fits (the table is printed all the same).

    Raises:
        CommandLineError: a mistake in the options (one line; :func:`main` prints it and exits with 2).
    """
    from lightning_gpuopt.strategy import StrategyPlanError

    try:
        with _as_command_line(args):  # on several devices, instantiating the Trainer plans already
            cli = GPUOptCLI(args=None, run=False, parser_kwargs={"exit_on_error": False})
        plan = cli.plan or cli.strategy_plan()
    except StrategyPlanError as err:
        print(f"gpuopt plan: {err}")
        return 1
    print(plan.table())
    return 0


def run(args: list[str] | None = None) -> GPUOptCLI:
    """Run the command line ``args`` (default: ``sys.argv[1:]``) and return the CLI, for use from Python."""
    return GPUOptCLI(args=args)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``gpuopt`` console script and of ``python -m lightning_gpuopt``.

    ``report`` and ``plan`` are handled here; every other subcommand goes to :class:`GPUOptCLI`. Returns nothing
    after a successful run, so the console script's exit status is 0. A mistake on the command line, or a run
    that will not start (another run's checkpoint), is one line on stderr and exit status 2; ``--debug``
    (anywhere on the line) shows the traceback instead.
    """
    args, debug = split_debug(sys.argv[1:] if args is None else list(args))
    args = join_negative_values(args)
    if not args or args[0] in ("-h", "--help"):
        if args:
            print(top_level_help(_DESCRIPTION), end="")
            sys.exit(0)
        print(f"gpuopt: give a subcommand: {', '.join(_SUBCOMMANDS)} (gpuopt --help)", file=sys.stderr)
        sys.exit(2)
    command = args[0]
    try:
        if command == "report":
            status = report_command(args[1:])
        elif command == "plan":
            status = plan_command(args[1:])
        else:
            if not command.startswith("-") and command not in _TRAINER_SUBCOMMANDS:
                raise CommandLineError(
                    f"unknown subcommand {command!r}{did_you_mean(command, _SUBCOMMANDS)} (the subcommands: "
                    f"{', '.join(_SUBCOMMANDS)})"
                )
            with _as_command_line(args):
                GPUOptCLI(args=None, parser_kwargs={"exit_on_error": False})
            _close_process_group()
            return
    except CommandLineError as err:
        if debug:
            raise
        where = f"gpuopt {command}" if command in _SUBCOMMANDS else "gpuopt"
        print(f"{where}: {err}", file=sys.stderr)
        sys.exit(2)
    if status:
        sys.exit(status)


_SUBCOMMANDS = (*_TRAINER_SUBCOMMANDS, "plan", "report")


@contextmanager
def _as_command_line(args: list[str]) -> Iterator[None]:
    """Run with ``sys.argv`` as the command's own, and the current directory at the end of ``sys.path``.

    LightningCLI then reads ``sys.argv`` itself (given ``args`` as well, it warns), and Lightning's launcher
    starts the other ranks of a multi-process run with this same command line. The current directory is
    where ``python -m`` would look first; appended last, it finds a ``--model mymodel.Net`` beside the
    user and never hides an installed package.
    """
    saved = sys.argv
    sys.argv = [sys.argv[0] if sys.argv else "gpuopt", *args]
    here = os.getcwd()
    added = not directory_on_path(here)
    if added:
        sys.path.append(here)
    try:
        yield
    finally:
        sys.argv = saved
        if added and here in sys.path:
            sys.path.remove(here)


def _close_process_group() -> None:
    """Destroy the default process group a finished multi-process run leaves (Lightning does not).

    Left to the interpreter's exit, its destruction raced gloo's threads: a second node's only process
    ended with "terminate called without an active exception" (SIGABRT) after a run that had succeeded.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
