"""The engine's one attempt loop, for training and evaluation: a batch runs until every rank keeps an attempt.

An attempt runs the batch as k micro-batches: in training each one's forward and backward inside
Lightning's step, in evaluation chunks whose outputs are put back together. Every attempt ends in one
vote per rank (``exchange.py``), from which every rank takes the same decision: keep the attempt, run
the batch again (a larger k, a recovery rung turned on, or an attempt check that changed what the batch
runs under), or stop. The batch says what the decision means (its :class:`~.batches.Outcome`); the loop
alone applies it: the k change, the rungs, the logs replayed. A dropped attempt leaves no trace
(``side_effects.py``).

:class:`AttemptLoop` also holds the patches that bring the Trainer's steps here: the strategy's step
methods, and the module's ``log``, ``backward`` and ``optimizer_zero_grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory import (
    MemoryProbe,
    forensics,
    free_memory,
    get_probe,
    is_maybe_size_error,
    is_oom_error,
)
from lightning_gpuopt.microbatch.batch_runs import (
    EvalBatch,
    Exchange,
    Outcome,
    OutcomeKind,
    Steps,
    TrainingBatch,
)
from lightning_gpuopt.microbatch.compile_watch import CompileWatch
from lightning_gpuopt.microbatch.errors import (
    LossWeightingError,
    MicroBatchOOMError,
    RankOutOfMemoryError,
    WeightingCheckOutOfMemory,
)
from lightning_gpuopt.microbatch.exchange import LocalExchange, PeerFailure
from lightning_gpuopt.microbatch.rungs import Ladder
from lightning_gpuopt.microbatch.side_effects import SideEffects, emit_logs
from lightning_gpuopt.microbatch.splits import Splits
from lightning_gpuopt.microbatch.step_shares import StepShares
from lightning_gpuopt.microbatch.users import Users
from lightning_gpuopt.oom_policy import OOMFailure, Recovery, parse_tried_bytes
from lightning_gpuopt.oom_record import describe_action, stop_reason
from lightning_gpuopt.votes import Agreement, Status, Vote, agree, rung_bits

__all__ = ["EVAL_STAGES", "AttemptLoop", "agree_or_stop"]

#: The evaluation steps the engine wraps, by the name of the strategy method.
EVAL_STAGES = ("validation", "test", "predict")

#: How often the attempt checks may send one batch back before the engine gives up (each re-run
#: follows a change the check made, such as one precision switch).
_MAX_RECHECKS = 8

#: ``vote(status, k)``: every rank's vote, in rank order.
VoteFn = Callable[[int, int], list[Vote]]


@dataclass
class _Run:
    """One batch's attempts so far."""

    probe: MemoryProbe
    measured: bool
    #: The smallest micro-batch (samples) that failed, for the OOM decider.
    smallest_failed: int
    rechecks: int = 0
    #: A size error taken for an OOM once; a second one re-raises it.
    first_size_error: BaseException | None = None


#: The stages whose logged losses are averaged over the epoch by tokens, where the training loss is a token mean.
_TOKEN_MEAN_STAGES = ("validation", "test")


@dataclass
class _Tried:
    """What one attempt left: its output, or why it failed."""

    k: int
    output: Any = None
    #: This rank's OOM (or a size error taken for one), described.
    failure: OOMFailure | None = None
    #: The votes at which another rank's failure stopped this attempt (FSDP2).
    peer_votes: list[Vote] | None = None
    #: The loss-weighting check refused to split, where only a measurement asked for the split.
    refused: LossWeightingError | None = None
    #: The check ran out of memory where no decider can split further (or a measurement asked for the split).
    check_failed: WeightingCheckOutOfMemory | None = None
    #: The attempt failed in the loss-weighting check (alike on every rank).
    in_check: bool = False


class AttemptLoop:
    """Runs one Trainer's training and evaluation batches as attempts, for its :class:`MicroBatchEngine`.

    It asks the engine's ``users`` (``users.py``), changes k through ``splits`` and turns on the ``ladder``'s
    rungs; the engine sets :attr:`exchange` when it installs.
    """

    def __init__(
        self, trainer: pl.Trainer, users: Users, splits: Splits, ladder: Ladder, watch: CompileWatch
    ) -> None:
        self.trainer = trainer
        self.users, self.splits, self.ladder, self.watch = users, splits, ladder, watch
        #: The Trainer's own methods the patches stand in for, and where ``self.log`` goes during an attempt.
        self.steps = Steps(trainer, watch=watch)
        #: How the ranks vote and reduce (``exchange.py``).
        self.exchange: Exchange = LocalExchange()
        self._patched: list[tuple[object, str]] = []
        self._ddp_forward_sync: bool | None = None
        self._skip_backward = False
        self._skip_zero_grad = False
        #: The smallest micro-batch (samples) that ran in this fit, per stage.
        self._smallest_ran: dict[str, int] = {}
        #: The optimizer step's shares of the ranks' and accumulated batches' tokens (``step_shares.py``).
        self.shares = StepShares()
        #: The tokens of the evaluation batch running now, where the loss is a token mean (``None``: not counted).
        self._eval_tokens: int | None = None
        self._skip_recorded = False

    @property
    def phase(self) -> str:
        """The phase of the training attempt running now (``"forward"``, ``"backward"``)."""
        return self.steps.phase

    # ------------------------------------------------------------------ patches

    def patch_evaluation(self, module: pl.LightningModule) -> None:
        """Route ``self.log`` and the strategy's evaluation steps through the loop."""
        strategy, steps = self.trainer.strategy, self.steps
        steps.module = module
        steps.log = module.log
        module.log = self._log
        self._patched.append((module, "log"))
        for stage in EVAL_STAGES:
            name = f"{stage}_step"
            steps.eval_steps[stage] = getattr(strategy, name)
            setattr(strategy, name, self._eval_step_for(stage))
            self._patched.append((strategy, name))
        steps.side_effects = SideEffects(module)

    def patch_training(self, ddp: torch.nn.Module | None) -> None:
        """Route the strategy's training step, the module's backward and its ``optimizer_zero_grad`` through the loop.

        ``ddp``: the DDP-wrapped module under DDP; the engine never lets DDP sync, so DDP must not broadcast
        buffers at the start of a forward either (the engine hands out rank 0's at the optimizer step).
        """
        strategy, steps = self.trainer.strategy, self.steps
        module = steps.module
        steps.training_step = strategy.training_step
        steps.backward = module.backward
        steps.zero_grad = module.optimizer_zero_grad
        strategy.training_step = self._training_step
        module.backward = self._backward
        module.optimizer_zero_grad = self._optimizer_zero_grad
        self._patched += [(strategy, "training_step"), (module, "backward"), (module, "optimizer_zero_grad")]
        self._ddp_forward_sync = getattr(ddp, "require_forward_param_sync", None)
        if ddp is not None:
            ddp.require_forward_param_sync = False

    def unpatch(self) -> None:
        """Give the strategy and the module their own methods back."""
        if self._ddp_forward_sync is not None:
            self.trainer.strategy.model.require_forward_param_sync = self._ddp_forward_sync
            self._ddp_forward_sync = None
        for obj, name in self._patched:
            if name in vars(obj):
                delattr(obj, name)
        self._patched = []

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # Lightning's backward on the returned (detached) loss: the engine already ran every backward.
        if self._skip_backward:
            self._skip_backward = False
            return None
        return self.steps.backward(loss, *args, **kwargs)

    def _optimizer_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        # Lightning zeroes after training_step; the engine zeroed before the first micro-batch instead.
        if self._skip_zero_grad:
            self._skip_zero_grad = False
            return None
        return self.steps.zero_grad(*args, **kwargs)

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        capture = self.steps.capture
        if capture is None:
            return self._emit(name, value, *args, **kwargs)
        capture.calls.append((name, value, args, kwargs))
        return None

    def _emit(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``self.log``; in evaluation with a token-mean loss, a ``*loss*`` value is weighted by the
        batch's tokens in the epoch's mean (Lightning weights a batch by its ``batch_size``)."""
        if self._eval_tokens is not None and "loss" in name:
            kwargs["batch_size"] = self._eval_tokens
        return self.steps.log(name, value, *args, **kwargs)

    # ------------------------------------------------------------------ the two kinds of batch

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._skip_backward = self._skip_zero_grad = False
        users = self.users
        batch = TrainingBatch(
            self.steps, self.exchange, users.weighting, users.backward_listeners, args, kwargs
        )
        batch.start_k = self.splits.k
        batch.shares = self.shares
        batch.proposal = users.next_proposal()
        # A batch that would run whole runs as 2 micro-batches when a user asks, for a measurement (k unchanged).
        batch.measuring = bool(
            users.asks_measure_split
            and batch.first_in_window
            and batch.n >= 2
            and self.splits.effective_k(batch.n, batch.batch) == 1
            and users.may_split(batch.batch)
            and users.measure_split(batch.batch_idx)
        )
        output = self._run_attempts(batch)
        self._skip_backward = True
        self._skip_zero_grad = batch.first_in_window
        return output

    def _eval_step_for(self, stage: str) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            # Only where the first training batch asked for the decision: a decision taken at a later split
            # would change how the run's evaluation losses are averaged half-way through.
            wanted = stage in _TOKEN_MEAN_STAGES and self.shares.wanted
            counting = self.users.weighting.counting if wanted else None
            batch = args[0] if args else kwargs.get("batch")
            self._eval_tokens = _tokens_of(counting, batch)
            try:
                handled = self.users.decide_oom is not None
                if (
                    self.splits.eval_k.get(stage, 1) == 1
                    and not handled
                    and not self.exchange.votes_inside_step
                ):
                    return self.steps.eval_steps[stage](*args, **kwargs)
                batch = EvalBatch(
                    self.steps, self.exchange, self.users.weighting, stage, args, kwargs, handled
                )
                return self._run_attempts(batch)
            finally:
                self._eval_tokens = None

        return step

    def _k_of(self, batch: TrainingBatch | EvalBatch) -> int:
        """The micro-batches ``batch``'s next attempt runs as."""
        if batch.stage != "train":
            return self.splits.eval_k_of(batch.stage, batch.n, batch.batch)
        k = self.splits.effective_k(batch.n, batch.batch)
        return 2 if batch.measuring and k == 1 else k

    # ------------------------------------------------------------------ the one loop

    def _run_attempts(self, batch: TrainingBatch | EvalBatch) -> Any:
        """Run ``batch`` until every rank keeps an attempt; returns the kept attempt's output.

        After a failed attempt (an OOM, or another rank's at a vote inside the step) the attempt is dropped
        and memory freed outside the ``except`` block, the OOM decider says what this rank wants, and every
        rank takes the same decision from the votes: retry, or stop with an error on every rank.
        """
        probe = get_probe(self.trainer.strategy.root_device)
        # Host RSS says nothing about one step: read device figures only.
        run = _Run(probe, measured=probe.kind != "cpu", smallest_failed=batch.n + 1)
        while True:
            tried = self._attempt(batch, run)
            if tried.refused is not None:
                batch.drop()
                self._stop_measuring(batch, tried.refused)
                continue
            if tried.check_failed is not None:
                self._run_unchecked(batch, tried.k)
                continue
            if tried.failure is not None or tried.peer_votes is not None:
                # Outside the except block: the traceback and the activations it pinned are gone.
                tried.output = None
                batch.drop()
                free_memory()
            status, voted_k, fatal = self._vote_of(batch, tried, run)
            try:
                agreement = agree_or_stop(
                    batch.vote, status, voted_k, tried.k, tried.peer_votes, fatal, batch.where()
                )
            except torch.OutOfMemoryError as stop:
                if not tried.in_check:
                    if tried.failure is not None:
                        forensics.action_taken(stop_reason(stop))
                    batch.give_up()
                    raise
                # The error's frames hold this one and its batch: they must not outlive the step.
                stop.with_traceback(None)
                self._check_ran_out(batch, tried.k)
                continue
            done, output = self._settle(batch, tried, agreement, run)
            if done:
                return output

    def _attempt(self, batch: TrainingBatch | EvalBatch, run: _Run) -> _Tried:
        """Run one attempt as k micro-batches; a failure is described inside its ``except`` block."""
        users, n, stage = self.users, batch.n, batch.stage
        tried = _Tried(self._k_of(batch))
        k = tried.k
        baseline = run.probe.allocated if run.measured else None
        marker = self.watch.before_attempt()
        try:
            tried.output = batch.attempt(k)
        except PeerFailure as err:
            tried.peer_votes = err.votes
        except LossWeightingError as err:  # the check refused to split: not an OOM to retry
            if not batch.measuring:
                batch.give_up()
                raise
            tried.refused = err.with_traceback(None)  # only a measurement asked for the split: run whole
        except WeightingCheckOutOfMemory as err:
            if batch.measuring or users.decide_oom is None:
                tried.check_failed = err.with_traceback(None)
            else:  # the attempt's OOM: a larger k, and the check again
                tried.in_check = True
                tried.failure = self._caught(err, batch, run, "forward", k, baseline)
        except Exception as err:
            # cuDNN's CUDNN_STATUS_NOT_SUPPORTED is often a size limit: shrink once, then re-raise the original.
            size_error = (
                batch.retries_size_errors
                and is_maybe_size_error(err)
                and users.decide_oom is not None
                and k < n
            )
            if size_error and run.first_size_error is not None:
                batch.give_up()
                raise run.first_size_error from None
            if users.decide_oom is None or not (is_oom_error(err) or size_error):
                batch.give_up()
                self._raise_if_too_small(err, n, k, stage)
                raise
            if size_error:  # re-raised later: its frames must not pin memory
                run.first_size_error = err.with_traceback(None)
            if stage != "train":  # an evaluation failure's phase is its stage
                self.steps.phase = stage
            tried.failure = self._caught(err, batch, run, self.steps.phase, k, baseline)
        finally:
            self.watch.after_attempt(self.trainer, marker, stage, n, k)
        return tried

    def _caught(
        self,
        err: BaseException,
        batch: TrainingBatch | EvalBatch,
        run: _Run,
        phase: str,
        k: int,
        baseline: int | None,
    ) -> OOMFailure:
        """Describe a failed attempt and tell the OOM listener, inside the ``except`` block: its tensors live."""
        probe = run.probe if run.measured else None
        failure = _describe(err, probe, self.trainer.global_step, batch, phase, k, baseline)
        _tell_caught(err, failure, batch, batch.stage)
        return failure

    def _run_unchecked(self, batch: TrainingBatch | EvalBatch, k: int) -> None:
        """The loss-weighting check ran out of memory where nothing splits further: the batch runs unchecked."""
        batch.drop()
        free_memory()
        if batch.measuring:  # only a measurement asked for the split: this batch runs whole, unchecked
            batch.measuring = False
        else:  # nothing may split further here: the fallback, said in one line
            batch.weighting.unchecked(
                self.trainer, _unchecked_where(batch.n, k, "and without OOMRecovery nothing splits further")
            )

    def _check_ran_out(self, batch: TrainingBatch | EvalBatch, k: int) -> None:
        """Every rank failed in the loss-weighting check with no larger k left: the weighting runs unchecked."""
        where = _unchecked_where(batch.n, k, "and no larger k is left")
        forensics.action_taken(f"loss weighting used unchecked: the check ran out of memory {where}")
        # Said once a batch runs with it: where the step cannot fit either, the run ends with its error.
        batch.weighting.unchecked(self.trainer, where, announce=False)
        self.exchange.recover()  # as before any retry, on every rank alike

    def _vote_of(
        self, batch: TrainingBatch | EvalBatch, tried: _Tried, run: _Run
    ) -> tuple[Status, int, BaseException | None]:
        """This rank's vote after an attempt: its status, the k it asks for, and an error that stops the run."""
        if tried.failure is None:
            proposal = batch.proposal
            status, voted_k = (
                (proposal.status, proposal.k) if proposal is not None else (Status.NONE, tried.k)
            )
            if batch.skipped and tried.peer_votes is None:
                status |= Status.SKIP
            return status, voted_k, None
        run.smallest_failed = min(run.smallest_failed, tried.failure.micro_batch_size)
        # The check's OOM climbs the ladder like the step's: a rung that frees memory the model holds (a
        # cache) helps it too, and where the check cannot fit, the training step rarely does.
        status, recovery, fatal = self._ask_decider(tried.failure, run.smallest_failed, batch.batch)
        return status, batch.voted_k(recovery, tried.k), fatal

    def _settle(
        self, batch: TrainingBatch | EvalBatch, tried: _Tried, agreement: Agreement, run: _Run
    ) -> tuple[bool, Any]:
        """Act on what the ranks agreed: keep or skip the batch (done, with Lightning's output), or run it again."""
        n, k, stage = batch.n, tried.k, batch.stage
        if tried.failure is not None:
            rungs = [self.ladder.rungs[i].name for i in agreement.rungs]
            forensics.action_taken(describe_action(stage, n, k, agreement.k, rungs))
        if not agreement.retry:
            if agreement.skip:  # a step returned None (on any rank): the batch is skipped on every rank
                return True, self._apply(batch, batch.skip(agreement, k), k)
            # Every rank kept its attempt, so every rank asks the checks here, at the same point (a check
            # may all-reduce its own flags, and answers alike on every rank).
            if not self._sent_back(batch, tried.output):
                batch.weighting.announce_unchecked(self.trainer)
                return True, self._apply(batch, batch.keep(tried.output, agreement, k), k)
            run.rechecks += 1
            if run.rechecks > _MAX_RECHECKS:
                batch.give_up()
                raise RuntimeError(
                    f"The micro-batch engine's attempt checks sent batch {batch.batch_idx} back {_MAX_RECHECKS} "
                    "times; a check must change what the batch runs under before it asks again."
                )
            tried.output = None
            batch.drop()
            return False, None
        if (
            tried.failure is None and tried.peer_votes is None
        ):  # another rank failed: this attempt is redone too
            tried.output = None
            batch.drop()
        # On every rank alike (FSDP2: reshard, reset FSDP's step state, drop its unsharded gradients).
        self.exchange.recover()
        if self.watch.at_cap(n, k, stage):  # 2 samples a micro-batch did not fit: 1 may now
            self.watch.allow_single(stage)
        if self._apply(batch, batch.retry(agreement, tried.failure, k), k):
            run.smallest_failed = n + 1  # a sample needs less memory now: sizes that failed may fit
        return False, None

    # ------------------------------------------------------------------ what the loop applies

    def _apply(self, batch: TrainingBatch | EvalBatch, outcome: Outcome, k: int) -> Any:
        """Apply a batch's outcome: the only place a batch changes k, turns on rungs or replays its logs.

        Returns the output for Lightning (keep, skip), or, for a retry, whether a rung changed what a sample needs.
        """
        n, stage = batch.n, batch.stage
        if outcome.kind is OutcomeKind.RETRY:
            if stage != "train":
                self.splits.set_eval_k(stage, outcome.k, outcome.reason, n)
                return False
            changed = self.ladder.turn_on(
                outcome.rungs, f"{outcome.reason}, and the micro-batches cannot get smaller"
            )
            self.splits.propose(outcome.k, outcome.source, outcome.reason, batch_size=n)
            return changed
        if outcome.logs is not None:  # an evaluation step that ran whole, straight through, captured nothing
            self._ran(n, k, stage)
            emit_logs(self._emit, *outcome.logs, n, self.users.sum_log_keys)
        if stage == "train":
            if outcome.kind is OutcomeKind.SKIP:
                self.exchange.recover()
            elif batch.boundary:
                self.exchange.reduce()
                batch.finish()
        if outcome.source:
            self.splits.propose(outcome.k, outcome.source, outcome.reason, batch_size=n)
        if outcome.skipped_split is not None:
            self._skipped_split(*outcome.skipped_split)
        return outcome.output

    def _stop_measuring(self, batch: TrainingBatch, refusal: BaseException) -> None:
        """The loss-weighting check refused the split a measurement asked for: run whole, ask for no more splits.

        The check is reset, so a split an OOM needs later is checked (and refused) as ever; the askers hear why.
        """
        batch.measuring = False
        batch.weighting.load_state_dict({})
        self.users.measure_refused(str(refusal))

    def _sent_back(self, batch: TrainingBatch | EvalBatch, output: Any) -> bool:
        """Whether an attempt check asks to run the kept attempt's training batch again (asked in order)."""
        checks = self.users.checks
        if not checks or batch.stage != "train":
            return False
        loss = output.get("loss") if isinstance(output, Mapping) else output
        return any(check(batch.batch_idx, loss) for check in checks)

    def _skipped_split(self, micro_batch: int, k: int) -> None:
        """Record, once per fit, that a micro-batch's ``None`` skipped the whole batch (the rule, as a decision)."""
        if self._skip_recorded:
            return
        self._skip_recorded = True
        record_decision(
            self.trainer,
            "skipped batch",
            "MicroBatchEngine",
            f"training_step returned None for micro-batch {micro_batch} of {k} at step {self.trainer.global_step}: "
            "the whole batch is skipped (the gradients of its micro-batches dropped), as `return None` on the whole "
            "batch would; every micro-batch that returns None skips its batch alike",
            micro_batch=micro_batch,
            k=k,
        )

    def _ran(self, n: int, k: int, stage: str) -> None:
        """Remember the smallest micro-batch that ran in this fit (per stage)."""
        size = n // k
        if size >= 1:
            self._smallest_ran[stage] = min(self._smallest_ran.get(stage, size), size)

    def _raise_if_too_small(self, err: BaseException, n: int, k: int, stage: str) -> None:
        """Turn an error at micro-batches smaller than any that ran in this fit into :class:`MicroBatchOOMError`.

        Only after a split the OOM decider (OOMRecovery) asked for: such an error (BatchNorm's "Expected more
        than 1 value per channel", a shape a model cannot take) says the model cannot run micro-batches
        this small, not that the user's code is wrong.
        """
        if self.users.decide_oom is None or k <= 1 or isinstance(err, torch.OutOfMemoryError):
            return
        size = n // k
        smallest = self._smallest_ran.get(stage)
        if smallest is not None and size >= smallest:
            return
        ran = (
            f"the smallest that ran in this fit had {smallest}" if smallest is not None else "none ran before"
        )
        raise MicroBatchOOMError(
            f"{type(err).__name__} in {stage} at micro-batches of {size} sample(s) (k {k} for a batch of {n}), "
            f"smaller than any that ran ({ran}): the model cannot run micro-batches this small; it needs at least "
            f"{size + 1} samples per micro-batch (BatchNorm in training mode needs 2). Set "
            f"OOMRecovery(min_micro_batch_size={size + 1}), and lower the memory a sample needs (a lower-memory "
            f"precision, activation checkpointing, a sharded strategy). Original error: {err}"
        ) from err

    def _ask_decider(
        self, failure: OOMFailure, smallest_failed: int, batch: Any
    ) -> tuple[Status, Recovery | None, BaseException | None]:
        """This rank's say after an OOM: (the vote's flags, the decider's :class:`Recovery`, the error that
        ends the run on this rank when nothing is left to try)."""
        users = self.users
        try:
            recovery = users.decide_oom(failure, smallest_failed, users.may_split(batch))
        except torch.OutOfMemoryError as err:  # nothing left to try (MicroBatchOOMError)
            return Status.FATAL, None, err
        if isinstance(recovery, int):
            recovery = Recovery(recovery)
        return Status.OOM | rung_bits(self.ladder.index(name) for name in recovery.rungs), recovery, None


def _tokens_of(counting: Any, batch: Any) -> int | None:
    """What ``counting`` counts in an evaluation batch (``None``: nothing to count, or an evaluation batch without
    the training's labels: Lightning's own mean)."""
    if counting is None or batch is None:
        return None
    try:
        return int(counting.count(batch))
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def agree_or_stop(
    vote: VoteFn,
    status: Status,
    voted_k: int,
    k: int,
    peer_votes: list[Vote] | None,
    fatal: BaseException | None,
    where: str,
) -> Agreement:
    """Every rank's decision on an attempt; raises on every rank alike when any rank has nothing left to try.

    ``peer_votes``: the votes at which another rank's failure already stopped this attempt (FSDP2).
    """
    agreement = agree(peer_votes if peer_votes is not None else vote(status, voted_k), k)
    if agreement.fatal_ranks:
        if fatal is not None:
            raise fatal
        raise RankOutOfMemoryError(
            f"Rank(s) {', '.join(map(str, agreement.fatal_ranks))} ran out of memory {where} with nothing "
            "left to split; every rank stops (the error on those ranks has the memory breakdown and next "
            "steps)."
        )
    return agreement


def _unchecked_where(n: int, k: int, why: str) -> str:
    """Where the loss-weighting check ran out of memory, for the line that says the weighting is unchecked."""
    size = math.ceil(n / k)
    return f"at micro-batches of {size} sample{'s' if size != 1 else ''} (k {k}), {why}"


def _tell_caught(
    err: BaseException, failure: OOMFailure, batch: TrainingBatch | EvalBatch, stage: str
) -> None:
    """Tell the OOM listener (GPUOptReport) what failed, while the failed attempt's tensors are still alive."""
    forensics.failure_caught(
        err,
        stage=stage,
        phase=failure.phase if stage == "train" else "forward",
        step=failure.step,
        k=failure.k,
        batch_size=failure.batch_size,
        micro_batch_size=failure.micro_batch_size,
        gradients=[g for g in (getattr(batch, "stash", None) or ()) if g is not None],
        held_before_bytes=failure.baseline_bytes,
    )


def _describe(
    err: BaseException,
    probe: MemoryProbe | None,
    step: int,
    batch: TrainingBatch | EvalBatch,
    phase: str,
    k: int,
    baseline: int | None,
) -> OOMFailure:
    """What the OOM handler is told about a failed attempt (gradient figures for a training batch only)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    allocated = limit = None
    if probe is not None:
        try:
            allocated, limit = probe.allocated, probe.total
        except Exception:  # a probe that cannot answer must not hide the OOM
            pass
    params = batch.params if probe is not None else None
    gradients = held = None
    if params is not None:
        gradients = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        held = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    n = batch.n
    return OOMFailure(
        step=step,
        batch_idx=batch.batch_idx,
        phase=phase,
        batch_size=n,
        k=k,
        micro_batch_size=math.ceil(n / k),
        baseline_bytes=baseline,
        allocated_bytes=allocated,
        tried_bytes=parse_tried_bytes(str(err)),
        limit_bytes=limit or None,
        message=message,
        gradient_bytes=gradients,
        held_gradient_bytes=held,
    )
