"""The one way the pack's callbacks send ``gpuopt/*`` metrics to the Trainer's loggers.

Rank zero sends floats straight to each logger: ``LightningModule.log`` would make a device tensor of each
host float, a blocking copy at every step. The step number is the one Lightning gives the batch's own rows
(the optimizer steps taken before it), so a ``gpuopt/*`` value lines up with the ``self.log`` values of the
same batch. Each name has one owner; docs/report.md ("The logger") lists them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_gpuopt._compat import logger_step, should_accumulate

__all__ = ["is_logging_step", "log_metrics"]


def is_logging_step(trainer: Any) -> bool:
    """Whether Lightning logs the current training batch's values: the last batch of an accumulation window, at
    every ``log_every_n_steps``-th step."""
    every = trainer.log_every_n_steps
    if every <= 0 or should_accumulate(trainer):
        return False
    return (logger_step(trainer) + 1) % every == 0


def log_metrics(trainer: Any, metrics: Mapping[str, float], every_n_steps: bool = False) -> None:
    """Send ``metrics`` from rank zero to every logger, at Lightning's step for the current training batch.

    Args:
        trainer: the Trainer, inside a training batch's hooks.
        metrics: ``gpuopt/*`` names and their values.
        every_n_steps: send only where Lightning logs the batch's own values (:func:`is_logging_step`); else at
            once (an event: a switch, a decision).
    """
    if trainer.global_rank != 0 or not trainer.loggers or not metrics:
        return
    if every_n_steps and not is_logging_step(trainer):
        return
    step = logger_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)
