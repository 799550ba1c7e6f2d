"""The two kinds of batch the attempt loop runs, what each does differently inside the one loop, and the
:class:`Outcome` each hands back.

A :class:`TrainingBatch` runs its micro-batches' forwards and backwards inside Lightning's training step,
keeping the gradients of earlier batches of an accumulation window apart. An :class:`EvalBatch` runs chunks
of a validation, test or predict batch and puts their outputs back together. Both tell the loop
(``attempt_loop.py``) how to run an attempt, how to drop one, what to vote after an OOM, and, once the
ranks agreed, the outcome (keep, retry at k, skip, with the logs to replay), which only the loop applies.
A batch runs with :class:`Steps` (the Trainer's own methods that the loop's patches stand in for), the
ranks' exchange and the weighting of its micro-batches' losses: it holds neither the engine nor the loop.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_gpuopt import _compat
from lightning_gpuopt.batch_split import SPLIT_HOOK, merge_outputs, split_batch
from lightning_gpuopt.microbatch.compile_watch import CompileWatch
from lightning_gpuopt.microbatch.exchange import DDPExchange, FSDP2Exchange, LocalExchange
from lightning_gpuopt.microbatch.loss_weighting import CheckSite, LossWeighting
from lightning_gpuopt.microbatch.side_effects import (
    Attempt,
    LogCall,
    SideEffects,
    Snapshot,
    batch_samples,
    merge_grads,
    restore_grads,
    split_output,
)
from lightning_gpuopt.microbatch.step_shares import StepShares
from lightning_gpuopt.oom_policy import OOMFailure, Recovery
from lightning_gpuopt.votes import Agreement, Proposal, Source, Vote

__all__ = [
    "EvalBatch",
    "MicroBatchBackward",
    "Outcome",
    "OutcomeKind",
    "Steps",
    "TrainingBatch",
    "k_change_reason",
]

#: The ranks' exchange of a batch (``exchange.py``).
Exchange = LocalExchange | DDPExchange | FSDP2Exchange
#: An attempt's captured ``self.log`` calls and its micro-batches' weights, replayed once the batch is kept.
Logs = tuple[list[LogCall], list[float]]


@dataclass(frozen=True)
class MicroBatchBackward:
    """What a backward listener is told after each micro-batch's backward of a training attempt.

    The parameters' ``.grad`` then hold this batch's micro-batches ``0..index`` only (earlier batches of the
    accumulation window are kept apart), each micro-batch's loss multiplied by its ``weight`` (its share of the
    batch's loss) and by ``share`` (the batch's share of the optimizer step's tokens, ``step_shares.py``; 1.0 where
    the step's batches are not shared by tokens), divided by ``accumulate`` and multiplied by ``scale`` (the AMP
    loss scale, 1.0 without one).
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
    #: The batch's share of the optimizer step's tokens (1.0: Lightning's own averaging).
    share: float = 1.0
    #: The batch's tokens on this rank where the step is shared by tokens (``None``: it is not).
    tokens: float | None = None


class OutcomeKind(enum.Enum):
    """What happens to a batch once every rank voted on an attempt."""

    KEEP = "keep"  #: the attempt stands; its output goes back to Lightning
    RETRY = "retry"  #: the batch runs again, at ``Outcome.k``
    SKIP = "skip"  #: a step returned no loss: the batch is skipped on every rank


@dataclass(frozen=True)
class Outcome:
    """What a batch asks the attempt loop to do after the ranks agreed; the loop alone applies it.

    ``KEEP`` and ``SKIP``: ``output`` goes back to Lightning, ``logs`` are replayed once (``None``: nothing was
    captured), and where ``source`` is set, k becomes ``k`` for the next batch. ``RETRY``: the batch runs again at
    ``k`` (a training batch: the engine's k, after turning on ``rungs``; an evaluation batch: its stage's k).
    """

    kind: OutcomeKind
    output: Any = None
    k: int | None = None
    source: Source | str | None = None
    reason: str = ""
    rungs: tuple[int, ...] = ()
    logs: Logs | None = None
    #: A micro-batch's ``None`` skipped a split batch: (that micro-batch, of how many).
    skipped_split: tuple[int, int] | None = None


@dataclass
class Steps:
    """What a batch runs its micro-batches with: the Trainer's own methods that the loop's patches stand in for,
    and where the module's ``self.log`` calls go while an attempt runs (filled in when the loop patches)."""

    trainer: pl.Trainer
    module: pl.LightningModule | None = None
    log: Callable[..., Any] | None = None
    backward: Callable[..., Any] | None = None
    zero_grad: Callable[..., Any] | None = None
    training_step: Callable[..., Any] | None = None
    eval_steps: dict[str, Callable[..., Any]] = field(default_factory=dict)
    #: What a dropped attempt must put back besides gradients (torchmetrics, BatchNorm).
    side_effects: SideEffects | None = None
    #: Under torch.compile, a split marks the batch dimension dynamic.
    watch: CompileWatch = field(default_factory=CompileWatch)
    #: Where ``self.log`` calls go while an attempt runs (``None``: straight to Lightning).
    capture: Attempt | None = None
    #: The phase of the training attempt running now, for its failure (``"forward"``, ``"backward"``).
    phase: str = "forward"

    def micro_batches(self, batch: Any, k: int) -> list[Any]:
        """``batch`` as ``k`` micro-batches: the module's or datamodule's ``split_batch`` hook, else an even split."""
        if k == 1:
            return [batch]
        for owner in (self.module, getattr(self.trainer, "datamodule", None)):
            hook = getattr(owner, SPLIT_HOOK, None) if owner is not None else None
            if callable(hook):
                chunks = list(hook(batch, k))
                if len(chunks) != k:
                    raise ValueError(
                        f"`{type(owner).__name__}.{SPLIT_HOOK}(batch, k={k})` must return {k} micro-batches, "
                        f"got {len(chunks)}"
                    )
                break
        else:
            chunks = split_batch(batch, k).chunks
        self.watch.mark_dynamic(chunks, batch_samples)
        return chunks

    def run(
        self,
        step: Callable[[Any], Any],
        chunks: list[Any],
        weights: list[float],
        each: Callable[[Any, float], bool | None],
    ) -> Attempt:
        """Run ``step`` on every chunk, its ``self.log`` calls captured with the chunk's weight; ``each(output,
        weight)`` takes each output (``False``: no further chunk)."""
        attempt = Attempt()
        self.capture = attempt
        try:
            for chunk, weight in zip(chunks, weights):
                attempt.start()
                go_on = each(step(chunk), weight)
                attempt.keep(weight)
                if go_on is False:  # the step skipped the batch: no further micro-batch
                    break
        finally:
            self.capture = None
        return attempt

    @contextlib.contextmanager
    def leave_no_trace(self) -> Iterator[None]:
        """Run extra forwards whose ``self.log`` values are dropped and whose module state is restored on exit."""
        snapshot = self.side_effects.snapshot()
        previous, self.capture = self.capture, Attempt()
        try:
            yield
        finally:
            self.capture = previous
            SideEffects.restore(snapshot)

    def site(self, exchange: Exchange) -> CheckSite:
        """What the loss-weighting check runs with."""
        return CheckSite(self.trainer, self.leave_no_trace, exchange.votes_inside_step)


class TrainingBatch:
    """A training batch: k micro-batches inside Lightning's step, gradients kept apart from the window's.

    The loop sets :attr:`start_k`, :attr:`proposal` and :attr:`measuring` after asking the engine's users.
    """

    stage = "train"
    #: cuDNN's "not supported" errors at a size are retried once as if out of memory (training only).
    retries_size_errors = True

    def __init__(
        self,
        steps: Steps,
        exchange: Exchange,
        weighting: LossWeighting,
        listeners: tuple[Callable[[MicroBatchBackward], None], ...],
        args: tuple,
        kwargs: dict,
    ) -> None:
        self.steps, self.exchange, self.weighting, self.listeners = steps, exchange, weighting, listeners
        trainer = steps.trainer
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
            steps.zero_grad(trainer.current_epoch, self.batch_idx, optimizer)
        else:  # keep the gradients of earlier batches of this window apart, so a failure drops only ours
            self.stash = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
        self.snapshot: Snapshot = steps.side_effects.snapshot()
        #: k when the batch started (an OOM's vote without a k of its own keeps it).
        self.start_k = 1
        #: A user's proposal for the vote after this batch (grow back, thrashing).
        self.proposal: Proposal | None = None
        #: A batch that would run whole runs as 2 micro-batches for a measurement (GradientNoiseScale at k=1).
        self.measuring = False
        self.logs: Logs = ([], [])
        #: A micro-batch's step returned no loss in the last attempt (``None``: Lightning's skip; a dict without
        #: ``"loss"``, or another value: Lightning's error): that output, at ``skipped_at`` of ``skipped_of``.
        self.skipped = False
        self.skipped_output: Any = None
        self.skipped_at = (0, 0)
        #: The optimizer step's token shares among ranks and accumulated batches (set by the loop; ``None``: off).
        self.shares: StepShares | None = None
        #: This batch's loss was scaled by its share of the step's tokens (``step_shares.py``).
        self.counted = False

    def vote(self, status: int, k: int) -> list[Vote]:
        return self.exchange.vote(status, k)

    def where(self) -> str:
        return f"at step {self.steps.trainer.global_step}"

    def attempt(self, k: int) -> Any:
        exchange = self.exchange
        exchange.begin(k)
        with self._no_sync():
            output = self._run(k)
        exchange.prepare()
        return output

    def _no_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.exchange, DDPExchange):
            return self.steps.trainer.strategy.block_backward_sync()
        return contextlib.nullcontext()

    def _run(self, k: int) -> Any:
        steps, step = self.steps, self.steps.training_step
        chunks = steps.micro_batches(self.batch, k)
        # The loss weighting's one call site: at the first split it runs the step on a piece of the batch
        # (forwards: an OOM in it is this attempt's forward OOM).
        steps.phase = "forward"
        shares = self.shares
        several = self.exchange.world_size > 1 or self.accumulate > 1
        # Asked of the first batch on every rank (one collective), whatever is decided already (a resumed run too).
        wanted = shares is not None and shares.wants_decision(
            steps.trainer, self.batch, several, self.weighting
        )
        weights = self.weighting.weights(
            chunks,
            steps.site(self.exchange),
            lambda piece: step(piece, *self.rest, **self.kwargs),
            self.batch,
            # Only while every rank runs its batch whole (the engine's k is 1): the ranks then take one branch.
            decide_whole=wanted and self.start_k == 1 and self.weighting.undecided,
        )
        counting = self.weighting.counting if shares is not None else None
        # From a window's first batch on: a decision in the middle of a window shares from the next window.
        self.counted = (
            counting is not None and several and (self.first_in_window or shares.reference is not None)
        )
        share = (
            shares.factor(counting, self.batch, self.exchange, self.first_in_window) if self.counted else 1.0
        )
        scaler = getattr(steps.trainer.precision_plugin, "scaler", None)
        listeners = self.listeners
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
            steps.phase = "backward"
            scaled = loss * (weight * share)  # exact at a weight of 1
            if self.accumulate != 1:
                scaled = scaled / self.accumulate
            if scaler is not None:
                scaled = scaler.scale(scaled)
            steps.backward(scaled)
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
                    share,
                    shares.mine if self.counted else None,
                )
                for listener in listeners:
                    listener(told)
            part = loss.detach() * weight
            total = part if total is None else total + part
            return True

        def forward(chunk: Any) -> Any:
            steps.phase = "forward"
            return step(chunk, *self.rest, **self.kwargs)

        attempt = steps.run(forward, chunks, weights, backward)
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

    def retry(self, agreement: Agreement, failure: OOMFailure | None, k: int) -> Outcome:
        """Run again at the agreed k, with the agreed rungs turned on."""
        reason = k_change_reason(self.steps.trainer, agreement, failure)
        return Outcome(
            OutcomeKind.RETRY, k=agreement.k, source=Source.OOM, reason=reason, rungs=agreement.rungs
        )

    def keep(self, output: Any, agreement: Agreement, k: int) -> Outcome:
        """The attempt stands: its gradients join the window's; the agreed proposal changes k for the next batch."""
        merge_grads(self.params, self.stash)
        if self.counted:
            self.shares.keep()
        return self._outcome(OutcomeKind.KEEP, output, agreement)

    def finish(self) -> None:
        """At the optimizer step, after the ranks' reduction: the gradients become the step's token mean's."""
        if self.shares is not None:
            self.shares.finish(self.params, self.accumulate)

    def skip(self, agreement: Agreement, k: int) -> Outcome:
        """Every rank kept its attempt and one step returned no loss: the batch is skipped on every rank.

        Its gradients are dropped (those of earlier batches of the window stay), its logged values are replayed
        as Lightning replays a skipped step's. Returned to Lightning: ``None`` (it then steps the optimizer without
        gradients on one device, and raises its own error under several ranks), or the output it refuses.
        """
        for p in self.params:
            p.grad = None
        restore_grads(self.params, self.stash)
        split = self.skipped_at if self.skipped and self.skipped_output is None and k > 1 else None
        output = self.skipped_output if self.skipped else None
        return self._outcome(OutcomeKind.SKIP, output, agreement, split)

    def _outcome(
        self, kind: OutcomeKind, output: Any, agreement: Agreement, split: tuple[int, int] | None = None
    ) -> Outcome:
        if not agreement.source:
            return Outcome(kind, output, logs=self.logs, skipped_split=split)
        reason = k_change_reason(self.steps.trainer, agreement, None, self.proposal)
        return Outcome(
            kind, output, agreement.k, agreement.source, reason, logs=self.logs, skipped_split=split
        )


class EvalBatch:
    """An evaluation batch: chunks whose outputs are put back together in order."""

    retries_size_errors = False
    measuring = False
    proposal = None
    params = None
    skipped = False  #: an evaluation step's ``None`` is an output like any other

    def __init__(
        self,
        steps: Steps,
        exchange: Exchange,
        weighting: LossWeighting,
        stage: str,
        args: tuple,
        kwargs: dict,
        snapshot: bool,
    ) -> None:
        self.steps, self.exchange, self.weighting, self.stage = steps, exchange, weighting, stage
        self.args, self.kwargs = args, kwargs
        self.step = steps.eval_steps[stage]
        self.batch = args[0] if args else kwargs["batch"]
        self.batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.n = batch_samples(self.batch)
        #: ``snapshot``: a failed attempt can be retried (an OOM decider is attached): what it changes is copied.
        self.snapshot: Snapshot = steps.side_effects.snapshot() if snapshot else []
        #: Ranks that all-gather in the forward (FSDP2) vote on each step; the others decide alone.
        self.voting = exchange.votes_inside_step
        self.logs: Logs | None = None

    def where(self) -> str:
        return f"in {self.stage} at batch {self.batch_idx}"

    def vote(self, status: int, k: int) -> list[Vote]:
        return self.exchange.vote(status, k) if self.voting else [Vote(status, k)]

    def attempt(self, k: int) -> Any:
        self.logs = None
        if self.voting:
            self.exchange.begin(k)
        elif k == 1:
            return self.step(*self.args, **self.kwargs)
        steps, rest = self.steps, self.args[1:]
        chunks = steps.micro_batches(self.batch, k)
        # The training's decision, or its fallback: evaluation never runs the check.
        weights = self.weighting.weights(chunks, steps.site(self.exchange))
        outputs: list[Any] = []
        attempt = steps.run(
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

    def retry(self, agreement: Agreement, failure: OOMFailure | None, k: int) -> Outcome:
        """Split this stage's batches further, the same on every rank (a batch of fewer samples runs them as it can)."""
        if failure is not None:
            reason = f"OOM in {self.stage} at batch {self.batch_idx}"
        else:
            ranks = ", ".join(map(str, agreement.ranks))
            reason = f"OOM on rank {ranks} in {self.stage} at batch {self.batch_idx}"
        return Outcome(OutcomeKind.RETRY, k=max(agreement.k, k + 1), source=Source.OOM, reason=reason)

    def keep(self, output: Any, agreement: Agreement, k: int) -> Outcome:
        """The chunks' outputs, put back together; their logs replayed (none when the step ran whole)."""
        return Outcome(OutcomeKind.KEEP, output, logs=self.logs)


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
