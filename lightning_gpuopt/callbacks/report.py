"""GPUOptReport: a per-step record of memory, split, precision and throughput, with every decision of the pack."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt._warnings import warn
from lightning_gpuopt.batching import UnsplittableBatchError, batch_size_of
from lightning_gpuopt.callbacks.data_stall import DataStallMonitor
from lightning_gpuopt.decisions import decisions, record_decision
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.peak_flops import resolve_peak_flops
from lightning_gpuopt.report import (
    FORMAT,
    ReportField,
    StepClock,
    mfu,
    print_table,
    windowed_samples_per_s,
    write_report,
)

__all__ = ["GPUOptReport"]


class GPUOptReport(Callback):
    """Records every training step and every decision of the pack; at the end of ``fit``, a table, a JSON and a picture.

    Per recorded step (``step``: the global step the batch belongs to, as decisions record it):
    memory allocated after the step and the step's peak (from the memory probe:
    the CUDA caching allocator, SimulatedMemory, or the host's RSS on CPU), the memory limit, k and the
    micro-batch size (from the micro-batch engine when OOMRecovery or MemoryAwareBatchSize run), the
    Trainer's precision, the data-wait fraction (DataStallMonitor's when it runs, else the host's
    wait before each step), samples and wall time per step, and on CUDA the model FLOPs utilisation
    (FLOPs of one training step counted once with ``torch.utils.flop_counter``, over the device's
    dense peak FLOP/s for the step's compute dtype from :mod:`lightning_gpuopt.peak_flops`, or
    ``peak_flops``; on a CUDA device the table does not know, the report says
    ``MFU unknown for NAME (pass peak_flops=)``). Every decision the pack's callbacks record
    (:mod:`lightning_gpuopt.decisions`: OOM retries, changes of k, growing back, precision switches,
    batch-size searches, worker changes) is kept with its step and reason.

    At the end of ``fit``, rank zero prints a summary table (rich when installed), writes
    ``gpuopt_report.json`` and ``gpuopt_report.png`` (memory over steps with the decisions marked,
    throughput over steps) into ``dirpath`` (default: the run's log directory, ``trainer.log_dir``), and
    :attr:`report` holds the record. ``gpuopt report DIR`` draws the table and the picture again from
    the JSON. Memory and throughput also go to the Trainer's loggers every ``log_every_n_steps``
    (``gpuopt/memory_allocated``, ``gpuopt/memory_peak``, ``gpuopt/samples_per_s``, ``gpuopt/mfu`` on CUDA).

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
    ) -> None:
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
        fields = tuple(fields)
        if not all(isinstance(f, ReportField) for f in fields):
            raise ValueError(
                f"`fields` must be ReportField objects, got {[type(f).__name__ for f in fields]}"
            )
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"`fields` must have distinct names, got {names}")
        self.fields = fields
        self.peak_flops = peak_flops
        self.dirpath = dirpath
        self.plot = plot
        self.table = table
        self.every_n_steps = every_n_steps
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
        self._loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        # A resumed run's report covers the whole run: the steps and decisions before each resume travel
        # in the checkpoint (the decision log lives on the Trainer, which a resume replaces).
        if self._loaded is not None:
            return dict(self._loaded)
        trainer = getattr(self, "_trainer", None)
        current = [d.as_dict() for d in decisions(trainer)] if trainer is not None else []
        return {
            "steps": list(self._steps),
            "decisions": self._earlier_decisions + current,
            "resumes": list(self._resumes),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict) if state_dict.get("steps") or state_dict.get("decisions") else None

    def _apply_loaded(self, trainer: pl.Trainer) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        self._steps = list(loaded.get("steps", [])) + self._steps
        self._earlier_decisions = list(loaded.get("decisions", []))
        self._resumes = list(loaded.get("resumes", []))
        self._resumes.append({"step": trainer.global_step, "steps_before": len(loaded.get("steps", []))})
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
        return state

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.plot is True and stage == "fit":
            from lightning_gpuopt.report import _plt

            _plt()  # fail now, not after a long run

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
        step = self._step
        if step % self.every_n_steps:
            return
        probe = get_probe(trainer.strategy.root_device)
        if str(trainer.precision) != self._peak_precision:  # a precision switch changes the peak
            self._peak_precision = str(trainer.precision)
            self._peak_flops, _ = resolve_peak_flops(
                trainer.strategy.root_device, self._peak_precision, self.peak_flops
            )
        engine = MicroBatchEngine.get(trainer)
        try:
            n = batch_size_of(batch)
        except UnsplittableBatchError:
            n = 1
        k = engine.effective_k(batch) if engine is not None and engine.installed("train") else 1
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
            "limit_bytes": _limit(probe),
            "alloc_retries": probe.alloc_retries,
            "k": k,
            "batch_size": n,
            "micro_batch_size": -(-n // k),
            "precision": str(trainer.precision),
            "data_wait_fraction": wait,
            "samples": n,
            "step_time_s": step_time,
            "mfu": mfu(self._flops, step_time, self._peak_flops),
        }
        for field in self.fields:
            record[field.name] = field.value(trainer, pl_module)
        self._steps.append(record)
        self._log(trainer, record)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        probe = get_probe(trainer.strategy.root_device)
        rank_peaks = _rank_peaks(trainer, self._steps)  # a collective: every rank, before rank zero goes on
        self.report = {
            "format": FORMAT,
            "run": {
                "device": _device_name(trainer.strategy.root_device),
                "memory_kind": probe.kind,
                "strategy": type(trainer.strategy).__name__,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "rank_peaks": rank_peaks,
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
            },
            "steps": self._steps,
            "decisions": self._earlier_decisions + [d.as_dict() for d in decisions(trainer)],
            "resumes": self._resumes,
        }
        # `trainer.log_dir` broadcasts from rank 0: every rank asks, or rank 0 would wait for the others.
        folder = Path(self.dirpath or trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        draw = self.plot is True or (self.plot == "auto" and _has_matplotlib())
        json_path, png_path = write_report(self.report, folder, png=draw)
        self.paths = {"json": str(json_path), "png": str(png_path) if png_path else None}
        if self.plot == "auto" and not draw:
            warn(
                "GPUOptReport: matplotlib is not installed, so no gpuopt_report.png was drawn; install the plot "
                "extra (pip install 'lightning_gpuopt[plot]') and run `gpuopt report "
                f"{folder}` to draw it from the JSON."
            )
        if self.table:
            print_table(self.report)
        rank_zero_info(f"GPUOptReport: wrote {json_path}" + (f" and {png_path}" if png_path else ""))

    def _log(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        if (
            trainer.global_rank != 0
            or not trainer.loggers
            or trainer.global_step % max(1, trainer.log_every_n_steps)
        ):
            return
        rates = windowed_samples_per_s(self._steps[-10:])
        metrics = {
            "gpuopt/memory_allocated": float(record["allocated_bytes"]),
            "gpuopt/memory_peak": float(record["peak_bytes"]),
        }
        if rates and rates[-1] is not None:
            metrics["gpuopt/samples_per_s"] = float(rates[-1])
        if record["mfu"] is not None:
            metrics["gpuopt/mfu"] = float(record["mfu"])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _rank_peaks(trainer: pl.Trainer, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's highest step peak and its memory limit, gathered from every rank (rank order)."""
    peak = max((s["peak_bytes"] for s in steps), default=0)
    limit = next((s["limit_bytes"] for s in reversed(steps) if s.get("limit_bytes")), None) or 0
    mine = torch.tensor([peak, limit], dtype=torch.int64, device=trainer.strategy.root_device)
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        # torch's plain collective: with Lightning's all_gather (torch's autograd-aware one) the only process
        # of a second node aborted at exit ("terminate called without an active exception").
        parts = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(parts, mine)
        gathered = [part.tolist() for part in parts]
    else:
        gathered = [mine.tolist()]
    return [
        {"rank": rank, "peak_bytes": int(peak), "limit_bytes": int(limit) or None}
        for rank, (peak, limit) in enumerate(gathered)
    ]


def _limit(probe: Any) -> int | None:
    """The memory this process may use, where there is one: the CUDA budget, or SimulatedMemory's limit."""
    if probe.kind == "simulated":
        return probe.limit_bytes
    return probe.total if probe.kind == "cuda" else None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return str(device)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
