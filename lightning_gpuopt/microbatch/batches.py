"""The two kinds of batch the attempt loop runs, and what each does differently inside the one loop.

A :class:`TrainingBatch` runs its micro-batches' forwards and backwards inside Lightning's training step,
keeping the gradients of earlier batches of an accumulation window apart, and asks the attempt checks
once every rank kept an attempt. An :class:`EvalBatch` runs chunks of a validation, test or predict
batch and puts their outputs back together. Both tell the loop (``attempt_loop.py``) how to run an
attempt, how to drop one, what to vote after an OOM, and what a kept attempt or an agreed retry changes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_gpuopt import _compat
from lightning_gpuopt.batching import merge_outputs
from lightning_gpuopt.microbatch.attempt import (
    SideEffects,
    Snapshot,
    batch_samples,
    merge_grads,
    restore_grads,
    split_output,
)
from lightning_gpuopt.microbatch.exchange import DDPExchange
from lightning_gpuopt.oom_policy import Agreement, OOMFailure, Proposal, Recovery, Source, Vote

if TYPE_CHECKING:
    from lightning_gpuopt.microbatch.attempt_loop import AttemptLoop

__all__ = ["EvalBatch", "MicroBatchBackward", "TrainingBatch", "k_change_reason"]


@dataclass(frozen=True)
class MicroBatchBackward:
    """What a backward listener is told after each micro-batch's backward of a training attempt.

    The parameters' ``.grad`` then hold this batch's micro-batches ``0..index`` only (earlier batches of the
    accumulation window are kept apart), each micro-batch's loss multiplied by its ``weight`` (its share of the
    batch's loss), divided by ``accumulate`` and multiplied by ``scale`` (the AMP loss scale, 1.0 without one).
    Under DDP the gradients are this rank's own (the engine reduces them at the optimizer step). A failed attempt
    is run again from ``index`` 0.
    """

    index: int
    count: int
    weight: float
    samples: int
    first_in_window: bool
    accumulate: int
    scale: float
    params: tuple
    #: The batch runs as 2 micro-batches only because a listener asked for a measurement (``measure_split``).
    measuring: bool = False


class TrainingBatch:
    """A training batch: k micro-batches inside Lightning's step, gradients kept apart from the window's."""

    stage = "train"
    #: cuDNN's "not supported" errors at a size are retried once as if out of memory (training only).
    retries_size_errors = True

    def __init__(self, loop: AttemptLoop, args: tuple, kwargs: dict) -> None:
        self.loop, self.engine = loop, loop.engine
        trainer = loop.trainer
        self.rest, self.kwargs = args[1:], kwargs
        self.batch = args[0] if args else kwargs["batch"]
        self.batch_idx = (
            args[1] if len(args) > 1 else kwargs.get("batch_idx", trainer.fit_loop.epoch_loop.batch_idx)
        )
        optimizer = trainer.optimizers[0]
        self.accumulate = trainer.accumulate_grad_batches
        self.first_in_window = self.batch_idx % self.accumulate == 0  # Lightning's own rule for zeroing
        self.boundary = not _compat.should_accumulate(trainer)  # the optimizer steps after this batch
        self.n = batch_samples(self.batch)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.stash: list[Tensor | None] | None = None
        if self.first_in_window:
            loop.module_zero_grad(trainer.current_epoch, self.batch_idx, optimizer)
        else:  # keep the gradients of earlier batches of this window apart, so a failure drops only ours
            self.stash = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
        self.snapshot: Snapshot = loop.side_effects.snapshot()
        self.start_k = self.engine.k
        self.proposal: Proposal | None = self.engine.next_proposal
        self.engine.next_proposal = None
        self.checks = self.engine.attempt_checks
        # A batch that would run whole runs as 2 micro-batches when a measurement asks (GradientNoiseScale at k=1).
        ask = self.engine.measure_split
        self.measuring = bool(
            ask is not None
            and self.first_in_window
            and self.n >= 2
            and self.engine.effective_k(self.batch) == 1
            and self.engine.splittable(self.batch)
            and ask(self.batch_idx)
        )
        self.logs: tuple[list, list[float]] = ([], [])
        #: A micro-batch's step returned no loss in the last attempt (``None``: Lightning's skip; a dict without
        #: ``"loss"``, or another value: Lightning's error): that output, at ``skipped_at`` of ``skipped_of``.
        self.skipped = False
        self.skipped_output: Any = None
        self.skipped_at = (0, 0)

    def k(self) -> int:
        k = self.engine.effective_k(self.batch)
        return 2 if self.measuring and k == 1 else k

    def vote(self, status: int, k: int) -> list[Vote]:
        return self.engine.exchange.vote(status, k)

    def stop_measuring(self, refusal: BaseException) -> None:
        """The loss-weighting check refused the split a measurement asked for: run whole, ask for no more splits.

        The check is reset, so a split an OOM needs later is checked (and refused) as ever; the asker hears why
        through ``measure_refused``.
        """
        self.measuring = False
        self.engine.measure_split = None
        self.engine.loss_weighting.load_state_dict({})
        if self.engine.measure_refused is not None:
            self.engine.measure_refused(str(refusal))

    def where(self) -> str:
        return f"at step {self.loop.trainer.global_step}"

    def attempt(self, k: int) -> Any:
        exchange = self.engine.exchange
        exchange.begin(k)
        with self._no_sync():
            output = self._run(k)
        exchange.prepare()
        return output

    def _no_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.engine.exchange, DDPExchange):
            return self.loop.trainer.strategy.block_backward_sync()
        return contextlib.nullcontext()

    def _run(self, k: int) -> Any:
        loop, step = self.loop, self.loop.strategy_training_step
        chunks = loop.micro_batches(self.batch, k)
        self.engine.compile_watch.mark_dynamic(chunks, batch_samples)
        # The loss weighting's one call site: at the first split it runs the step on a piece of the batch
        # (forwards: an OOM in it is this attempt's forward OOM).
        loop.phase = "forward"
        weights = self.engine.loss_weighting.weights(
            self.engine, chunks, lambda piece: step(piece, *self.rest, **self.kwargs), self.batch
        )
        scaler = getattr(loop.trainer.precision_plugin, "scaler", None)
        listeners = self.engine.backward_listeners
        extras: list[dict[str, Any] | None] = []
        total: Tensor | None = None
        self.skipped, self.skipped_output = False, None

        def backward(out: Any, weight: float) -> bool:
            nonlocal total
            loss, extra = split_output(out)
            if not isinstance(
                loss, Tensor
            ):  # the step skips the batch (None), or Lightning refuses the output
                self.skipped, self.skipped_output = True, out
                self.skipped_at = (len(extras) + 1, len(chunks))
                return False  # no further micro-batch: the whole batch is skipped
            extras.append(extra)
            loop.phase = "backward"
            scaled = loss if weight == 1.0 else loss * weight
            if self.accumulate != 1:
                scaled = scaled / self.accumulate
            if scaler is not None:
                scaled = scaler.scale(scaled)
            loop.module_backward(scaled)
            if listeners:
                told = MicroBatchBackward(
                    len(extras) - 1,
                    len(chunks),
                    weight,
                    self.n,
                    self.first_in_window,
                    self.accumulate,
                    float(scaler.get_scale()) if scaler is not None else 1.0,
                    tuple(self.params),
                    self.measuring and k == 2,
                )
                for listener in listeners:
                    listener(told)
            part = loss.detach() if weight == 1.0 else loss.detach() * weight
            total = part if total is None else total + part
            return True

        def forward(chunk: Any) -> Any:
            loop.phase = "forward"
            return step(chunk, *self.rest, **self.kwargs)

        attempt = loop.run_micro_batches(forward, chunks, weights, backward)
        self.logs = (attempt.logs, weights)  # emitted once every rank keeps the attempt
        if self.skipped:
            return None
        loss_out = total.clone().requires_grad_(True)  # a leaf: Lightning's own backward on it is skipped
        if extras and extras[0] is not None:
            return {"loss": loss_out, **merge_outputs(extras, weights)}
        return loss_out

    def drop(self) -> None:
        for p in self.params:
            p.grad = None
        SideEffects.restore(self.snapshot)

    def give_up(self) -> None:
        """Before an error leaves the step: the window's earlier gradients go back in place."""
        restore_grads(self.params, self.stash)

    def voted_k(self, recovery: Recovery | None, k: int) -> int:
        return (recovery.k or self.start_k) if recovery is not None else k

    def retry_after(self, agreement: Agreement, failure: OOMFailure | None, k: int) -> bool:
        """Turn on the agreed rungs and take the agreed k; returns whether a rung changed what a sample needs."""
        reason = k_change_reason(self.loop.trainer, agreement, failure)
        changed = self.engine.ladder.turn_on(
            agreement.rungs, f"{reason}, and the micro-batches cannot get smaller"
        )
        self.engine.propose(agreement.k, Source.OOM, reason, batch_size=self.n)
        return changed

    def keep(self, output: Any, agreement: Agreement, k: int) -> Any:
        self.loop.ran(self.n, k, self.stage)
        self.loop.emit_logs(*self.logs, self.n)
        merge_grads(self.params, self.stash)
        if self.boundary:
            self.engine.exchange.reduce()
        self._propose(agreement)
        return output

    def skip(self, agreement: Agreement, k: int) -> Any:
        """Every rank kept its attempt and one step returned no loss: the batch is skipped on every rank.

        Its gradients are dropped (those of earlier batches of the window stay), its logged values are emitted
        as Lightning emits a skipped step's. Returned to Lightning: ``None`` (it then steps the optimizer without
        gradients on one device, and raises its own error under several ranks), or the output it refuses.
        """
        self.loop.ran(self.n, k, self.stage)
        self.loop.emit_logs(*self.logs, self.n)
        for p in self.params:
            p.grad = None
        restore_grads(self.params, self.stash)
        self.engine.exchange.recover()
        self._propose(agreement)
        if self.skipped and self.skipped_output is None and k > 1:
            self.loop.skipped_split(*self.skipped_at)
        return self.skipped_output if self.skipped else None

    def _propose(self, agreement: Agreement) -> None:
        if agreement.source:
            reason = k_change_reason(self.loop.trainer, agreement, None, self.proposal)
            self.engine.propose(agreement.k, agreement.source, reason, batch_size=self.n)


class EvalBatch:
    """An evaluation batch: chunks whose outputs are put back together in order."""

    retries_size_errors = False
    measuring = False
    proposal = None
    checks: tuple = ()
    params = None
    skipped = False  #: an evaluation step's ``None`` is an output like any other

    def __init__(self, loop: AttemptLoop, stage: str, args: tuple, kwargs: dict) -> None:
        self.loop, self.engine, self.stage = loop, loop.engine, stage
        self.args, self.kwargs = args, kwargs
        self.step = loop.strategy_eval_steps[stage]
        self.batch = args[0] if args else kwargs["batch"]
        self.batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.n = batch_samples(self.batch)
        self.snapshot: Snapshot = loop.side_effects.snapshot() if self.engine.oom_handler is not None else []
        #: Ranks that all-gather in the forward (FSDP2) vote on each step; the others decide alone.
        self.voting = self.engine.exchange.votes_inside_step
        self.logs: tuple[list, list[float]] | None = None

    def k(self) -> int:
        k = (
            max(1, min(self.engine.eval_k.get(self.stage, 1), self.n))
            if self.engine.splittable(self.batch)
            else 1
        )
        return self.engine.compile_watch.cap(self.n, k, self.stage)

    def where(self) -> str:
        return f"in {self.stage} at batch {self.batch_idx}"

    def vote(self, status: int, k: int) -> list[Vote]:
        return self.engine.exchange.vote(status, k) if self.voting else [Vote(status, k)]

    def attempt(self, k: int) -> Any:
        self.logs = None
        if self.voting:
            self.engine.exchange.begin(k)
        elif k == 1:
            return self.step(*self.args, **self.kwargs)
        loop, rest = self.loop, self.args[1:]
        chunks = loop.micro_batches(self.batch, k)
        self.engine.compile_watch.mark_dynamic(chunks, batch_samples)
        # The training's decision, or its fallback: evaluation never runs the check.
        weights = self.engine.loss_weighting.weights(self.engine, chunks)
        outputs: list[Any] = []
        attempt = loop.run_micro_batches(
            lambda chunk: self.step(chunk, *rest, **self.kwargs),
            chunks,
            weights,
            lambda out, _: outputs.append(out),
        )
        self.logs = (attempt.logs, weights)
        return None if all(o is None for o in outputs) else merge_outputs(outputs, weights)

    def drop(self) -> None:
        SideEffects.restore(self.snapshot)

    def give_up(self) -> None:
        """Nothing to put back before an error leaves the step."""

    def voted_k(self, recovery: Recovery | None, k: int) -> int:
        return max(recovery.k or k + 1, k + 1) if recovery is not None else k

    def retry_after(self, agreement: Agreement, failure: OOMFailure | None, k: int) -> bool:
        """Split this stage's batches further, the same on every rank (a batch of fewer samples runs them as it can)."""
        if failure is not None:
            reason = f"OOM in {self.stage} at batch {self.batch_idx}"
        else:
            ranks = ", ".join(map(str, agreement.ranks))
            reason = f"OOM on rank {ranks} in {self.stage} at batch {self.batch_idx}"
        self.engine.set_eval_k(self.stage, max(agreement.k, k + 1), reason, self.n)
        return False

    def keep(self, output: Any, agreement: Agreement, k: int) -> Any:
        if self.logs is None:  # the step ran whole, straight through: nothing captured, nothing to count
            return output
        self.loop.ran(self.n, k, self.stage)
        self.loop.emit_logs(*self.logs, self.n)
        return output


def k_change_reason(
    trainer: pl.Trainer, agreement: Agreement, failure: OOMFailure | None, proposal: Proposal | None = None
) -> str:
    """Why the ranks' agreement changes k, for the :class:`~lightning_gpuopt.microbatch.KChange` record."""
    step = trainer.global_step
    if agreement.source is Source.OOM:
        if failure is not None:
            return f"OOM at step {failure.step} ({failure.phase})"
        ranks = ", ".join(map(str, agreement.ranks))
        return f"OOM on rank {ranks} at step {step}"
    if proposal is not None and agreement.k == proposal.k:
        return proposal.reason
    return f"{agreement.source} (agreed by every rank) at step {step}"
