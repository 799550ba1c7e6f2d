"""Which weighting of micro-batch losses reproduces the user's own loss, found by running it.

A batch split into k micro-batches reproduces the whole batch's loss (and so its gradient) only when
each micro-batch's loss is weighted by its share of what the loss averages over: samples for a
per-sample mean, tokens for a token mean over padded sequences (shifted by one for a causal LM),
nothing for a sum. The engine asks :class:`LossWeighting` for the weights of every split.

With ``mode="auto"`` (the default), the first split of a run runs the user's ``training_step`` on a
piece of the real batch (the first micro-batch, at least two samples) and on that piece's two parts,
without gradients, with dropout off and BatchNorm on its running statistics, under ``fork_rng``, eagerly
under ``torch.compile``, and leaving no trace (logged values, torchmetrics states and BatchNorm
statistics are restored). Each :class:`Candidate`'s weighted combination of the parts' losses is
compared with the piece's own loss; the one that matches within the precision's rounding
(:func:`tolerance`) is used for the rest of the run. The parts are chosen so that the candidates' shares
differ as much as the piece allows, so they cannot tie. When several still match (the parts' losses are
too close to tell them apart), a Hugging Face ``transformers`` head inside the module decides
(:func:`hf_head`); without one sample shares are kept, with a warning. When none matches (in-batch
negatives, batch statistics), the split is refused before it runs (or, with ``on_mismatch="warn"``,
warned about once). An explicit ``mode`` or ``weight_fn`` is used as given and checked the same way.

Nothing here imports ``transformers``: a head is recognised by the class names of the module's MRO.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_gpuopt._warnings import warn
from lightning_gpuopt.batching import (
    UnsplittableBatchError,
    _slice,
    batch_size_of,
    first_samples,
    merge_outputs,
)
from lightning_gpuopt.memory.oom import is_oom_error

__all__ = [
    "MODES",
    "Candidate",
    "CheckResult",
    "HFHead",
    "LossWeighting",
    "Weighting",
    "candidates",
    "choose",
    "hf_head",
    "tolerance",
]

#: What ``OOMRecovery(loss_reduction=...)`` accepts.
MODES = ("auto", "mean", "tokens", "sum")
#: What ``OOMRecovery(on_mismatch=...)`` accepts.
ON_MISMATCH = ("raise", "warn")


class Weighting(str, enum.Enum):
    """The kinds of micro-batch weighting the check can pick from."""

    SAMPLES = "samples"
    TOKENS = "tokens"
    TOKENS_SHIFTED = "tokens-shifted"
    MASK_TOKENS = "attention-mask tokens"
    SUM = "sum"
    CUSTOM = "weight_fn"


class HFHead(str, enum.Enum):
    """The Hugging Face heads whose loss convention is known."""

    CAUSAL_LM = "causal LM"
    MASKED_LM = "masked LM"
    TOKEN_CLASSIFICATION = "token classification"
    SEQUENCE_CLASSIFICATION = "sequence classification"


#: The weighting each head's own loss uses (HF's ``ForCausalLMLoss`` shifts the labels by one).
_HEAD_WEIGHTING = {
    HFHead.CAUSAL_LM: Weighting.TOKENS_SHIFTED,
    HFHead.MASKED_LM: Weighting.TOKENS,
    HFHead.TOKEN_CLASSIFICATION: Weighting.TOKENS,
    HFHead.SEQUENCE_CLASSIFICATION: Weighting.SAMPLES,
}


@dataclass(frozen=True)
class Candidate:
    """One way to weight micro-batch losses.

    Attributes:
        kind: the weighting.
        description: for people, e.g. ``"tokens (labels != -100, shifted by one)"``.
        key: the batch entry counted (token kinds only).
        ignore_index: the value not counted in ``key``.
        count_fn: a user's ``weight_fn`` (``Weighting.CUSTOM`` only).
    """

    kind: Weighting
    description: str
    key: str | int | None = None
    ignore_index: int = -100
    count_fn: Callable[[Any], Any] | None = field(default=None, compare=False)

    def count(self, micro_batch: Any) -> float:
        """What this weighting counts in one micro-batch (1 for a sum)."""
        if self.kind is Weighting.SUM:
            return 1.0
        if self.kind is Weighting.SAMPLES:
            return float(batch_size_of(micro_batch))
        if self.kind is Weighting.CUSTOM:
            return float(self.count_fn(micro_batch))
        values = micro_batch[self.key]
        if self.kind is Weighting.TOKENS_SHIFTED:
            values = values[:, 1:]
        return float((values != self.ignore_index).sum())

    def per_sample(self, batch: Any) -> Tensor | None:
        """This weighting's count for every sample of ``batch`` (token kinds only; ``None`` otherwise)."""
        if self.kind not in (Weighting.TOKENS, Weighting.TOKENS_SHIFTED, Weighting.MASK_TOKENS):
            return None
        values = batch[self.key]
        if self.kind is Weighting.TOKENS_SHIFTED:
            values = values[:, 1:]
        return (values != self.ignore_index).flatten(1).sum(1)

    def weights(self, chunks: Sequence[Any]) -> list[float]:
        """The chunks' weights: 1 each for a sum, else their counts normalised to sum to one.

        Raises:
            ValueError: nothing to count in the whole batch.

        Example:
            >>> labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
            >>> tokens = Candidate(Weighting.TOKENS, "tokens", "labels")
            >>> tokens.weights([{"labels": labels[:1]}, {"labels": labels[1:]}])
            [0.6666666666666666, 0.3333333333333333]
        """
        counts = [self.count(c) for c in chunks]
        if self.kind is Weighting.SUM:
            return counts
        total = sum(counts)
        if total <= 0:
            raise ValueError(
                f"The micro-batch weights ({self.description}) sum to {total}: nothing to count in this batch. "
                "Check `weight_fn` / `token_key`, or pass `loss_reduction` explicitly."
            )
        return [c / total for c in counts]


def _entry(batch: Any, key: str | int) -> Tensor | None:
    try:
        value = batch[key]
    except (KeyError, IndexError, TypeError):
        return None
    if isinstance(value, Tensor) and value.dim() >= 2 and not value.is_floating_point():
        return value
    return None


def candidates(batch: Any, token_key: str | int = "labels", ignore_index: int = -100) -> list[Candidate]:
    """The weightings that make sense for ``batch``: samples, a sum, and token counts where it has tokens.

    Token candidates need a per-token integer entry (2 or more dimensions): ``batch[token_key]``
    (labels: tokens ``!= ignore_index``, and the same shifted by one for a causal LM) and
    ``batch["attention_mask"]`` (tokens ``!= 0``).

    Example:
        >>> batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}
        >>> [c.kind.value for c in candidates(batch)]
        ['samples', 'tokens', 'tokens-shifted', 'sum']
    """
    found = [Candidate(Weighting.SAMPLES, "sample shares")]
    if _entry(batch, token_key) is not None:
        where = f"{token_key} != {ignore_index}"
        found.append(Candidate(Weighting.TOKENS, f"tokens ({where})", token_key, ignore_index))
        found.append(
            Candidate(Weighting.TOKENS_SHIFTED, f"tokens ({where}, shifted by one)", token_key, ignore_index)
        )
    if token_key != "attention_mask" and _entry(batch, "attention_mask") is not None:
        found.append(Candidate(Weighting.MASK_TOKENS, "tokens (attention_mask != 0)", "attention_mask", 0))
    found.append(Candidate(Weighting.SUM, "sum (micro-batch losses added)"))
    return found


def hf_head(module: torch.nn.Module) -> HFHead | None:
    """The head of the first Hugging Face ``PreTrainedModel`` inside ``module``, from class names only.

    Does not import ``transformers``: a model class is recognised by a ``PreTrainedModel`` in its MRO,
    its head by HF's naming (``...ForCausalLM``, ``...LMHeadModel``, ``...ForMaskedLM``,
    ``...ForTokenClassification``, ``...ForSequenceClassification``).

    Example:
        >>> hf_head(torch.nn.Linear(2, 2)) is None
        True
    """
    for sub in module.modules():
        names = [c.__name__ for c in type(sub).__mro__]
        if "PreTrainedModel" not in names:
            continue
        name = names[0]
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return HFHead.CAUSAL_LM
        if name.endswith("ForMaskedLM"):
            return HFHead.MASKED_LM
        if name.endswith("ForTokenClassification"):
            return HFHead.TOKEN_CLASSIFICATION
        if name.endswith("ForSequenceClassification"):
            return HFHead.SEQUENCE_CLASSIFICATION
    return None


#: Relative tolerance of the check, by the lowest precision the loss was computed in.
_TOLERANCE = {
    torch.float64: 1e-6,  # models often compute parts of the loss in float32 even under 64-true
    torch.float32: 2e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
}


def tolerance(precision: str | None, loss_dtype: torch.dtype | None = None) -> float:
    """The relative difference within which a candidate reproduces the loss, for a Trainer precision.

    ``"64-true"``: 1e-6; ``"32-true"`` (and anything unrecognised): 2e-5; ``"16-mixed"``/``"16-true"``:
    1e-2; ``"bf16-mixed"``/``"bf16-true"`` and lower (transformer-engine): 4e-2. The loss's own dtype
    can only loosen it.

    Example:
        >>> tolerance("bf16-mixed")
        0.04
        >>> tolerance("64-true", torch.float32)
        2e-05
    """
    text = str(precision or "32")
    if text.startswith("64"):
        dtype = torch.float64
    elif text.startswith("bf16") or "transformer-engine" in text:
        dtype = torch.bfloat16
    elif text.startswith("16"):
        dtype = torch.float16
    else:
        dtype = torch.float32
    tol = _TOLERANCE[dtype]
    if loss_dtype in _TOLERANCE:
        tol = max(tol, _TOLERANCE[loss_dtype])
    return tol


@dataclass(frozen=True)
class CheckResult:
    """What the check measured and decided.

    Attributes:
        chosen: the weighting used from now on; ``None`` when none reproduces the loss.
        errors: each candidate's relative difference from the piece's loss, by description.
        tolerance: the relative difference allowed.
        tied: several candidates matched; ``chosen`` was decided by the HF head or kept at sample shares.
        checked: the check ran (``False``: the piece could not be split; ``chosen`` is the fallback).
    """

    chosen: Candidate | None
    errors: dict[str, float]
    tolerance: float
    tied: bool = False
    checked: bool = True

    @property
    def mismatch(self) -> float:
        """The chosen candidate's difference (or the best one's, when none matched)."""
        if self.chosen is not None and self.chosen.description in self.errors:
            return self.errors[self.chosen.description]
        return min(self.errors.values(), default=math.nan)


def choose(
    piece_loss: float,
    part_losses: Sequence[float],
    parts: Sequence[Any],
    options: Sequence[Candidate],
    tol: float,
    head: HFHead | None = None,
) -> CheckResult:
    """Pick the candidate whose weighted combination of the parts' losses equals the piece's loss.

    Example:
        >>> parts = [{"labels": torch.tensor([[1, -100]])}, {"labels": torch.tensor([[1, 2], [3, 4]])}]
        >>> losses = [1.0, 4.0]  # token means; the piece's 5 tokens: (1 * 1 + 4 * 4) / 5
        >>> choose(17 / 5, losses, parts, candidates(parts[1]), 1e-6).chosen.kind.value
        'tokens'
    """
    scale = max(abs(piece_loss), 1e-30)
    errors: dict[str, float] = {}
    for option in options:
        try:
            weights = option.weights(parts)
        except (ValueError, KeyError, IndexError, TypeError, UnsplittableBatchError):
            continue
        combined = sum(w * loss for w, loss in zip(weights, part_losses))
        errors[option.description] = abs(combined - piece_loss) / scale
    matched = [o for o in options if errors.get(o.description, math.inf) <= tol]
    if len(matched) == 1:
        return CheckResult(matched[0], errors, tol)
    if not matched:
        return CheckResult(None, errors, tol)
    if head is not None:
        for option in matched:
            if option.kind is _HEAD_WEIGHTING[head]:
                return CheckResult(option, errors, tol, tied=True)
    piece = merge_outputs(list(parts)) if len(parts) > 1 else parts[0]
    if all(_same_per_sample(matched[0], o, piece) for o in matched[1:]):
        return CheckResult(matched[0], errors, tol)  # proportional counts on every sample: no real tie
    for option in matched:
        if option.kind is Weighting.SAMPLES:
            return CheckResult(option, errors, tol, tied=True)
    return CheckResult(matched[0], errors, tol, tied=True)


def _same_per_sample(a: Candidate, b: Candidate, piece: Any) -> bool:
    try:
        n = batch_size_of(piece)
        counts_a = [a.count(_slice(piece, n, i, i + 1)) for i in range(n)]
        counts_b = [b.count(_slice(piece, n, i, i + 1)) for i in range(n)]
    except Exception:
        return False
    total_a, total_b = sum(counts_a), sum(counts_b)
    if total_a <= 0 or total_b <= 0:
        return False
    return all(abs(x / total_a - y / total_b) <= 1e-12 for x, y in zip(counts_a, counts_b))


def _piece(batch: Any, size: int, options: Sequence[Candidate]) -> Any:
    """``size`` samples of ``batch`` that span its range of token counts, ordered by that count.

    Without token candidates the first ``size`` samples. Ordering by count lets the split into two parts
    separate short from long samples, so that the candidates' shares of the parts differ.
    """
    n = batch_size_of(batch)
    spread, counts = -1.0, None
    for option in options:
        try:
            found = option.per_sample(batch)
        except (KeyError, IndexError, TypeError):
            found = None
        if found is None or found.numel() != n:
            continue
        found = found.double()
        value = float(found.std() / found.mean().clamp_min(1e-12)) if n > 1 else 0.0
        if value > spread:
            spread, counts = value, found
    if counts is None:
        order = list(range(min(size, n)))
    elif size >= n:
        order = sorted(range(n), key=lambda i: float(counts[i]))
    else:
        ranked = sorted(range(n), key=lambda i: float(counts[i]))
        order = sorted(
            {ranked[round(i * (n - 1) / (size - 1))] for i in range(size)}, key=lambda i: float(counts[i])
        )
    if order == list(range(len(order))):
        return first_samples(batch, len(order))
    return merge_outputs([_slice(batch, n, i, i + 1) for i in order])


def _split_point(piece: Any, m: int, options: Sequence[Candidate]) -> int:
    """Where to cut the piece so that the candidates' shares of the two parts differ the most."""
    best, best_score = max(1, m // 4), -math.inf
    for cut in range(1, m):
        parts = [_slice(piece, m, 0, cut), _slice(piece, m, cut, m)]
        shares = []
        for option in options:
            if option.kind is Weighting.SUM:
                continue
            try:
                counts = [option.count(p) for p in parts]
            except Exception:
                continue
            if min(counts) <= 0:  # a part with nothing to count: its mean loss is undefined
                shares = []
                break
            shares.append(counts[0] / sum(counts))
        if not shares:
            continue
        gaps = [abs(a - b) for i, a in enumerate(shares) for b in shares[i + 1 :]]
        score = min(gaps, default=0.0)
        if score > best_score + 1e-12:
            best, best_score = cut, score
    return best


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

    ``no_trace`` is the engine's :meth:`~lightning_gpuopt.microbatch.MicroBatchEngine.leave_no_trace`
    (``self.log`` captured and dropped, torchmetrics and BatchNorm states restored). The RNG is forked
    (CPU and the module's CUDA devices), and ``torch.compile`` runs eagerly.
    """
    modes = [(m, m.training) for m in module.modules()]
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    try:
        module.eval()
        with no_trace, torch.random.fork_rng(devices=devices), torch.no_grad(), _eager():
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _as_float(loss: Any) -> float:
    if isinstance(loss, Mapping):
        loss = loss.get("loss")
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"training_step must return a scalar loss for the check, got {type(loss).__name__}")
    return float(loss.detach().double())


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
        mode: str = "auto",
        weight_fn: Callable[[Any], Any] | None = None,
        token_key: str | int = "labels",
        ignore_index: int = -100,
        on_mismatch: str = "raise",
        check: bool = True,
        source: str = "OOMRecovery",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`loss_reduction` must be one of {MODES}, got {mode!r}")
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"`on_mismatch` must be one of {ON_MISMATCH}, got {on_mismatch!r}")
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
        self._warned = False

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

    def weights(
        self,
        engine: Any,
        chunks: list[Any],
        run_piece: Callable[[Any], Any] | None = None,
        batch: Any = None,
    ) -> list[float]:
        """The weights of ``chunks`` (the micro-batches of ``batch``), deciding first when still undecided.

        ``run_piece(micro_batch)`` runs the user's training step on a micro-batch and returns its output;
        ``None`` (evaluation) uses the decision made so far, or the fallback (HF head, else samples).
        """
        if len(chunks) == 1:
            return [1.0]
        if not self._checked and self.check and run_piece is not None:
            self._decide(engine, chunks, run_piece, batch)
        return (self.decided or self._fallback(engine)).weights(chunks)

    def _fallback(self, engine: Any) -> Candidate:
        head = hf_head(engine.trainer.lightning_module)
        if head is not None and head is not HFHead.SEQUENCE_CLASSIFICATION:
            kind = _HEAD_WEIGHTING[head]
            where = f"{self.token_key} != {self.ignore_index}"
            text = f"tokens ({where}{', shifted by one' if kind is Weighting.TOKENS_SHIFTED else ''})"
            return Candidate(kind, text, self.token_key, self.ignore_index)
        return Candidate(Weighting.SAMPLES, "sample shares")

    def _decide(self, engine: Any, chunks: list[Any], run_piece: Callable[[Any], Any], batch: Any) -> None:
        trainer = engine.trainer
        module = trainer.lightning_module
        head = hf_head(module)
        source = batch if batch is not None else chunks[0]
        options = candidates(source, self.token_key, self.ignore_index)
        if self.decided is not None and self.decided not in options:
            options = [self.decided, *options]
        try:  # a piece the size of one micro-batch (at least two samples) spanning the batch's lengths
            size = max(2, batch_size_of(chunks[0]))
            piece = _piece(source, min(size, batch_size_of(source)), options)
            m = batch_size_of(piece)
        except (UnsplittableBatchError, ValueError, TypeError, KeyError, IndexError):
            m = 0
        if m >= 2:
            cut = _split_point(piece, m, options)
            parts = [_slice(piece, m, 0, cut), _slice(piece, m, cut, m)]
            tol = tolerance(getattr(trainer, "precision", None))
            out_of_memory = False
            try:
                with quiet_forward(module, engine.leave_no_trace()):
                    piece_loss = _as_float(run_piece(piece))
                    part_losses = [_as_float(run_piece(p)) for p in parts]
            except Exception as err:
                if not is_oom_error(err) or type(engine.exchange).__name__ == "FSDP2Exchange":
                    raise  # FSDP2: an OOM here is the attempt's, voted on like any other (the check runs again)
                # Out of memory in the check: every rank still reaches the broadcast below; the batch runs with
                # the fallback and the check runs again at the next split.
                out_of_memory = True
            if out_of_memory:
                result = CheckResult(None, {}, tol, checked=False)
            elif math.isfinite(piece_loss) and all(math.isfinite(v) for v in part_losses):
                result = choose(piece_loss, part_losses, parts, options, tol, head)
            else:
                result = CheckResult(self.decided or self._fallback(engine), {}, tol, checked=False)
        else:
            result = CheckResult(self.decided or self._fallback(engine), {}, 0.0, checked=False)
        pool = [*options, *(c for c in (self.decided, self._fallback(engine)) if c is not None)]
        result = _agree(result, pool)
        if not result.checked and result.chosen is None:
            return  # out of memory in the check (on rank 0): decide at the next split
        self.result = result
        self._checked = True
        self._act(engine, result)

    def _act(self, engine: Any, result: CheckResult) -> None:
        given = self.decided
        if given is not None:  # explicit: used as given, flagged when it does not reproduce the loss
            error = result.errors.get(given.description)
            if result.checked and (error is None or error > result.tolerance):
                self._mismatch(engine, result, given)
            self._announce(engine, given, result, explicit=True)
            return
        if result.chosen is None:
            self._mismatch(engine, result, None)
            self.decided = Candidate(Weighting.SAMPLES, "sample shares")  # only reached with "warn"
            return
        self.decided = result.chosen
        if result.tied and hf_head(engine.trainer.lightning_module) is None:
            tied = [d for d, e in result.errors.items() if e <= result.tolerance]
            warn(
                f"loss weighting: {', '.join(tied)} all reproduce your loss on the checked piece of the batch (its "
                f"parts' losses are too close to tell them apart); keeping {result.chosen.description}. Pass "
                "`loss_reduction=` or `weight_fn=` to OOMRecovery to choose."
            )
        self._announce(engine, result.chosen, result)

    def _announce(self, engine: Any, chosen: Candidate, result: CheckResult, explicit: bool = False) -> None:
        from lightning.pytorch.utilities import rank_zero_info

        from lightning_gpuopt.decisions import record_decision

        if not result.checked:
            how = "not checked (the piece of the batch could not be split in two)"
        else:
            how = f"matches your loss to {result.errors.get(chosen.description, math.nan):.1g}"
        head = hf_head(engine.trainer.lightning_module)
        if result.tied and head is not None and not explicit:
            how += f" (a tie, decided by the Hugging Face {head.value} head)"
        message = f"loss weighting: {chosen.description}{' (given)' if explicit else ''} — {how}"
        record_decision(
            engine.trainer,
            "loss weighting",
            self.source,
            message,
            weighting=chosen.kind.value,
            description=chosen.description,
            mismatch=result.errors.get(chosen.description),
            tolerance=result.tolerance,
            checked=result.checked,
        )
        if self.verbose:
            rank_zero_info(message)

    def _mismatch(self, engine: Any, result: CheckResult, given: Candidate | None) -> None:
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
            f"loss weighting: {what} on a piece of the batch and its two parts (relative differences: {measured}; "
            f"allowed {result.tolerance:.1g}).{better} Expected a loss that is a mean or sum over samples or tokens; a loss "
            "that couples the samples of a batch (in-batch negatives, contrastive losses, batch statistics) changes "
            "meaning when the batch is split. Declare it with `OOMRecovery(unsplittable=True)`, or pass a `weight_fn` "
            "that counts what your loss averages over"
            + (" (check the one given)" if given is not None and given.kind is Weighting.CUSTOM else "")
            + ", or `on_mismatch='warn'` to split anyway."
        )
        if self.on_mismatch == "warn":
            if not self._warned:
                self._warned = True
                warn(message)
            return
        from lightning_gpuopt.callbacks.oom_recovery import MicroBatchOOMError

        err = MicroBatchOOMError(message)
        err.gpuopt_final = True  # the engine must not treat it as an OOM to retry
        raise err

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Plain state: the decision, so a resumed run does not check again."""
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


def is_final(err: BaseException) -> bool:
    """Whether ``err`` is a refusal the engine must raise as it is, not retry as an OOM."""
    return bool(getattr(err, "gpuopt_final", False))


def _agree(result: CheckResult, pool: Sequence[Candidate]) -> CheckResult:
    """Every rank takes rank 0's result (DDP: rank 0 decides; FSDP2: every rank ran the check together).

    Plain values travel (a user's ``weight_fn`` need not pickle); each rank finds the chosen candidate
    among its own by description.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return result
    if torch.distributed.get_world_size() < 2:
        return result
    chosen = result.chosen.description if result.chosen is not None else None
    box = [(chosen, dict(result.errors), result.tolerance, result.tied, result.checked)]
    from lightning_gpuopt.microbatch.exchange import register_exit_grace

    register_exit_grace()  # torch's broadcast drops its tensors at once: freed by gloo's worker thread
    torch.distributed.broadcast_object_list(box, src=0)
    chosen, errors, tol, tied, checked = box[0]
    match = next((c for c in pool if c.description == chosen), None) if chosen is not None else None
    return CheckResult(match, errors, tol, tied, checked)
