"""GPUOptReport: a per-step record of memory, split, precision and throughput, with every decision of the pack."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt import _compat, _validate
from lightning_gpuopt._metrics import is_logging_step, log_metrics
from lightning_gpuopt._warnings import warn
from lightning_gpuopt.batch_split import UnsplittableBatchError, batch_size_of
from lightning_gpuopt.callbacks.data_stall import DataStallMonitor
from lightning_gpuopt.callbacks.exact_resume import ExactResume
from lightning_gpuopt.callbacks.gradient_noise_scale import GradientNoiseScale
from lightning_gpuopt.callbacks.oom_log import OOMLog, memory_limit, state_tensors
from lightning_gpuopt.decisions import decisions, record_decision, resume_policies
from lightning_gpuopt.memory import forensics, get_probe, is_oom_error
from lightning_gpuopt.memory.forensics import MemoryHistory
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.microbatch.exchange import register_exit_grace
from lightning_gpuopt.peak_flops import resolve_peak_flops
from lightning_gpuopt.report import (
    FORMAT,
    PNG_NAME,
    ReportField,
    StepClock,
    mfu,
    precision_code,
    print_table,
    remove_rank_parts,
    render_png,
    windowed_samples_per_s,
    write_oom_pictures,
    write_rank_part,
    write_report,
)

__all__ = ["GPUOptReport", "GPUOptReportOptions"]


@dataclass(frozen=True)
class GPUOptReportOptions:
    """GPUOptReport's arguments, checked once (:class:`GPUOptReport` documents each); ``fields`` becomes a tuple."""

    dirpath: str | None = None
    plot: bool | Literal["auto"] = "auto"
    table: bool = True
    every_n_steps: int = 1
    peak_flops: float | None = None
    fields: Sequence[ReportField] = ()
    memory_history: bool | Literal["after-oom"] = "after-oom"
    history_entries: int = 100_000
    max_oom_files: int = 5

    def __post_init__(self) -> None:
        plot, table, every_n_steps, peak_flops = self.plot, self.table, self.every_n_steps, self.peak_flops
        if plot != "auto" and not isinstance(plot, bool):
            raise ValueError(f"`plot` must be True, False or 'auto', got {plot!r}")
        if not isinstance(table, bool):
            raise ValueError(f"`table` must be True or False, got {table!r}")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be a positive int, got {every_n_steps!r}")
        if peak_flops is not None and (
            isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or not peak_flops > 0
        ):
            raise ValueError(f"`peak_flops` must be a positive number of FLOP/s or None, got {peak_flops!r}")
        fields = tuple(self.fields)
        if not all(isinstance(f, ReportField) for f in fields):
            raise ValueError(
                f"`fields` must be ReportField objects, got {[type(f).__name__ for f in fields]}"
            )
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"`fields` must have distinct names, got {names}")
        _validate.choice("memory_history", self.memory_history, (True, False, "after-oom"))
        _validate.positive_int("history_entries", self.history_entries, unit="allocation events")
        _validate.positive_int("max_oom_files", self.max_oom_files, unit="files per rank")
        object.__setattr__(self, "fields", fields)


class GPUOptReport(Callback):
    """Records every training step and every decision of the pack; at the end of ``fit``, a table, a JSON and a picture.

    Per recorded step: memory allocated and peak (the memory probe), k and the micro-batch size, the
    precision, the data-wait fraction, samples and wall time, and on CUDA the model FLOPs utilisation. Every
    decision of the pack's callbacks (:mod:`lightning_gpuopt.decisions`) and every out-of-memory error the pack
    handles (the JSON's ``"ooms"``, with the bytes by category and, on CUDA, a snapshot pickle) is kept with
    its step. At the end of ``fit`` rank zero prints a summary table, writes ``gpuopt_report.json`` and
    ``gpuopt_report.png`` into ``dirpath``, and :attr:`report` holds the record; every other ending writes it
    too, without allocating on the device: a signal's stop (ExactResume) the JSON alone, an error each rank's
    record without gathering. The loggers get ``gpuopt/*`` metrics where Lightning logs the batch's values,
    on its step numbers. docs/report.md lists every field and metric.

    Args:
        dirpath: folder for the JSON and the PNG; ``None``: ``trainer.log_dir``.
        plot: draw the PNG: ``True`` (matplotlib required, checked at setup), ``False``, or ``"auto"``
            (draw when matplotlib is installed, else say once how to get it).
        table: print the summary table at the end of ``fit``.
        every_n_steps: record every n-th training step (1: all).
        peak_flops: the peak FLOP/s the MFU divides by, overriding the table (for a device it does not
            know, or another dtype's peak); given, the MFU is also computed on a CPU.
        fields: per-step fields of your own (:class:`~lightning_gpuopt.report.ReportField`): read at each
            recorded step, kept in the JSON's steps and summarised in a table row each.
        memory_history: on CUDA, record the allocator's allocations and frees with their stacks in a ring buffer
            of ``history_entries`` events, so that an OOM's snapshot pickle shows how memory filled up: ``True``
            from the start of ``fit``, ``"after-oom"`` (the default) from the first OOM on, ``False`` never.
            Without it the pickle still shows the allocator's segments at the OOM. No effect on a CPU.
        history_entries: the ring buffer's length, in allocation events.
        max_oom_files: the OOM snapshot pickles, and the OOM pictures, that each rank writes at most (trial
            steps and growing back can run out of memory many times); the records are all kept.

    Raises:
        ValueError: an argument is out of range, or two fields share a name.
        ImportError: at setup, ``plot=True`` and matplotlib is not installed (names the extra).

    Example:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> report = GPUOptReport(dirpath=tempfile.mkdtemp(), plot=False, table=False)
        >>> trainer = pl.Trainer(max_steps=3, callbacks=[report], logger=False, enable_checkpointing=False,
        ...     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(BoringModel())
        >>> [s["step"] for s in report.report["steps"]], report.report["steps"][0]["k"]
        ([0, 1, 2], 1)
    """

    def __init__(
        self,
        dirpath: str | None = None,
        plot: bool | Literal["auto"] = "auto",
        table: bool = True,
        every_n_steps: int = 1,
        peak_flops: float | None = None,
        fields: Sequence[ReportField] = (),
        memory_history: bool | Literal["after-oom"] = "after-oom",
        history_entries: int = 100_000,
        max_oom_files: int = 5,
    ) -> None:
        options = GPUOptReportOptions(
            dirpath=dirpath,
            plot=plot,
            table=table,
            every_n_steps=every_n_steps,
            peak_flops=peak_flops,
            fields=fields,
            memory_history=memory_history,
            history_entries=history_entries,
            max_oom_files=max_oom_files,
        )
        _validate.keep_options(self, options)  # as .options, and each as an attribute
        #: The record of the last ``fit`` (what ``gpuopt_report.json`` holds); empty before.
        self.report: dict[str, Any] = {}
        #: Where the last ``fit`` wrote its JSON and PNG (``None`` for a picture not drawn).
        self.paths: dict[str, str | None] = {}
        self._reset()

    def _reset(self) -> None:
        self._steps: list[dict[str, Any]] = []
        self._started = 0.0
        self._clock = StepClock()  # the step times the summary of `gpuopt fit` reads too
        self._flops: float | None = None
        self._counter: Any = None
        self._peak_flops: float | None = None
        self._mfu_note: str | None = None
        self._peak_precision = ""
        self._step = 0
        self._resumes: list[dict[str, Any]] = []
        self._earlier_decisions: list[dict[str, Any]] = []
        self._earlier_ooms: list[dict[str, Any]] = []
        self._loaded: dict[str, Any] | None = None
        self._oom: OOMLog | None = None
        self._folder: Path | None = None

    def state_dict(self) -> dict[str, Any]:
        # A resumed run's report covers the whole run: the steps and decisions before each resume travel
        # in the checkpoint (the decision log lives on the Trainer, which a resume replaces).
        if self._loaded is not None:
            return dict(self._loaded)
        trainer = getattr(self, "_trainer", None)
        current = [d.as_dict() for d in decisions(trainer)] if trainer is not None else []
        ooms = [r.as_dict() for r in self._oom.records] if self._oom is not None else []
        return {
            "steps": list(self._steps),
            "decisions": self._earlier_decisions + current,
            "resumes": list(self._resumes),
            "ooms": self._earlier_ooms + ooms,
            "world_size": int(trainer.world_size) if trainer is not None else 1,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict) if state_dict.get("steps") or state_dict.get("decisions") else None

    def _apply_loaded(self, trainer: pl.Trainer) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        self._steps = list(loaded.get("steps", [])) + self._steps
        self._earlier_decisions = list(loaded.get("decisions", []))
        self._earlier_ooms = list(loaded.get("ooms", []))
        self._resumes = list(loaded.get("resumes", []))
        engine = MicroBatchEngine.get(trainer)
        self._resumes.append(
            {
                "step": trainer.global_step,
                "steps_before": len(loaded.get("steps", [])),
                "world_size_before": int(loaded.get("world_size", trainer.world_size)),
                "world_size": int(trainer.world_size),
                "k": engine.k if engine is not None else 1,
                "policies": {
                    **_standing_policies(trainer),
                    **resume_policies(trainer),
                    **getattr(trainer.datamodule, "resume_notes", {}),
                },
            }
        )
        record_decision(
            trainer,
            "resume",
            "GPUOptReport",
            f"resumed from a checkpoint at step {trainer.global_step}; the report covers the run before it",
            resume=len(self._resumes),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_counter"] = None
        state["_trainer"] = None
        state["_oom"] = None
        return state

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.plot is True and stage == "fit":
            from lightning_gpuopt.report_plot import require_matplotlib

            require_matplotlib()  # fail now, not after a long run

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaded = self._loaded
        self._reset()
        self._loaded = loaded
        self._trainer = trainer
        self.report, self.paths = {}, {}
        self._started = time.perf_counter()
        self._peak_precision = str(trainer.precision)
        self._peak_flops, self._mfu_note = resolve_peak_flops(
            trainer.strategy.root_device, self._peak_precision, self.peak_flops
        )
        if self._mfu_note:
            rank_zero_info(f"GPUOptReport: {self._mfu_note}")
        # `trainer.log_dir` broadcasts from rank 0: every rank asks here, where every rank runs.
        self._folder = Path(self.dirpath or trainer.log_dir or trainer.default_root_dir)
        if trainer.is_global_zero:
            remove_rank_parts(self._folder)  # an earlier failed fit's
        cuda = trainer.strategy.root_device.type == "cuda"
        history = MemoryHistory(self.history_entries) if cuda and self.memory_history else None
        self._oom = OOMLog(
            trainer,
            self._folder,
            self.max_oom_files,
            history,
            self.memory_history == "after-oom",
            self._started,
        )
        if history is not None and self.memory_history is True:
            history.start()
        forensics.watch(self._oom)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply_loaded(trainer)  # every restore is done by now, whatever the strategy

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.restart()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.restart()  # validation time is neither a step nor waiting for data

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._clock.start_batch()
        self._step = trainer.global_step  # the step this batch belongs to, as decisions taken in it record
        get_probe(trainer.strategy.root_device).reset_peak()
        if self._oom is not None:
            self._oom.flush()
            if self._oom.wants_owners():  # after an OOM: measure which modules own the activations, once
                self._oom.measure_owners(pl_module)
        if self._flops is None and self._counter is None and batch_idx == 1 and self._peak_flops:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)  # one step, once: FLOPs per batch for the MFU
            self._counter.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        start, last_end = self._clock.batch_started, self._clock.last_end
        now, step_time = self._clock.end_batch(batch_idx)
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._flops, self._counter = float(self._counter.get_total_flops()), None
        engine = MicroBatchEngine.get(trainer)
        try:
            n = batch_size_of(batch)
        except UnsplittableBatchError:
            n = 1
        k = engine.effective_k(batch) if engine is not None and engine.installed("train") else 1
        if self._oom is not None:
            self._oom.owners_measured(self._step, k, -(-n // k))
            self._oom.flush()
        step = self._step
        if step % self.every_n_steps:
            return
        probe = get_probe(trainer.strategy.root_device)
        if str(trainer.precision) != self._peak_precision:  # a precision switch changes the peak
            self._peak_precision = str(trainer.precision)
            self._peak_flops, _ = resolve_peak_flops(
                trainer.strategy.root_device, self._peak_precision, self.peak_flops
            )
        monitor = next((c for c in trainer.callbacks if isinstance(c, DataStallMonitor)), None)
        if monitor is not None:
            wait = monitor.wait_fraction if monitor.measured else None
        elif step_time and start is not None and last_end is not None:
            wait = max(0.0, start - last_end) / step_time
        else:
            wait = None
        record = {
            "step": step,
            "epoch": trainer.current_epoch,
            "batch_idx": batch_idx,
            "time_s": now - self._started,
            "allocated_bytes": probe.allocated,
            "peak_bytes": probe.peak,
            "reserved_bytes": probe.reserved,
            "limit_bytes": memory_limit(probe),
            "alloc_retries": probe.alloc_retries,
            "k": k,
            "batch_size": n,
            "micro_batch_size": -(-n // k),
            "precision": str(trainer.precision),
            "data_wait_fraction": wait,
            "samples": n,
            "step_time_s": step_time,
            "mfu": mfu(self._flops, step_time, self._peak_flops),
            "noise_scale": _noise_scale(trainer),
        }
        for field in self.fields:
            record[field.name] = field.value(trainer, pl_module)
        self._steps.append(record)
        self._log(trainer, record)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        signal = _stop_signal(trainer)
        if signal is None:
            self._finish(trainer, _Ending.FIT_END)
        else:  # a preemption: its grace period is short; the next leg (or `gpuopt report`) draws the pictures
            self._finish(
                trainer,
                _Ending.SIGNAL,
                f"{signal}: ExactResume stopped the fit at step {trainer.global_step}",
            )

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Every ending leaves a record, a failed fit's above all (an OOM the pack could not recover from, an error
        # of the user's code): written without a collective (the other ranks may be gone) and without allocating
        # on the device (it may be full).
        if self._oom is not None and not self.report:
            why = f"{type(exception).__name__}: {_first_line(exception)}"
            try:
                self._finish(trainer, _Ending.ERROR, why, oom=is_oom_error(exception))
            except Exception as err:  # the fit's own error is what the user must see
                warn(
                    f"GPUOptReport: the report of this failed fit was not written: {type(err).__name__}: {err}"
                )
        self._stop_listening()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_listening()

    def _stop_listening(self) -> None:
        if self._oom is not None:
            self._oom.close()
            forensics.unwatch(self._oom)

    def _finish(
        self, trainer: pl.Trainer, ending: _Ending, why: str | None = None, oom: bool = False
    ) -> None:
        """Write the record. Nothing here allocates on the device; only a fit that ended on every rank (its end, a
        signal's stop) gathers the ranks' parts, with one object all-gather."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        oom_log = self._oom
        if oom_log is not None:
            oom_log.close()
            forensics.unwatch(oom_log)
        failed = ending is _Ending.ERROR
        mine = {
            "ooms": self._earlier_ooms_of(trainer)
            + ([r.as_dict() for r in oom_log.records] if oom_log else []),
            "peak_breakdown": _unless_failing(failed, _peak_breakdown, trainer, self._steps),
            "rank_peak": _rank_peak(trainer.global_rank, self._steps),
        }
        folder = self._folder or Path(self.dirpath or trainer.default_root_dir)
        can_draw = self.plot is True or (self.plot == "auto" and _has_matplotlib())
        draw = can_draw and ending is not _Ending.SIGNAL
        if draw and mine["ooms"]:  # every rank draws its own OOMs; the records name the pictures
            try:
                write_oom_pictures(mine["ooms"], mine["peak_breakdown"], folder, self.max_oom_files)
            except Exception as err:  # a picture must not keep this rank from the gathering below
                warn(f"GPUOptReport: the OOM pictures of rank {trainer.global_rank} were not drawn: {err}")
        ranks = [mine] if failed else _gather(trainer, mine)
        self.report = self._record(trainer, ranks, ending, why)
        if not trainer.is_global_zero:
            if failed and mine["ooms"]:  # nothing gathered: its records beside rank zero's report
                write_rank_part(mine, folder)
            return
        self._write(folder, ending, draw, can_draw, table=self.table and (not failed or oom))

    def _record(
        self, trainer: pl.Trainer, ranks: list[dict[str, Any]], ending: _Ending, why: str | None
    ) -> dict[str, Any]:
        """The report: this fit's steps and decisions, with the ranks' parts (OOM records, peaks)."""
        device = trainer.strategy.root_device
        return {
            "format": FORMAT,
            "run": {
                "device": _device_name(device),
                "memory_kind": get_probe(device).kind,
                "strategy": type(trainer.strategy).__name__,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "rank_peaks": [part["rank_peak"] for part in ranks],
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "precision_at_end": str(trainer.precision),
                "flops_per_batch": self._flops,
                "peak_flops": self._peak_flops,
                "peak_flops_source": ("peak_flops=" if self.peak_flops is not None else "table")
                if self._peak_flops
                else None,
                "mfu_note": self._mfu_note,
                "wall_s": time.perf_counter() - self._started,
                "torch": torch.__version__,
                "fields": [{"name": f.name, "label": f.label} for f in self.fields],
                "ended_by": ending.value,
                "stopped_by": why,
            },
            "steps": self._steps,
            "decisions": self._earlier_decisions + [d.as_dict() for d in decisions(trainer)],
            "resumes": self._resumes,
            "ooms": sorted(
                (r for part in ranks for r in part["ooms"]), key=lambda r: (r["rank"], r["time_s"])
            ),
            "peak_breakdowns": [part["peak_breakdown"] for part in ranks if part["peak_breakdown"]],
        }

    def _write(self, folder: Path, ending: _Ending, draw: bool, can_draw: bool, table: bool) -> None:
        """Rank zero: the JSON first, then the picture and the table."""
        json_path, png_path = write_report(self.report, folder, png=False)
        if draw:
            try:
                png_path = render_png(self.report, folder / PNG_NAME)
            except Exception as err:  # the JSON is written; `gpuopt report` can draw it later
                warn(f"GPUOptReport: {PNG_NAME} was not drawn ({err}); `gpuopt report {folder}` draws it.")
        self.paths = {"json": str(json_path), "png": str(png_path) if png_path else None}
        if self.plot == "auto" and not can_draw:
            warn(
                "GPUOptReport: matplotlib is not installed, so no gpuopt_report.png was drawn; install the plot "
                "extra (pip install 'lightning_gpuopt[plot]') and run `gpuopt report "
                f"{folder}` to draw it from the JSON."
            )
        if table:  # not after an error of the user's code: its traceback says what happened
            print_table(self.report)
        wrote = f"GPUOptReport: wrote {json_path}" + (f" and {png_path}" if png_path else "")
        if ending is _Ending.SIGNAL and can_draw:
            wrote += f"; `gpuopt report {folder}` draws the picture (so does the resumed run)"
        rank_zero_info(wrote)

    def _earlier_ooms_of(self, trainer: pl.Trainer) -> list[dict[str, Any]]:
        """This rank's records from before a resume (the checkpoint holds every rank's: rank zero saved them)."""
        return [r for r in self._earlier_ooms if r.get("rank", 0) == trainer.global_rank]

    def _log(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        if not is_logging_step(trainer) or trainer.global_rank != 0:
            return
        rates = windowed_samples_per_s(self._steps[-10:])
        metrics = {
            "gpuopt/memory_allocated": float(record["allocated_bytes"]),
            "gpuopt/memory_peak": float(record["peak_bytes"]),
            "gpuopt/k": float(record["k"]),
            "gpuopt/micro_batch_size": float(record["micro_batch_size"]),
        }
        code = precision_code(record["precision"])
        if code is not None:
            metrics["gpuopt/precision"] = code
        # With a DataStallMonitor, the wait is its `gpuopt/data_wait_fraction` (one source per name).
        if record["data_wait_fraction"] is not None and not _has(trainer, DataStallMonitor):
            metrics["gpuopt/data_wait"] = float(record["data_wait_fraction"])
        if rates and rates[-1] is not None:
            metrics["gpuopt/samples_per_s"] = float(rates[-1])
        if record["mfu"] is not None:
            metrics["gpuopt/mfu"] = float(record["mfu"])
        log_metrics(trainer, metrics)


class _Ending(Enum):
    """How a fit ended, for what its report does."""

    #: ``fit`` returned: every rank gathers its part, rank zero writes the JSON and draws.
    FIT_END = "fit end"
    #: ExactResume stopped the fit for a signal: gathered and written; the pictures wait for the next leg.
    SIGNAL = "signal"
    #: An exception: each rank on its own, nothing gathered (the other ranks may be gone).
    ERROR = "error"


def _stop_signal(trainer: pl.Trainer) -> str | None:
    """The signal that asked ExactResume to stop this fit, if any."""
    resume = next((c for c in trainer.callbacks if isinstance(c, ExactResume)), None)
    return resume.stop_signal if resume is not None else None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def _unless_failing(failed: bool, read: Any, *args: Any) -> Any:
    """``read(*args)``; after an error, ``None`` where it fails (the record must still be written)."""
    if not failed:
        return read(*args)
    try:
        return read(*args)
    except Exception:
        return None


def _rank_peak(rank: int, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """This rank's highest step peak and its last memory limit (plain numbers: nothing on the device)."""
    limit = next((s["limit_bytes"] for s in reversed(steps) if s.get("limit_bytes")), None)
    return {
        "rank": rank,
        "peak_bytes": max((s["peak_bytes"] for s in steps), default=0),
        "limit_bytes": limit,
    }


def _distributed(trainer: pl.Trainer) -> bool:
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def _gather(trainer: pl.Trainer, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """``mine`` from every rank, in rank order: one object all-gather, after a fit every rank ended (gloo: in
    host memory; NCCL: a few kilobytes staged on the device, which the last step's peak has just freed)."""
    if not _distributed(trainer):
        return [mine]
    register_exit_grace()  # torch frees the collective's tensors on gloo's worker thread
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    return parts


def _peak_breakdown(trainer: pl.Trainer, steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The step with the highest peak on this rank, its parameters, gradients and optimizer state (the training
    state, measured now: the same through every step after the first) and the rest as activations and other."""
    if not steps:
        return None
    top = max(steps, key=lambda s: s["peak_bytes"])
    params, grads, state = state_tensors(trainer)
    categories = forensics.categories_now(
        top["peak_bytes"], trainer.strategy.root_device, params, grads, state, activations=False
    )
    return {
        "rank": trainer.global_rank,
        "step": top["step"],
        "peak_bytes": top["peak_bytes"],
        "limit_bytes": top.get("limit_bytes"),
        "micro_batch_size": top.get("micro_batch_size"),
        "categories": categories,
        "activations_measured": False,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            return f"{torch.cuda.get_device_name(device)} ({device})"
        except Exception:  # after a CUDA error the device may not answer: the record is written anyway
            return str(device)
    return str(device)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _has(trainer: pl.Trainer, kind: type) -> bool:
    return any(isinstance(c, kind) for c in trainer.callbacks)


def _noise_scale(trainer: pl.Trainer) -> float | None:
    """GradientNoiseScale's trusted estimate now (``None`` without one, or until it is trusted)."""
    noise = next((c for c in trainer.callbacks if isinstance(c, GradientNoiseScale)), None)
    return noise.estimate if noise is not None else None


def _standing_policies(trainer: pl.Trainer) -> dict[str, str]:
    """What a resume does with the state whose policy does not depend on the checkpoint (the rest is noted by the
    callbacks and the datamodule that apply it)."""
    strategy, world = trainer.strategy, trainer.world_size
    if isinstance(strategy, ModelParallelStrategy | FSDPStrategy):  # the model is sharded
        model = (
            f"resharded over {world} rank(s) by torch.distributed.checkpoint"
            if _compat.saves_distributed_checkpoint(strategy)
            else f"the checkpoint's whole state, sharded over {world} rank(s) as it loads"
        )
    else:
        model = "the checkpoint's (every rank held the same)"
    policies = {"model and optimizer": model}
    if MicroBatchEngine.get(trainer) is not None:
        policies["k"] = "the checkpoint's (agreed across ranks, saved once), then follows this run's memory"
    if any(isinstance(cb, GradientNoiseScale) for cb in trainer.callbacks):
        policies["gradient noise scale"] = "the checkpoint's averages (agreed across ranks, saved once)"
    return policies
