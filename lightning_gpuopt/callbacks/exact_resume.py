"""ExactResume: a run killed at any step and resumed from its last checkpoint trains like the run never stopped."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt import _compat
from lightning_gpuopt._validate import choice
from lightning_gpuopt.callbacks.adaptive_batch_size import AdaptiveBatchSize
from lightning_gpuopt.data import GPUOptDataModule
from lightning_gpuopt.data.resume import capture_rng, derive_rng, elastic_size, restore_rng
from lightning_gpuopt.decisions import note_resume_policy, record_decision

__all__ = ["ExactResume", "StepBoundaryCheckpoint", "at_optimizer_step_boundary", "slurm_requeue_command"]

_SIGNALS = ("SIGTERM", "SIGUSR1")
Elastic = Literal["keep_optimizer_batch", "keep_per_rank"]


def at_optimizer_step_boundary(batch_idx: int, accumulate_grad_batches: int, is_last_batch: bool) -> bool:
    """Whether the optimizer has just stepped after training batch ``batch_idx`` (no accumulation window open).

    Example:
        >>> [at_optimizer_step_boundary(i, 2, is_last_batch=i == 4) for i in range(5)]
        [False, True, False, True, True]
    """
    return (batch_idx + 1) % accumulate_grad_batches == 0 or is_last_batch


def slurm_requeue_command(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """``scontrol requeue JOB`` for this SLURM job (array jobs: ``ARRAYJOB_TASK``); ``None`` outside SLURM.

    Example:
        >>> slurm_requeue_command({"SLURM_JOB_ID": "123"})
        ['scontrol', 'requeue', '123']
        >>> slurm_requeue_command({"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "9"})
        ['scontrol', 'requeue', '7_2']
    """
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}" if array_job else environ.get("SLURM_JOB_ID")
    return ["scontrol", "requeue", job] if job else None


#: Lightning's logger of ``rank_zero_info`` (its fit loop says why ``fit`` stopped there).
_LIGHTNING_LOG = "lightning.pytorch.utilities.rank_zero"
_LIMIT_REACHED = re.compile(r"^`Trainer\.fit` stopped: `max_(epochs|steps)=.*` reached\.$")


class _SignalStopFilter(logging.Filter):
    """Drops Lightning's "`Trainer.fit` stopped: `max_epochs=1` reached." after a stop by a signal.

    A signal stop ends the epoch early, and Lightning then counts it as processed and names the epoch
    limit as the reason (when it was the last epoch), which is not why the run stopped; ExactResume has
    said why already.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not _LIMIT_REACHED.match(record.getMessage())


def _gather(trainer: pl.Trainer, value: Any) -> list[Any]:
    """Every rank's ``value``, by global rank (``[value]`` in one process)."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        values: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(values, value)
        return values
    return [value]


class StepBoundaryCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that saves during an epoch only where the optimizer has just stepped.

    With ``accumulate_grad_batches`` > 1 a time-based trigger (``train_time_interval``) can fall inside
    an accumulation window, whose partial gradients a checkpoint does not hold; this one waits for the
    window's last batch. It never writes a checkpoint when an exception stops the run, whatever
    ``save_on_exception`` says: a checkpoint written mid-step is never one ``ckpt_path="last"`` may pick.
    Takes every ``ModelCheckpoint`` argument.
    """

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if at_optimizer_step_boundary(batch_idx, trainer.accumulate_grad_batches, last):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        return None


class ExactResume(Callback):
    """Resume exactly: RNG streams as of the checkpoint, preemption signals stop at an optimizer-step boundary.

    With :class:`~lightning_gpuopt.GPUOptDataModule` (whose training loader resumes at the next unseen
    sample) a run killed at any step and resumed from its last checkpoint sees every remaining sample of
    the epoch once, in the uninterrupted order, and draws the same random numbers (dropout, random
    augmentation), so its parameters equal the uninterrupted run's.

    Each checkpoint holds every rank's torch, Python, NumPy (and CUDA) RNG states, restored just before the
    first training batch. ``signals`` (default ``SIGTERM`` and ``SIGUSR1``, also SLURM's requeue signal) stop
    every rank together at the next optimizer-step boundary with ``last.ckpt`` written (exit status 0).
    Resuming from a checkpoint not written at such a boundary of a run without an exception raises a clear
    error.

    A checkpoint resumes on another number of ranks too: the epoch goes on past the samples it consumed, dealt
    over the new ranks, and each rank's RNG streams are derived from (seed, step, rank), so that such a resume is
    reproducible. The long form: docs/resume.md.

    Args:
        signals: names of the signals that ask for a stop (``"SIGTERM"``, ``"SIGUSR1"``, ...); ``()``: none.
        restore_rng: restore the RNG states on resume.
        elastic: on a resume on another number of ranks, keep the optimizer batch (``"keep_optimizer_batch"``:
            a :class:`~lightning_gpuopt.GPUOptDataModule`'s per-rank ``batch_size`` becomes the checkpoint's
            ``ranks x batch_size`` over this run's ranks; with a loader of your own, ``accumulate_grad_batches``
            becomes the checkpoint's ``ranks x accumulate_grad_batches`` over them) or the per-rank batch
            (``"keep_per_rank"``: the optimizer batch changes with the ranks).

    Raises:
        ValueError: a signal name is not a signal of this platform, or ``elastic`` is not one of its choices.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[ExactResume()], logger=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        signals: tuple[str, ...] | list[str] = _SIGNALS,
        restore_rng: bool = True,
        elastic: Elastic = "keep_optimizer_batch",
    ) -> None:
        names = tuple(signals)
        for name in names:
            if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals):
                raise ValueError(
                    f"`signals` must name signals of this platform (like 'SIGTERM'), got {name!r}; pass () for none"
                )
        if not isinstance(restore_rng, bool):
            raise ValueError(f"`restore_rng` must be True or False, got {restore_rng!r}")
        self.signals = names
        self.restore_rng = restore_rng
        self.elastic = choice("elastic", elastic, Elastic)
        #: The signal that asked this run to stop, if any (its name).
        self.stop_signal: str | None = None
        #: Where the last signal-triggered stop wrote its checkpoint (``None`` before any).
        self.stop_checkpoint: str | None = None
        #: Whether the command that started this run, started again, resumes it: ``gpuopt fit`` sets it when it
        #: finds the run's checkpoint folder again. The stop line then says so instead of naming the file.
        self.same_command_resumes = False
        self._trainer: pl.Trainer | None = None
        self._pending: dict[str, Any] | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._failed = False
        self._boundary = True
        self._validation_due = False
        self._log_filter: _SignalStopFilter | None = None
        self._configured_accumulate = 1
        self._elastic_accumulate: int | None = None  # set by a resume on another number of ranks, said once

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_trainer"], state["_previous_handlers"], state["_log_filter"] = None, {}, None
        return state

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:  # loaded and not applied yet: hand it on unchanged
            return dict(self._pending)
        trainer = self._trainer
        rng = [capture_rng()] if trainer is None else _gather(trainer, capture_rng())
        return {
            "rng": rng,
            "clean": not self._failed and self._boundary,
            "world_size": len(rng),
            "accumulate_grad_batches": trainer.accumulate_grad_batches if trainer is not None else 1,
            "configured_accumulate_grad_batches": self._configured_accumulate,
            "validation_due": self._validation_due,
            "validation_epoch": trainer.current_epoch if trainer is not None else 0,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict.get("clean", True):
            raise ValueError(
                "ExactResume: this checkpoint was written mid-step (after an exception, or inside an "
                "accumulation window), so resuming from it would lose or repeat work; resume from an earlier "
                "checkpoint (`ckpt_path=` a file written at an optimizer-step boundary) or start again."
            )
        wanted = state_dict.get("rng") or state_dict.get("validation_due")
        self._pending = dict(state_dict) if wanted else None
        trainer = self._trainer
        if trainer is not None and state_dict.get("rng"):
            before = len(state_dict["rng"])
            if not self.restore_rng:
                policy = "not restored (restore_rng=False)"
            elif before == trainer.world_size:
                policy = "restored, each rank's"
            else:
                policy = f"re-derived from (seed, step, rank): the checkpoint holds {before} rank(s)' states"
            note_resume_policy(trainer, "rng", policy)
            if before != trainer.world_size and not isinstance(trainer.datamodule, GPUOptDataModule):
                self._keep_optimizer_batch(trainer, before, state_dict)

    def _keep_optimizer_batch(self, trainer: pl.Trainer, before_world: int, state: dict[str, Any]) -> None:
        """On another number of ranks with a loader that is not the pack's (whose per-rank batch size it cannot set),
        the ``accumulate_grad_batches`` that keeps the checkpoint's optimizer batch, said in one line."""
        before = state.get("accumulate_grad_batches")
        if before is None:
            return  # a checkpoint from before the pack saved it
        world = trainer.world_size
        resumed = f"ExactResume: resumed on {world} rank(s) from a checkpoint of {before_world} rank(s)"
        setter = next(
            (
                c
                for c in trainer.callbacks
                if isinstance(c, GradientAccumulationScheduler | AdaptiveBatchSize)
            ),
            None,
        )
        if trainer.strategy.handles_gradient_accumulation or setter is not None:
            if setter is None:
                who, how = (
                    type(trainer.strategy).__name__,
                    "its own configuration's accumulation is used as it is",
                )
            elif isinstance(setter, AdaptiveBatchSize):
                who, how = (
                    "AdaptiveBatchSize",
                    f"it goes on from the checkpoint's accumulate_grad_batches={before}, then its own measurements",
                )
            else:
                who, how = (
                    "GradientAccumulationScheduler",
                    f"scale its scheduling by {before_world}/{world} to keep it",
                )
            note_resume_policy(trainer, "accumulate_grad_batches", f"set by {who}")
            rank_zero_info(
                f"{resumed}; {who} sets the accumulation, so the optimizer batch is not kept by ExactResume: {how}."
            )
            return
        current = int(trainer.accumulate_grad_batches)
        size, note, line = elastic_size(
            "accumulate_grad_batches",
            int(before),
            before_world,
            world,
            current,
            given=current != int(state.get("configured_accumulate_grad_batches", before)),
            keep_per_rank=self.elastic == "keep_per_rank",
        )
        trainer.accumulate_grad_batches = size
        self._elastic_accumulate = size
        note_resume_policy(trainer, "accumulate_grad_batches", note)
        rank_zero_info(f"ExactResume: {line}")

    def _say_partial_first_step(self, trainer: pl.Trainer) -> None:
        """Lightning steps the optimizer where the epoch's batch count divides by ``accumulate_grad_batches``: after a
        resume mid-epoch with another one, the first step may accumulate fewer batches. Said in one line."""
        accumulate, self._elastic_accumulate = self._elastic_accumulate, None
        done = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        if accumulate is None or done % accumulate == 0:
            return
        rank_zero_info(
            f"ExactResume: the first optimizer step after this resume accumulates {accumulate - done % accumulate} "
            f"batch(es), not {accumulate}: Lightning counts accumulation from the epoch's first batch, and the epoch "
            f"resumed after {done}; from the next step on, each has {accumulate}."
        )

    # ------------------------------------------------------------------ hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        # This run's own, before a resume on another number of ranks changes it: what its checkpoints hold.
        self._configured_accumulate = int(trainer.accumulate_grad_batches)
        if isinstance(trainer.datamodule, GPUOptDataModule):  # it applies the policy when its state is loaded
            trainer.datamodule.elastic = self.elastic
        self._failed = False
        self._validation_due = False
        self.stop_signal = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed from an epoch's last batch: the next epoch starts as an epoch (counted, its hooks called).
        _compat.end_restart_at_epoch_end(trainer)
        self._say_partial_first_step(trainer)
        if self._pending is not None and self._pending.get("validation_due"):
            self._run_skipped_validation(trainer)
        # Lightning registered its handlers just before training; ours replace them until training ends.
        if threading.current_thread() is not threading.main_thread():
            return
        names = set(self.signals)
        environment = _compat.cluster_environment(trainer)
        if names and isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            requeue = environment.requeue_signal
            if requeue is not None:
                names.add(
                    signal.Signals(requeue).name
                )  # Lightning's requeue signal: stop cleanly, then requeue
        for name in sorted(names):
            signum = getattr(signal, name)
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _run_skipped_validation(self, trainer: pl.Trainer) -> None:
        """The validation that was due at the step a signal stopped, which the stop skipped: run first, from the
        random state it would have started from, and the training goes on from the state it leaves."""
        assert self._pending is not None
        states = self._pending.get("rng") or []
        rank = trainer.global_rank
        exact = self.restore_rng and len(states) == trainer.world_size and rank < len(states)
        if exact:
            restore_rng(states[rank])
        _compat.run_validation(trainer, int(self._pending.get("validation_epoch", trainer.current_epoch)))
        if exact:
            states = list(states)
            states[rank] = capture_rng()
            self._pending["rng"] = states
        self._pending["validation_due"] = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: collectives and file writes wait for the next optimizer-step boundary.
        self.stop_signal = signal.Signals(signum).name

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        pending, self._pending = self._pending, None
        if pending is None or not self.restore_rng:
            return
        states = pending.get("rng") or []
        rank = trainer.global_rank
        if len(states) != trainer.world_size or rank >= len(states):
            derive_rng(trainer.global_step, rank)
            rank_zero_info(
                f"ExactResume: the checkpoint holds RNG states of {len(states)} rank(s), this run has "
                f"{trainer.world_size}; each rank's RNG streams are derived from (seed, step {trainer.global_step}, "
                "rank) instead."
            )
            return
        restore_rng(states[rank])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        self._boundary = at_optimizer_step_boundary(batch_idx, trainer.accumulate_grad_batches, last)
        if not self._boundary or not self.signals:
            return
        # Every rank reaches this point at every optimizer step, so the vote cannot hang.
        stop = trainer.strategy.reduce_boolean_decision(self.stop_signal is not None, all=False)
        if stop:
            self._stop(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._boundary = True  # the epoch's last batch always steps

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._failed = True  # a checkpoint written from here on is not one to resume from

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()
        self._remove_log_filter()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_handlers()
        self._remove_log_filter()

    def _remove_log_filter(self) -> None:
        if self._log_filter is not None:
            logging.getLogger(_LIGHTNING_LOG).removeFilter(self._log_filter)
            self._log_filter = None

    # ------------------------------------------------------------------ stop

    def _stop(self, trainer: pl.Trainer) -> None:
        path = self._last_path(trainer)
        why = self.stop_signal or "another rank's signal"
        how = "the same command resumes" if self.same_command_resumes else f"resume with ckpt_path={path!r}"
        # Recorded before the save, so that the checkpoint's report holds it: the resumed run's report shows it.
        record_decision(
            trainer,
            "stop",
            "ExactResume",
            f"{why} at step {trainer.global_step}: checkpoint {path} written at the optimizer-step boundary; "
            f"stopping every rank; {how}.",
            signal=why,
            path=path,
            same_command_resumes=self.same_command_resumes,
        )
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                # Lightning's own skip rule: nothing more is saved at this step (the epoch-end save of a
                # stopped epoch would mark the epoch finished and lose its remaining samples on resume), nor at
                # train end (`save_last`). Marked before the save, so that the checkpoint's own state names `path`
                # as its last: the resumed run then writes last.ckpt again, not a new last-v1.ckpt.
                _compat.mark_checkpoint_saved(callback, trainer.global_step, path)
        # A stop makes Lightning validate after this batch: a whole pass, which can outlast a preemption's grace
        # period. Skipped; a validation that was due here anyway runs first when the run resumes (the checkpoint
        # says so), so the run validates where and as the uninterrupted one does.
        self._validation_due = _compat.validation_due(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # a full checkpoint (and Lightning says nothing)
        self.stop_checkpoint = path
        trainer.should_stop = True
        _compat.skip_next_validation(trainer)
        environment = _compat.cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and trainer.is_global_zero:
            command = slurm_requeue_command()
            if command is not None:
                status = subprocess.call(command)
                rank_zero_info(f"ExactResume: `{' '.join(command)}` exited with {status}.")
        if self._log_filter is None:
            self._log_filter = _SignalStopFilter()
            logging.getLogger(_LIGHTNING_LOG).addFilter(self._log_filter)
        rank_zero_info(f"ExactResume: stopped by {why} at step {trainer.global_step}: wrote {path}; {how}.")

    @staticmethod
    def _last_path(trainer: pl.Trainer) -> str:
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}
