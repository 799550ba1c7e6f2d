"""One search on this process: the budget, the trial steps, how the search starts, and what it found.

:func:`find_largest_size` is what MemoryAwareBatchSize runs at each search, on every rank: it opens
:class:`~lightning_gpuopt.batch_size.trial.TrialSteps`, chooses how the search starts
(:func:`choose_search`: from traced steps, or measured only), runs it
(:func:`~lightning_gpuopt.batch_size.search.run_trials`) and returns a :class:`SearchRun`. The callback
agrees on the answer across ranks and applies it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_gpuopt.batch_size.modes import SearchSpace
from lightning_gpuopt.batch_size.peak_model import memory_budget
from lightning_gpuopt.batch_size.predicted import PredictedSearch
from lightning_gpuopt.batch_size.search import SearchResult, SizeSearch, StepMeasurement, run_trials
from lightning_gpuopt.batch_size.trace import Tracer, make_tracer, start_search
from lightning_gpuopt.batch_size.trial import TrialSteps, local_bytes
from lightning_gpuopt.memory import MemoryProbe, format_bytes
from lightning_gpuopt.microbatch.exchange import FSDP2Exchange

__all__ = [
    "STEP_SLACK_BYTES",
    "TRACES_PER_SEARCH",
    "SearchRun",
    "choose_search",
    "find_largest_size",
    "no_fit_message",
    "prefer_traces",
]

#: Traces a predicted start takes (it saves about one real step of the measured search's four).
TRACES_PER_SEARCH = 5


def prefer_traces(step_seconds: float, trace_seconds: float | None) -> bool:
    """Whether the traced start saves wall time: its traces cost less than the one real step they save.

    >>> prefer_traces(0.02, 0.3), prefer_traces(4.0, 0.3), prefer_traces(4.0, None)
    (False, True, False)
    """
    return trace_seconds is not None and TRACES_PER_SEARCH * trace_seconds < step_seconds


#: Small tensors a real step holds that a trial does not (the loop's loss copies, logged values,
#: gradient-clipping norms): kept free under the budget.
STEP_SLACK_BYTES = 64 * 1024


@dataclass(frozen=True)
class SearchRun:
    """One search on this process.

    Attributes:
        result: the measurements, the fitted model and the answer.
        budget_bytes: what a step may use at its peak.
        note: how the prediction served, or why the search ran without it.
        elapsed: the search's wall time, in seconds.
        last_error: the first line of the last out-of-memory error of a trial step.
        frames_compiled: frames dynamo compiled during the trials (``None``: the module is not compiled).
        grad_bytes: bytes of the gradients of every trained parameter (this rank's shards under FSDP2).
        state_bytes: bytes of the optimizer state once a trial's optimizer step ran (``None``: none ran).
    """

    result: SearchResult
    budget_bytes: int
    note: str
    elapsed: float
    last_error: str | None
    frames_compiled: int | None
    grad_bytes: int
    state_bytes: int | None


def choose_search(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    space: SearchSpace,
    trials: TrialSteps,
    extra_bytes: int,
    predict: bool | None,
    sharded: bool,
    **search: Any,
) -> tuple[SizeSearch, str]:
    """How the search starts, and why: from traced steps (``predict``, not under FSDP2), else measured only.

    ``extra_bytes``: bytes held through a real step that a trial does not hold; ``**search``:
    :class:`~lightning_gpuopt.batch_size.search.SizeSearch`'s arguments.
    """
    if predict is None:
        return _auto_search(trainer, module, space, trials, extra_bytes, sharded, **search)
    if predict and not sharded:  # the first real step at the size traced steps predict
        pending = extra_bytes + trials.missing_grad_bytes()
        return start_search(trainer, module, space.make_batch, space.batch_idx, pending, **search)
    if predict:
        return SizeSearch(**search), (
            "measured only: under FSDP2 the step cannot be predicted (its collectives run inside it)"
        )
    return SizeSearch(**search), "measured only (predict=False)"


def _auto_search(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    space: SearchSpace,
    trials: TrialSteps,
    extra_bytes: int,
    sharded: bool,
    **search: Any,
) -> tuple[SizeSearch, str]:
    """``predict=None``: one real step at the first size, timed against one trace; the cheaper start wins.

    The real step is kept as the measured search's first measurement, so the measured path loses nothing.
    The trace is stopped once it has cost a :data:`TRACES_PER_SEARCH`-th of the real step (the traced start
    has lost by then), so that finding out costs the measured path at most that; a finished trace is kept
    (the traced start traces the first step's size too). A later search of the same step reuses the time
    instead of timing again, and takes the traced start where every trace it plans is kept (they cost
    nothing, and it saves a real step).
    """
    if sharded:
        return SizeSearch(
            **search
        ), "measured only: under FSDP2 the step cannot be predicted (its collectives run inside it)"
    pending = extra_bytes + trials.missing_grad_bytes()
    measured = SizeSearch(**search)
    size = measured.next_size()
    if size is None:
        return measured, "nothing to measure"
    batch, actual, nbytes, whole = space.make_batch(size)
    started = time.perf_counter()
    measurement = trials.measure(batch, actual, nbytes, whole)
    step_s = time.perf_counter() - started
    del batch
    if measurement is None:
        measurement = StepMeasurement(actual, None)
    elif trials.held_bytes is not None:
        measured.base_bytes = trials.held_bytes + extra_bytes
    tracer = (
        make_tracer(trainer, module, space.make_batch, space.batch_idx, actual)
        if trainer.optimizers
        else None
    )
    limit_s = step_s / TRACES_PER_SEARCH
    known = tracer.seconds if tracer is not None else None
    # Timed in an earlier search of this step: that time serves where the trace finished, was stopped at the
    # same size (the same step: the same choice), or was stopped later than this limit.
    earlier = known is not None and (known[1] or known[2] == actual or known[0] >= limit_s)
    timed = known if earlier else tracer.timed(actual, limit_s) if tracer is not None else None
    # What the user reads: what the predicted steps that would save one real step take, against that step.
    if timed is None:
        trace_s, costs = None, ""
    else:
        trace_s = timed[0] if timed[1] else None
        at_least = "" if timed[1] else "at least "
        when = ", as timed in an earlier search," if earlier else ""
        costs = (
            f"{TRACES_PER_SEARCH} predicted steps take {at_least}{TRACES_PER_SEARCH * timed[0]:.3f} s{when} "
            f"to save one real step of {step_s:.3f} s"
        )
    # The traced start plans as predict=True does (the same traces: each reuses the other's), from the memory
    # held before the first step; its search then goes on from the first step's measurement.
    plan = (trainer, module, space.make_batch, space.batch_idx, pending)
    kept = _kept(tracer, plan, search) if tracer is not None else None
    if kept is not None or prefer_traces(step_s, trace_s):
        chosen, note = kept or start_search(*plan, tracer=tracer, **search)
        chosen.base_bytes = measured.base_bytes
        if chosen.next_size() == actual:  # the timed step is the traced search's first step: kept, not rerun
            chosen.record(measurement)
        why = "its predicted steps are kept from an earlier search, at no cost" if kept is not None else costs
        return chosen, note or f"predicted, then measured: {why}; predict=False measures only"
    measured.record(measurement)
    if timed is None:
        return measured, "measured only: this training step cannot be predicted"
    return measured, f"measured only: {costs}; predict=True predicts anyway"


def _kept(tracer: Tracer, plan: tuple, search: dict[str, Any]) -> tuple[SizeSearch, str] | None:
    """The traced start planned from kept traces alone, where every trace it plans is kept from an earlier
    search (else ``None``: planning it would trace)."""

    def lookup(n: int) -> Any:
        return tracer.traces[n]  # KeyError: not kept

    if not tracer.traces:
        return None
    try:
        chosen, note = start_search(*plan, tracer=lookup, **search)
    except KeyError:
        return None
    if isinstance(chosen, PredictedSearch):
        chosen.tracer = tracer  # the sizes its real steps reach are traced (or reused) as usual
    return chosen, note


def find_largest_size(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    probe: MemoryProbe,
    space: SearchSpace,
    *,
    target_fraction: float,
    multiple_of: int,
    predict: bool | None,
    engine_bytes: int,
    exchange: FSDP2Exchange | None = None,
) -> SearchRun:
    """Measure real training steps until the search is over; every byte they leave is put back.

    Args:
        trainer: the Trainer, set up for fitting.
        module: the LightningModule.
        probe: the memory probe of the training device.
        space: what the mode searches over (:mod:`~lightning_gpuopt.batch_size.modes`).
        target_fraction: the share of the memory this process may use that a step may take at its peak.
        multiple_of: answers at least this large are rounded down to a multiple of it.
        predict: start from traced steps (not under FSDP2); ``False``: measured steps; ``None``: whichever
            is cheaper, from the first real step's time against one trace's time.
        engine_bytes: what the micro-batch engine holds through a real step (its per-step copies).
        exchange: under FSDP2, the engine's exchange: the ranks run their trials together; ``None``: alone.
    """
    budget = memory_budget(probe.total, target_fraction)
    started = time.perf_counter()
    with TrialSteps(trainer, module, probe, space.batch_idx, exchange) as trials:
        # Held besides what a trial sees: the engine's own copies, and with accumulation the window's
        # earlier gradients, which the engine keeps apart while a batch runs.
        extra = engine_bytes + STEP_SLACK_BYTES
        if trainer.accumulate_grad_batches > 1:
            extra += trials.grad_bytes
        search, note = choose_search(
            trainer,
            module,
            space,
            trials,
            extra,
            predict,
            sharded=exchange is not None,
            budget_bytes=budget,
            base_bytes=probe.allocated,
            smallest=space.smallest,
            largest=space.largest,
            multiple_of=multiple_of,
            held_bytes_per_sample=space.held_bytes_per_sample,
            whole_largest=space.whole_largest,
            grad_bytes=trials.grad_bytes,
            # 1/16 of the range, 2 to 16 samples: small, yet past the sizes where fixed costs dominate a step.
            first_size=min(16, max(2, space.largest // 16)),
        )
        result = run_trials(search, trials, space.make_batch, extra)
        if isinstance(search, PredictedSearch):
            note = f"{note}; {search.note}" if note else search.note
            tracer = search.tracer
            if isinstance(tracer, Tracer) and tracer.reused:
                note += (
                    f" ({tracer.traced} predicted step(s) run, {tracer.reused} reused from an earlier search)"
                )
    return SearchRun(
        result=result,
        budget_bytes=budget,
        note=note,
        elapsed=time.perf_counter() - started,
        last_error=trials.last_error,
        frames_compiled=trials.frames_compiled if trials.compiled else None,
        grad_bytes=trials.grad_bytes,
        state_bytes=trials.state_bytes,
    )


def no_fit_message(
    run: SearchRun, module: pl.LightningModule, smallest: int, target_fraction: float, total_bytes: int
) -> str:
    """Why even ``smallest`` samples per step do not fit: the measured memory, and what to do."""
    result = run.result
    params = sum(local_bytes(p) for p in module.parameters())
    state = (
        "not measured (no trial reached the optimizer step)"
        if run.state_bytes is None
        else format_bytes(run.state_bytes)
    )
    parts = [
        f"parameters {format_bytes(params)}",
        f"gradients {format_bytes(run.grad_bytes)}",
        f"optimizer state {state}",
    ]
    done = [m for m in result.measurements if not m.out_of_memory]
    if done:
        m = min(done, key=lambda m: m.size)
        model = result.model
        parts += [
            f"memory held through a step {format_bytes(model.base_bytes)}",
            f"forward+backward at {m.size} sample(s) {format_bytes(m.forward_backward_bytes)}",
            f"optimizer step {format_bytes(m.optimizer_bytes or 0)}",
            f"peak {format_bytes(model.peak(m.size))}",
        ]
    tried = ", ".join(f"{m.size}{' (out of memory)' if m.out_of_memory else ''}" for m in result.measurements)
    error = f" Last error: {run.last_error}" if run.last_error else ""
    return (
        f"MemoryAwareBatchSize: even {smallest} sample(s) per step do not fit the memory budget of "
        f"{format_bytes(run.budget_bytes)} (target_fraction {target_fraction:g} x "
        f"{format_bytes(total_bytes)}). Measured steps: {tried}. Memory: {'; '.join(parts)}. Next steps: a "
        "lower-memory precision (precision='bf16-mixed' or '16-mixed'), activation checkpointing of the largest "
        "blocks, a sharded strategy (FSDP, DeepSpeed ZeRO) or CPU offload, a higher target_fraction, or a "
        f"smaller model.{error}"
    )
