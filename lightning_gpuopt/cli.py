"""The ``gpuopt`` command: a LightningCLI for any LightningModule and LightningDataModule, by class path.

Examples:
    gpuopt fit --config examples/configs/default.yaml
    gpuopt fit --model lightning.pytorch.demos.boring_classes.DemoModel \\
               --data lightning.pytorch.demos.boring_classes.BoringDataModule --trainer.max_steps 5
    python -m lightning_gpuopt fit --help
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt._summary import RunSummary
from lightning_gpuopt.callbacks import OOMRecovery, PrecisionSwitch

__all__ = ["GPUOptCLI", "main", "run"]

_DESCRIPTION = (
    "gpuopt: train any LightningModule with lightning_gpuopt's memory, precision and data tuning. "
    "Pick the model and data by class path (--model, --data) or in a config file (--config)."
)


class GPUOptCLI(LightningCLI):
    """LightningCLI with the pack's defaults: ``fit``, ``validate``, ``test`` and ``predict``.

    Any LightningModule (``--model``) and LightningDataModule (``--data``) can be given by class
    path, not only the pack's own. Options of the pack are under ``--gpuopt.*``:

    * ``--gpuopt.summary`` (default true): after ``fit``, print one summary line with the final
      validation metrics, training samples/s and peak memory.
    * ``--gpuopt.oom_recovery`` (default true): add :class:`~lightning_gpuopt.OOMRecovery` to ``fit``
      on a single device, unless ``--trainer.callbacks`` already has one.
    * ``--gpuopt.precision_switch`` (default true): add :class:`~lightning_gpuopt.PrecisionSwitch` to
      ``fit``, unless ``--trainer.callbacks`` already has one: ``initial="auto"`` (the fastest precision
      the hardware runs natively), or ``initial="keep"`` when ``--trainer.precision`` (or a precision
      plugin in ``--trainer.plugins``) is given.

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
            help="Add OOMRecovery to fit on a single device (re-split a batch that runs out of memory and retry), "
            "unless trainer.callbacks has one.",
        )
        parser.add_argument(
            "--gpuopt.precision_switch",
            type=bool,
            default=True,
            help="Add PrecisionSwitch to fit (the fastest precision the hardware runs natively, a more stable one on "
            "non-finite values), unless trainer.callbacks has one; it keeps --trainer.precision when that is given.",
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
        if self.subcommand in (None, "fit") and self._gpuopt_option("precision_switch"):
            self._add_precision_switch(trainer)
        return trainer

    def _add_precision_switch(self, trainer: Trainer) -> None:
        if any(isinstance(cb, PrecisionSwitch) for cb in trainer.callbacks):
            return
        config = self._get(self.config_init, "trainer", default={})
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        given = config.get("precision") is not None or any(isinstance(p, Precision) for p in plugins)
        trainer.callbacks.append(PrecisionSwitch(initial="keep" if given else "auto"))

    @staticmethod
    def _add_oom_recovery(trainer: Trainer) -> None:
        if any(isinstance(cb, OOMRecovery) for cb in trainer.callbacks):
            return
        if not isinstance(trainer.strategy, SingleDeviceStrategy):
            rank_zero_info(
                f"gpuopt: OOMRecovery not added: it supports single-device training in this version "
                f"(strategy {type(trainer.strategy).__name__})."
            )
            return
        trainer.callbacks.append(OOMRecovery())

    def _gpuopt_option(self, name: str) -> Any:
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        return config.get(f"gpuopt.{name}")


def run(args: list[str] | None = None) -> GPUOptCLI:
    """Run the command line ``args`` (default: ``sys.argv[1:]``) and return the CLI, for use from Python."""
    return GPUOptCLI(args=args)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``gpuopt`` console script and of ``python -m lightning_gpuopt``.

    Returns nothing, so the console script's exit status is 0 after a successful run.
    """
    run(args)
