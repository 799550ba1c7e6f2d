"""The ``gpuopt`` command: a LightningCLI for any LightningModule and LightningDataModule, by class path.

Examples:
    gpuopt fit --config examples/configs/default.yaml
    gpuopt fit --model lightning.pytorch.demos.boring_classes.DemoModel \\
               --data lightning.pytorch.demos.boring_classes.BoringDataModule --trainer.max_steps 5
    gpuopt report lightning_logs/version_0       # the run's report table and picture, again
    python -m lightning_gpuopt fit --help
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt._summary import RunSummary
from lightning_gpuopt.callbacks import GPUOptReport, OOMRecovery
from lightning_gpuopt.microbatch import unsupported_strategy

__all__ = ["GPUOptCLI", "main", "report_command", "run"]

_DESCRIPTION = (
    "gpuopt: train any LightningModule with lightning_gpuopt's memory, precision and data tuning. "
    "Pick the model and data by class path (--model, --data) or in a config file (--config). "
    "`gpuopt report RUN_DIR` prints a finished run's report table and draws its picture again."
)


class GPUOptCLI(LightningCLI):
    """LightningCLI with the pack's defaults: ``fit``, ``validate``, ``test`` and ``predict``.

    Any LightningModule (``--model``) and LightningDataModule (``--data``) can be given by class
    path, not only the pack's own. Options of the pack are under ``--gpuopt.*``:

    * ``--gpuopt.summary`` (default true): after ``fit``, print one summary line with the final
      validation metrics, training samples/s and peak memory.
    * ``--gpuopt.oom_recovery`` (default true): add :class:`~lightning_gpuopt.OOMRecovery` to ``fit``
      on a single device or under DDP, unless ``--trainer.callbacks`` already has one.
    * ``--gpuopt.report`` (default true): add :class:`~lightning_gpuopt.GPUOptReport` to ``fit``
      (table, ``gpuopt_report.json`` and ``.png`` in the run's log directory), unless
      ``--trainer.callbacks`` already has one.

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
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        parser_kwargs = dict(kwargs.pop("parser_kwargs", None) or {})
        parser_kwargs.setdefault("description", _DESCRIPTION)
        kwargs["parser_kwargs"] = parser_kwargs
        self.summary: RunSummary | None = None
        super().__init__(*args, **kwargs)

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
            help="Add OOMRecovery to fit on a single device or under DDP (re-split a batch that runs out of memory "
            "and retry on every rank), "
            "unless trainer.callbacks has one.",
        )
        parser.add_argument(
            "--gpuopt.report",
            type=bool,
            default=True,
            help="Add GPUOptReport to fit (summary table, gpuopt_report.json and gpuopt_report.png in the run's log "
            "directory), unless trainer.callbacks has one.",
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        if self.subcommand in (None, "fit") and self._gpuopt_option("summary"):
            self.summary = RunSummary()
            user_callbacks = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
            if not isinstance(user_callbacks, list):
                user_callbacks = [user_callbacks]
            kwargs["callbacks"] = [*user_callbacks, self.summary, *kwargs.get("callbacks", [])]
        trainer = super().instantiate_trainer(**kwargs)
        if self.subcommand in (None, "fit") and self._gpuopt_option("oom_recovery"):
            self._add_oom_recovery(trainer)
        if self.subcommand in (None, "fit") and self._gpuopt_option("report"):
            if not any(isinstance(cb, GPUOptReport) for cb in trainer.callbacks):
                trainer.callbacks.append(GPUOptReport())
        return trainer

    @staticmethod
    def _add_oom_recovery(trainer: Trainer) -> None:
        if any(isinstance(cb, OOMRecovery) for cb in trainer.callbacks):
            return
        reason = unsupported_strategy(trainer.strategy)
        if reason is not None:
            rank_zero_info(f"gpuopt: OOMRecovery not added: {reason}")
            return
        trainer.callbacks.append(OOMRecovery())

    def _gpuopt_option(self, name: str) -> Any:
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        return config.get(f"gpuopt.{name}")


def run(args: list[str] | None = None) -> GPUOptCLI:
    """Run the command line ``args`` (default: ``sys.argv[1:]``) and return the CLI, for use from Python."""
    return GPUOptCLI(args=args)


def report_command(args: list[str]) -> int:
    """``gpuopt report RUN_DIR``: print the report table of a finished run and draw its picture again.

    Returns the exit status: 0, or 2 for a directory without a report (the message says what to pass).
    """
    from lightning_gpuopt.report import PNG_NAME, load_report, print_table, render_png

    parser = argparse.ArgumentParser(
        prog="gpuopt report", description="Print a finished run's GPUOptReport table and draw gpuopt_report.png again.")
    parser.add_argument("run_dir", help="the run's log directory (holding gpuopt_report.json), or the JSON file")
    parser.add_argument("--out", default=None, help="folder for the picture (default: next to the JSON)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    options = parser.parse_args(args)
    try:
        report = load_report(options.run_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"gpuopt report: {err}", file=sys.stderr)
        return 2
    print_table(report, title=f"gpuopt report: {options.run_dir}")
    if not options.no_plot:
        from pathlib import Path

        folder = Path(options.out) if options.out else Path(options.run_dir if Path(options.run_dir).is_dir()
                                                             else Path(options.run_dir).parent)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            print(f"wrote {render_png(report, folder / PNG_NAME)}")
        except ImportError as err:
            print(f"gpuopt report: {err}", file=sys.stderr)
    return 0


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``gpuopt`` console script and of ``python -m lightning_gpuopt``.

    ``report`` is handled here; every other subcommand goes to :class:`GPUOptCLI`. Returns nothing
    after a successful run, so the console script's exit status is 0.
    """
    args = sys.argv[1:] if args is None else list(args)
    if args[:1] == ["report"]:
        status = report_command(args[1:])
        if status:
            sys.exit(status)
        return
    run(args)
