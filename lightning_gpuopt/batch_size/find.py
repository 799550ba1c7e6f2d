"""One search on this process: the budget, the trial steps, and what they found.

:func:`find_largest_size` is what MemoryAwareBatchSize runs at each search, on every rank: it opens
:class:`~lightning_gpuopt.batch_size.trial.TrialSteps`, runs the measured
:class:`~lightning_gpuopt.batch_size.search.SizeSearch` through them
(:func:`~lightning_gpuopt.batch_size.search.run_trials`) and returns a :class:`SearchRun`. The callback
agrees on the answer across ranks and applies it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import lightning.pytorch as pl

from lightning_gpuopt.batch_size.modes import SearchSpace
from lightning_gpuopt.batch_size.peak_model import memory_budget
from lightning_gpuopt.batch_size.search import SearchResult, SizeSearch, run_trials
from lightning_gpuopt.batch_size.trial import RankVotes, TrialSteps, local_bytes
from lightning_gpuopt.memory import MemoryProbe, format_bytes

__all__ = ["STEP_SLACK_BYTES", "SearchRun", "find_largest_size", "no_fit_message"]

#: Small tensors a real step holds that a trial does not (the loop's loss copies, logged values,
#: gradient-clipping norms): kept free under the budget.
STEP_SLACK_BYTES = 64 * 1024


@dataclass(frozen=True)
class SearchRun:
    """One search on this process.

    Attributes:
        result: the measurements, the fitted model and the answer.
        budget_bytes: what a step may use at its peak.
        elapsed: the search's wall time, in seconds.
        last_error: the first line of the last out-of-memory error of a trial step.
        frames_compiled: frames dynamo compiled during the trials (``None``: the module is not compiled).
        grad_bytes: bytes of the gradients of every trained parameter (this rank's shards under FSDP2).
        state_bytes: bytes of the optimizer state once a trial's optimizer step ran (``None``: none ran).
    """

    result: SearchResult
    budget_bytes: int
    elapsed: float
    last_error: str | None
    frames_compiled: int | None
    grad_bytes: int
    state_bytes: int | None


def find_largest_size(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    probe: MemoryProbe,
    space: SearchSpace,
    *,
    target_fraction: float,
    multiple_of: int,
    engine_bytes: int,
    exchange: RankVotes | None = None,
) -> SearchRun:
    """Measure real training steps until the search is over; every byte they leave is put back.

    Args:
        trainer: the Trainer, set up for fitting.
        module: the LightningModule.
        probe: the memory probe of the training device.
        space: what the mode searches over (:mod:`~lightning_gpuopt.batch_size.modes`).
        target_fraction: the share of the memory this process may use that a step may take at its peak.
        multiple_of: answers at least this large are rounded down to a multiple of it.
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
        search = SizeSearch(
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
    return SearchRun(
        result=result,
        budget_bytes=budget,
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
