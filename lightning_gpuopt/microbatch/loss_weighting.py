"""Which weighting of micro-batch losses reproduces the user's own loss, found by running it.

A batch split into k micro-batches reproduces the whole batch's loss (and so its gradient) only when
each micro-batch's loss is weighted by its share of what the loss averages over: samples for a
per-sample mean, tokens for a token mean over padded sequences (shifted by one for a causal LM),
nothing for a sum. The engine asks :class:`LossWeighting` for the weights of every split.

With ``mode="auto"`` (the default) the first split runs the user's ``training_step`` on a piece of two
samples of the real batch and on each sample, without gradients and leaving no trace, and keeps the
candidate whose weighted combination matches the piece's loss within the precision's rounding; a
``transformers`` head decides between candidates that still match, and a loss that no weighting
reproduces is refused before the split runs (:class:`~lightning_gpuopt.microbatch.errors.LossWeightingError`).
A check that runs out of memory is the attempt's OOM (a larger k, then :meth:`LossWeighting.unchecked`, said
in one line); random draws are replayed on the parts (``replay.py``). The plain rules are in
``loss_weighting_rules.py``; docs/oom-recovery.md ("Loss weighting") has the long form.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_gpuopt._validate import choice
from lightning_gpuopt._warnings import warn
from lightning_gpuopt.batch_split import UnsplittableBatchError, batch_size_of, slice_samples
from lightning_gpuopt.decisions import record_decision
from lightning_gpuopt.memory.oom import free_memory, is_oom_error
from lightning_gpuopt.microbatch.errors import LossWeightingError, WeightingCheckOutOfMemory
from lightning_gpuopt.microbatch.exchange import broadcast_from_rank_zero, first_rank_where
from lightning_gpuopt.microbatch.loss_weighting_rules import (
    HEAD_WEIGHTING,
    Candidate,
    CheckResult,
    HFHead,
    Weighting,
    candidates,
    choose,
    hf_head,
    piece_of,
    selected_tokens_match,
    tolerance,
)
from lightning_gpuopt.microbatch.replay import HostRandom, PartRun, RandomDraws

__all__ = ["CheckSite", "LossReduction", "LossWeighting", "OnMismatch", "quiet_forward"]

#: Batches that run whole on which an undecided check runs at most (see ``LossWeighting.weights``).
_WHOLE_CHECKS = 16

#: What ``OOMRecovery(loss_reduction=...)`` accepts.
LossReduction = Literal["auto", "mean", "tokens", "sum"]
#: What ``OOMRecovery(on_mismatch=...)`` accepts.
OnMismatch = Literal["raise", "warn"]


@dataclass(frozen=True)
class CheckSite:
    """What the loss-weighting check runs with: the few things of the engine it uses, not the engine.

    Attributes:
        trainer: the Trainer (its module, precision, rank; the decisions are recorded on it).
        leave_no_trace: runs extra forwards whose side effects are undone (the engine's).
        votes_inside_step: the ranks vote before each collective (FSDP2): an OOM in the check is the attempt's.
    """

    trainer: pl.Trainer
    leave_no_trace: Callable[[], contextlib.AbstractContextManager[None]]
    votes_inside_step: bool = False


@contextlib.contextmanager
def _eager() -> Any:
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield


@contextlib.contextmanager
def quiet_forward(module: torch.nn.Module, no_trace: contextlib.AbstractContextManager) -> Any:
    """Run forwards that leave no trace: no gradients, dropout off, BatchNorm on running statistics.

    ``no_trace`` is :attr:`CheckSite.leave_no_trace`'s
    (``self.log`` captured and dropped, torchmetrics and BatchNorm states restored). torch's RNG is forked
    (CPU and the module's CUDA devices), Python's and NumPy's global states are put back on exit, and
    ``torch.compile`` runs eagerly. Warnings the step gives there are not shown: they would be the check's
    (torch's on a statistic of one sample, say), and the training steps give their own.
    """
    modes = [(m, m.training) for m in module.modules()]
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    host = HostRandom()
    try:
        module.eval()
        with no_trace, torch.random.fork_rng(devices=devices), torch.no_grad(), _eager():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
    finally:
        host.restore()
        for m, mode in modes:
            m.training = mode


def _loss_value(output: Any) -> float | None:
    """The step's loss as a float; ``None`` for a step that skipped (``None``, or a dict without ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if loss is None:
        return None
    if isinstance(loss, Tensor) and loss.numel() == 1:
        return float(loss.detach().double())
    if isinstance(loss, Tensor):
        raise LossWeightingError(
            f"training_step returned a loss of shape {tuple(loss.shape)}: a batch split into micro-batches needs "
            "one number per step, so reduce it (loss.mean(), loss.sum()) as you would for backward()"
        )
    raise LossWeightingError(
        f"training_step returned a {type(loss).__name__} as its loss: a batch split into micro-batches needs a "
        'scalar tensor (or a dict with one under "loss")'
    )


@dataclass
class _Measured:
    """The check's three forwards: the piece's loss and its parts' (``None`` where the step skipped the batch)."""

    piece: float | None = None
    parts: list[float | None] = field(default_factory=list)
    runs: list[PartRun] = field(default_factory=list)
    replayed: bool = False
    #: What could not be replayed (Python's or NumPy's generator, a part's draws), for the refusal.
    unreplayable: str | None = None
    #: The error a step that draws nothing raised on one sample (it cannot run alone), for the refusal.
    alone: str | None = None

    @property
    def skipped(self) -> bool:
        """The step returned ``None`` for the piece, or for a part it ran normally: decide at the next split."""
        if self.piece is None:
            return True
        return self.unreplayable is None and any(loss is None for loss in self.parts)


def _measure(
    run_piece: Callable[[Any], Any], piece: Any, m: int, bounds: Sequence[tuple[int, int]], parts: list[Any]
) -> _Measured:
    """Run the piece (its random draws recorded) and each part (the draws replayed): see ``replay.py``.

    All three calls run whatever the first ones found (under FSDP2 every rank runs them together: a rank that
    stopped early would leave the others waiting in a collective).
    """
    draws = RandomDraws(m)
    measured = _Measured()
    try:
        with draws.record():
            measured.piece = _loss_value(run_piece(piece))
        measured.replayed = draws.drew
        if draws.host is not None:
            measured.unreplayable = f"it draws from {draws.host}"
        for (lo, hi), part in zip(bounds, parts):
            with draws.replay(lo, hi) as run:
                measured.runs.append(run)
                try:
                    output = run_piece(part)
                except Exception as err:
                    if is_oom_error(err):
                        raise
                    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    if not draws.drew:  # nothing replayed to blame: the step cannot run on one sample
                        measured.alone = measured.alone or f"{type(err).__name__}: {text}"
                        output = None
                        continue
                    run.failure = (
                        f"with the piece's random values replayed on a part, it raised {type(err).__name__}: {text} "
                        "(random indices into the batch, such as a permutation for mixup, couple its samples)"
                    )
                    output = None
            if run.failure is not None and measured.unreplayable is None:
                measured.unreplayable = run.failure
            measured.parts.append(_loss_value(output) if run.failure is None else None)
            del output  # a part's outputs (logits...) must not stay alive while the next part runs
    finally:
        draws.clear()
    return measured


class LossWeighting:
    """The engine's weighting of micro-batch losses: a fixed one, or ``"auto"`` (decided by the check).

    Args:
        mode: ``"auto"``, ``"mean"`` (sample shares), ``"tokens"`` (``token_key != ignore_index``) or ``"sum"``.
        weight_fn: counts a micro-batch's share (overrides ``mode``'s count); checked like the others.
        token_key: the batch entry holding labels (or an attention mask).
        ignore_index: the padding value in ``token_key``.
        on_mismatch: ``"raise"`` (refuse to split when the weighting does not reproduce the loss) or ``"warn"``.
        check: run the check at the first split (``False``: use ``mode`` unchecked, ``"auto"`` as sample shares).
        source: who set it, for decisions and messages.
    """

    def __init__(
        self,
        mode: LossReduction = "auto",
        weight_fn: Callable[[Any], Any] | None = None,
        token_key: str | int = "labels",
        ignore_index: int = -100,
        on_mismatch: OnMismatch = "raise",
        check: bool = True,
        source: str = "OOMRecovery",
    ) -> None:
        choice("loss_reduction", mode, LossReduction)
        choice("on_mismatch", on_mismatch, OnMismatch)
        self.mode = mode
        self.weight_fn = weight_fn
        self.token_key = token_key
        self.ignore_index = ignore_index
        self.on_mismatch = on_mismatch
        self.check = check
        self.source = source
        #: The weighting in force once decided (or given); ``None`` in ``"auto"`` before the first split.
        self.decided: Candidate | None = self._given()
        #: The check's result, once it ran.
        self.result: CheckResult | None = None
        #: Print the decision on rank zero (it is recorded either way).
        self.verbose = True
        self._checked = False
        #: The check could not run for lack of memory: the fallback is used, and the check runs again on resume.
        self._unchecked = False
        self._unannounced = False
        self._warned = False
        #: The candidates the check's samples could not tell apart (equal lengths): used while later batches
        #: weight their micro-batches alike too; the check runs again at the first split of one that does not.
        self._alike: list[Candidate] = []
        #: Batches that run whole still checked while undecided (a tie or equal counts decide nothing there): a
        #: model whose tokens cost alike, or data whose samples hold as many tokens, is not checked at every step.
        self._whole_checks_left = _WHOLE_CHECKS

    def _given(self) -> Candidate | None:
        if self.weight_fn is not None:
            name = getattr(self.weight_fn, "__name__", None) or repr(self.weight_fn)
            return Candidate(Weighting.CUSTOM, f"weight_fn ({name})", count_fn=self.weight_fn)
        if self.mode == "mean":
            return Candidate(Weighting.SAMPLES, "sample shares")
        if self.mode == "sum":
            return Candidate(Weighting.SUM, "sum (micro-batch losses added)")
        if self.mode == "tokens":
            where = f"{self.token_key} != {self.ignore_index}"
            return Candidate(Weighting.TOKENS, f"tokens ({where})", self.token_key, self.ignore_index)
        return None

    # ------------------------------------------------------------------ what the engine asks

    @property
    def settings(self) -> tuple[Any, ...]:
        """What the weighting was given (two weightings with the same settings decide alike)."""
        return (self.mode, self.weight_fn, self.token_key, self.ignore_index, self.on_mismatch, self.check)

    def weights(
        self,
        chunks: list[Any],
        site: CheckSite,
        run_piece: Callable[[Any], Any] | None = None,
        batch: Any = None,
        decide_whole: bool = False,
    ) -> list[float]:
        """The weights of ``chunks`` (the micro-batches of ``batch``), deciding first when still undecided.

        ``run_piece(micro_batch)`` runs the user's training step on a micro-batch and returns its output (given
        with ``batch``, the whole batch the check picks its two samples from); ``None`` (evaluation) uses the
        decision made so far, or the fallback (HF head, else samples). ``decide_whole``: a batch that runs whole
        is checked too (the optimizer step's shares of ranks and accumulated batches need the decision).
        """
        if len(chunks) == 1 and (not decide_whole or self._whole_checks_left <= 0):
            return [1.0]
        if len(chunks) == 1:
            self._whole_checks_left -= 1  # the same count on every rank: every rank asks at every batch
        if not self._checked and self.check and run_piece is not None:
            source = 0
            if self._alike and len(chunks) > 1:
                # Every rank's split asks (k is agreed): the first rank whose micro-batches the candidates
                # weight differently checks, on its own batch; while none does, any of them is exact.
                source = first_rank_where(not _weigh_alike(self._alike, chunks))
                if source is None:
                    return self._alike[0].weights(chunks)
            self._decide(site, chunks, run_piece, batch, source, tentative=len(chunks) == 1)
        if len(chunks) == 1:
            return [1.0]
        return (self.decided or (self._alike or [None])[0] or self._fallback(site.trainer)).weights(chunks)

    @property
    def counting(self) -> Candidate | None:
        """The decided weighting where the loss is a mean over counted tokens (``weight_fn`` counts too): the
        optimizer step then shares its loss among ranks and accumulated batches by those counts; ``None`` while
        undecided, or for sample shares and sums (Lightning's own averaging)."""
        chosen = self.decided
        if chosen is None or chosen.kind in (Weighting.SAMPLES, Weighting.SUM):
            return None
        return chosen

    @property
    def undecided(self) -> bool:
        """The check is still to run (``"auto"``, checking on, nothing decided or loaded)."""
        return self.check and not self._checked

    def _fallback(self, trainer: pl.Trainer) -> Candidate:
        head = hf_head(trainer.lightning_module)
        if head is not None and head is not HFHead.SEQUENCE_CLASSIFICATION:
            kind = HEAD_WEIGHTING[head]
            where = f"{self.token_key} != {self.ignore_index}"
            text = f"tokens ({where}{', shifted by one' if kind is Weighting.TOKENS_SHIFTED else ''})"
            return Candidate(kind, text, self.token_key, self.ignore_index)
        return Candidate(Weighting.SAMPLES, "sample shares")

    def _decide(
        self,
        site: CheckSite,
        chunks: list[Any],
        run_piece: Callable[[Any], Any],
        batch: Any,
        source_rank: int = 0,
        tentative: bool = False,
    ) -> None:
        """Run the check (on ``source_rank``'s batch) and take its result. ``tentative``: asked of a batch that runs
        whole; a tie (an untrained model's losses often are: every token costs about the same) decides nothing, and
        the next batch asks again."""
        trainer = site.trainer
        module = trainer.lightning_module
        head = hf_head(module)
        source = batch
        options = candidates(source, self.token_key, self.ignore_index)
        if self.decided is not None and self.decided not in options:
            options = [self.decided, *options]
        tol = tolerance(getattr(trainer, "precision", None))
        try:  # two samples, the shortest and the longest: the smallest piece that tells the candidates apart
            piece = piece_of(source, options)
            m = batch_size_of(piece)
        except (UnsplittableBatchError, ValueError, TypeError, KeyError, IndexError):
            m = 0
        if m == 2:
            result = self._check_two_samples(site, run_piece, piece, options, tol, head)
        else:
            reason = "the batch has no two samples to check on"
            result = CheckResult(
                self.decided or self._fallback(trainer), {}, 0.0, checked=False, reason=reason
            )
        pool = [*options, *(c for c in (self.decided, self._fallback(trainer)) if c is not None)]
        result = _from_rank(result, pool, source_rank)
        if result.alike and self.decided is None:
            named = {c.description: c for c in reversed(pool)}  # the first of each name
            alike = [named[d] for d in result.alike]
            differs = first_rank_where(not _weigh_alike(alike, chunks))
            if differs is None:
                self._alike = alike  # exact on this batch whichever it is: decide where samples differ
                return
            if differs != source_rank:  # another rank's samples can tell them apart: its check decides
                self._decide(site, chunks, run_piece, batch, differs, tentative)
                return
        if tentative and self.decided is None and (result.tied or not result.checked):
            return  # nothing told apart (or no room to check) on a batch that runs whole: the next one asks again
        if result.out_of_memory is not None:
            if (
                self.decided is None
            ):  # "auto": the batch runs at a larger k, or with the fallback said in one line
                raise WeightingCheckOutOfMemory(
                    f"the loss-weighting check (your training_step on 2 samples, without gradients) ran out of "
                    f"memory: {result.out_of_memory}"
                )
            reason = "the check ran out of memory on 2 samples"  # a given weighting is used as given
            result = CheckResult(None, {}, tol, checked=False, reason=reason)
        elif not result.checked and result.chosen is None and result.refusal is None:
            return  # the step skipped the piece (on rank 0): decide at the next split
        self.result = result
        self._checked = True
        self._take(trainer, result)

    def _check_two_samples(
        self,
        site: CheckSite,
        run_piece: Callable[[Any], Any],
        piece: Any,
        options: list[Candidate],
        tol: float,
        head: HFHead | None,
    ) -> CheckResult:
        """This rank's check: the user's loss on a piece of two samples, and on each, against each candidate."""
        trainer = site.trainer
        bounds = [(0, 1), (1, 2)]
        parts = [slice_samples(piece, 2, lo, hi) for lo, hi in bounds]
        measured: _Measured | None = None
        out_of_memory: str | None = None
        free_memory(generation=1)  # the young cycles earlier steps left (the last OOM freed the rest)
        try:
            with quiet_forward(trainer.lightning_module, site.leave_no_trace()):
                measured = _measure(run_piece, piece, 2, bounds, parts)
        except Exception as err:
            if not is_oom_error(err) or site.votes_inside_step:
                raise  # FSDP2: an OOM here is the attempt's, voted on like any other (the check runs again)
            # Every rank still reaches the broadcast after the check; rank 0's outcome is every rank's.
            out_of_memory = _first_line(err)
        if out_of_memory is not None:
            free_memory()  # outside the except block: the traceback no longer pins the check's tensors
            return CheckResult(None, {}, tol, checked=False, out_of_memory=out_of_memory)
        if measured.alone is not None:
            return _cannot_run_alone(measured.alone, tol)
        if measured.skipped:  # the step returned None: decide at the next split
            return CheckResult(None, {}, tol, checked=False)
        if measured.unreplayable is not None:
            return _unreplayable(measured.unreplayable, tol)
        if not math.isfinite(measured.piece):
            reason = "your loss was not finite on the checked samples"
            return CheckResult(self.decided or self._fallback(trainer), {}, tol, checked=False, reason=reason)
        if not all(math.isfinite(v) for v in measured.parts):
            # A mean or sum over samples is finite on each sample where it is finite on both: this loss
            # couples them (a statistic of the batch), and no weighting of micro-batch losses reproduces it.
            return CheckResult(None, {o.description: math.inf for o in options}, tol)
        return _compare(measured, parts, options, tol, head)

    def unchecked(self, trainer: pl.Trainer, where: str, announce: bool = True) -> None:
        """The check cannot run (out of memory ``where``, with no larger k left): split with the fallback, said
        once in one line (``announce=False``: by :meth:`announce_unchecked`, once a batch ran with it). The check
        runs again after a resume."""
        fallback = self._fallback(trainer)
        tol = tolerance(getattr(trainer, "precision", None))
        reason = f"the check ran out of memory on 2 samples {where}"
        self.result = CheckResult(fallback, {}, tol, checked=False, reason=reason)
        self.decided, self._checked, self._unchecked = fallback, True, True
        self._unannounced = not announce
        if announce:
            self._announce(trainer, fallback, self.result)

    def announce_unchecked(self, trainer: pl.Trainer) -> None:
        """Say the unchecked fallback :meth:`unchecked` kept quiet, now that a batch ran with it (a run that ends
        in an OOM anyway ends with that error alone)."""
        if self._unannounced and self.decided is not None and self.result is not None:
            self._unannounced = False
            self._announce(trainer, self.decided, self.result)

    def _take(self, trainer: pl.Trainer, result: CheckResult) -> None:
        """Use what the check decided; a given weighting stays, flagged when it does not reproduce the loss."""
        given = self.decided
        if given is not None:  # explicit: used as given, flagged when it does not reproduce the loss
            error = result.errors.get(given.description)
            if result.checked and (error is None or error > result.tolerance):
                self._mismatch(result, given)
            self._announce(trainer, given, result, explicit=True)
            return
        if (
            result.refusal is not None
        ):  # the check could not compare: the user says what the loss averages over
            self._refuse(result.refusal)
            self.decided = Candidate(Weighting.SAMPLES, "sample shares")  # only reached with "warn"
            return
        if result.chosen is None:
            self._mismatch(result, None)
            self.decided = Candidate(Weighting.SAMPLES, "sample shares")  # only reached with "warn"
            return
        self.decided = result.chosen
        if (result.tied or result.alike) and hf_head(trainer.lightning_module) is None:
            tied = [d for d, e in result.errors.items() if e <= result.tolerance]
            why = "they count them alike" if result.alike else "their losses are too close to tell them apart"
            warn(
                f"loss weighting: {', '.join(tied)} all reproduce your loss on the two checked samples ({why}); "
                f"keeping {result.chosen.description}. Pass `loss_reduction=` or `weight_fn=` to OOMRecovery to "
                "choose."
            )
        self._announce(trainer, result.chosen, result)

    def _announce(
        self, trainer: pl.Trainer, chosen: Candidate, result: CheckResult, explicit: bool = False
    ) -> None:
        if result.reason is not None:
            how = f"not checked: {result.reason}"
        else:
            how = f"matches your loss to {result.errors.get(chosen.description, math.nan):.1g}"
            if result.replayed:
                how += " (with the step's random draws replayed on the parts)"
        head = hf_head(trainer.lightning_module)
        if result.tied and head is not None and not explicit:
            how += f" (a tie, decided by the Hugging Face {head.value} head)"
        message = f"loss weighting: {chosen.description}{' (given)' if explicit else ''} — {how}"
        unchecked = not result.checked and not explicit
        if unchecked:
            message += (
                f"; used unchecked for every split. If your loss is not {_MEANS[chosen.kind]}, the split changes "
                "your training. " + _ASK_FOR_REDUCTION
            )
        record_decision(
            trainer,
            "loss weighting",
            self.source,
            message,
            weighting=chosen.kind.value,
            description=chosen.description,
            mismatch=result.errors.get(chosen.description),
            tolerance=result.tolerance,
            checked=result.checked,
        )
        if unchecked:
            if getattr(trainer, "is_global_zero", True):  # every rank holds rank 0's decision: one line
                warn(message)
        elif self.verbose:
            rank_zero_info(message)

    def _mismatch(self, result: CheckResult, given: Candidate | None) -> None:
        measured = ", ".join(f"{d}: {e:.2g}" for d, e in result.errors.items())
        better = ""
        if given is not None and result.chosen is not None and result.chosen != given:
            better = f" {result.chosen.description} does reproduce it (`loss_reduction='auto'` finds it)."
        what = (
            f"the given weighting, {given.description}, does not reproduce your loss"
            if given is not None
            else "no weighting of micro-batch losses reproduces your loss"
        )
        message = (
            f"loss weighting: {what} on two samples of the batch, together and apart (relative differences: {measured}; "
            f"allowed {result.tolerance:.1g}).{better} Expected a loss that is a mean or sum over samples or tokens; a loss "
            "that couples the samples of a batch (in-batch negatives, contrastive losses, batch statistics) changes "
            "meaning when the batch is split. Declare it with `OOMRecovery(unsplittable=True)`, or pass a `weight_fn` "
            "that counts what your loss averages over"
            + (" (check the one given)" if given is not None and given.kind is Weighting.CUSTOM else "")
            + ", or `on_mismatch='warn'` to split anyway."
        )
        self._refuse(message)

    def _refuse(self, message: str) -> None:
        """Refuse to split (``LossWeightingError``), or, with ``on_mismatch="warn"``, warn once."""
        if self.on_mismatch == "warn":
            if not self._warned:
                self._warned = True
                warn(message)
            return
        raise LossWeightingError(message)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Plain state: the decision, so a resumed run does not check again."""
        if self._unchecked:
            return {"checked": False}
        chosen = self.decided if self._checked else None
        if chosen is None or chosen.kind is Weighting.CUSTOM:
            return {"checked": self._checked}
        return {
            "checked": self._checked,
            "kind": chosen.kind.value,
            "description": chosen.description,
            "key": chosen.key,
            "ignore_index": chosen.ignore_index,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._unchecked = False
        if not state.get("checked"):  # nothing decided yet (or an empty state): back to the constructor's
            self._checked, self.decided, self.result = False, self._given(), None
            return
        self._checked = True
        if "kind" in state and self.weight_fn is None:
            self.decided = Candidate(
                Weighting(state["kind"]),
                str(state["description"]),
                state.get("key"),
                int(state["ignore_index"]),
            )


#: Where replay is impossible, the user says what the loss averages over.
_ASK_FOR_REDUCTION = (
    'Pass `OOMRecovery(loss_reduction=...)`: "mean" for a mean over samples, "tokens" for a mean over '
    '`labels != -100`, "sum" for a sum.'
)


#: What each fallback weighting assumes the loss is, for the line that says it is used unchecked.
_MEANS = {
    Weighting.SAMPLES: "a mean over samples",
    Weighting.TOKENS: "a mean over those tokens",
    Weighting.TOKENS_SHIFTED: "a mean over those tokens",
    Weighting.MASK_TOKENS: "a mean over those tokens",
    Weighting.SUM: "a sum",
    Weighting.CUSTOM: "a mean over what `weight_fn` counts",
}


def _weigh_alike(options: Sequence[Candidate], chunks: Sequence[Any]) -> bool:
    """Whether every one of ``options`` gives ``chunks`` the same weights (any of them is then exact here)."""
    try:
        first, *others = (o.weights(chunks) for o in options)
    except (ValueError, KeyError, IndexError, TypeError, UnsplittableBatchError):
        return False
    return all(all(abs(a - b) <= 1e-12 for a, b in zip(first, other)) for other in others)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _cannot_run_alone(error: str, tol: float) -> CheckResult:
    """The check's answer for a step that draws nothing and fails on one sample (``error``: what it raised)."""
    message = (
        "loss weighting: the check runs your training_step on one sample of the batch at a time, and it raised "
        f"{error}; so it cannot find the weighting of micro-batch losses that reproduces your loss. "
        + _ASK_FOR_REDUCTION
    )
    reason = f"the step cannot run on one sample ({error})"
    return CheckResult(None, {}, tol, checked=False, refusal=message, reason=reason)


def _unreplayable(source: str, tol: float) -> CheckResult:
    """The check's answer for a step whose random numbers cannot be replayed on the parts (``source`` says why)."""
    message = (
        f"loss weighting: your training_step draws random numbers the check cannot replay on the parts of a "
        f"batch ({source}), so it cannot find the weighting of micro-batch losses that reproduces your loss. "
        + _ASK_FOR_REDUCTION
    )
    reason = f"the step's random numbers cannot be replayed ({source})"
    return CheckResult(None, {}, tol, checked=False, replayed=True, refusal=message, reason=reason)


def _compare(
    measured: _Measured, parts: list[Any], options: Sequence[Candidate], tol: float, head: HFHead | None
) -> CheckResult:
    """``choose`` on the measured losses; a mismatch explained by tokens the step selected at random is named."""
    result = choose(measured.piece, measured.parts, parts, options, tol, head)
    if not measured.replayed:
        return result
    if result.chosen is None and selected_tokens_match(
        measured.piece, measured.parts, [run.selected for run in measured.runs], tol
    ):
        message = (
            "loss weighting: your loss averages over tokens your training_step selects at random (random masking "
            "inside the step), so no count taken from the batch can match it and no weighting of micro-batch "
            "losses is exact. Mask in the collate function (the labels then mark the chosen tokens, and the check "
            'finds the token weighting), or pass `OOMRecovery(loss_reduction="mean")` to weight micro-batches by '
            "samples (approximate)."
        )
        reason = "the loss averages over tokens the step selects at random"
        return CheckResult(
            None, result.errors, tol, checked=False, replayed=True, refusal=message, reason=reason
        )
    return CheckResult(
        result.chosen, result.errors, tol, result.tied, result.checked, replayed=True, alike=result.alike
    )


def _from_rank(result: CheckResult, pool: Sequence[Candidate], src: int = 0) -> CheckResult:
    """Every rank takes rank ``src``'s result (DDP: one rank decides, 0 unless its batch cannot tell the
    candidates apart; FSDP2: every rank ran the check together).

    Plain values travel (a user's ``weight_fn`` need not pickle); each rank finds the chosen candidate
    among its own by description.
    """
    chosen = result.chosen.description if result.chosen is not None else None
    sent = (
        chosen,
        dict(result.errors),
        result.tolerance,
        result.tied,
        result.checked,
        result.replayed,
        result.refusal,
        result.reason,
        result.out_of_memory,
        result.alike,
    )
    chosen, errors, tol, tied, checked, replayed, refusal, reason, oom, alike = broadcast_from_rank_zero(
        sent, src
    )
    match = next((c for c in pool if c.description == chosen), None) if chosen is not None else None
    return CheckResult(match, errors, tol, tied, checked, replayed, refusal, reason, oom, alike)
