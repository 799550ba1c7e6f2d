"""The rules of the loss-weighting check, as plain functions: the candidate weightings of a batch, which one
reproduces a loss, the tolerance, and the Hugging Face head that breaks a tie.

:class:`~lightning_gpuopt.microbatch.loss_weighting.LossWeighting` runs the check and keeps its decision.
Nothing here imports ``transformers``: a head is recognised by the class names of the module's MRO.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_gpuopt.batch_split import (
    UnsplittableBatchError,
    batch_size_of,
    first_samples,
    slice_samples,
    take_samples,
)

__all__ = [
    "HEAD_WEIGHTING",
    "Candidate",
    "CheckResult",
    "HFHead",
    "Weighting",
    "candidates",
    "check_pair",
    "choose",
    "hf_head",
    "piece_of",
    "selected_tokens_match",
    "tolerance",
]


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
HEAD_WEIGHTING = {
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
    # Indexing a tensor with a string makes torch warn before it fails: a tensor has no named entries.
    if isinstance(key, str) and isinstance(batch, Tensor):
        return None
    try:
        value = batch[key]
    except (KeyError, IndexError, TypeError):
        return None
    if isinstance(value, Tensor) and value.dim() >= 2 and not value.is_floating_point():
        return value
    return None


def _integer_entries(batch: Any) -> list[tuple[int, Tensor]]:
    """A tuple or list batch's per-token integer tensors (2 or more dimensions), by position (a dict's entries
    are found by name)."""
    if not isinstance(batch, (tuple, list)):
        return []
    return [
        (i, v)
        for i, v in enumerate(batch)
        if isinstance(v, Tensor) and v.dim() >= 2 and not v.is_floating_point()
    ]


def _name(key: str | int) -> str:
    return key if isinstance(key, str) else f"batch[{key}]"


def has_tokens(batch: Any, token_key: str | int = "labels", ignore_index: int = -100) -> bool:
    """Whether :func:`candidates` finds a token count in ``batch`` (labels or a mask over tokens)."""
    try:
        found = candidates(batch, token_key, ignore_index)
    except (TypeError, ValueError, KeyError, IndexError):
        return False
    return any(c.kind not in (Weighting.SAMPLES, Weighting.SUM) for c in found)


def candidates(batch: Any, token_key: str | int = "labels", ignore_index: int = -100) -> list[Candidate]:
    """The weightings that make sense for ``batch``: samples, a sum, and token counts where it has tokens.

    Token candidates need a per-token integer entry (2 or more dimensions). Labels: ``batch[token_key]`` (tokens
    ``!= ignore_index``, and the same shifted by one for a causal LM); without it, in a tuple or list batch, any
    entry that holds ``ignore_index`` somewhere (the padding of hand-written labels). A mask: the
    ``attention_mask`` entry (tokens ``!= 0``); without it, in a tuple or list batch, any 0/1 entry shaped like
    another integer entry (the ids it masks). A segmentation map (no ``ignore_index``, not 0/1) or per-sample
    labels are neither.

    Example:
        >>> batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}
        >>> [c.kind.value for c in candidates(batch)]
        ['samples', 'tokens', 'tokens-shifted', 'sum']
        >>> ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
        >>> [c.description for c in candidates((ids, ids.masked_fill(ids == 0, -100)))][1:3]
        ['tokens (batch[1] != -100)', 'tokens (batch[1] != -100, shifted by one)']
    """
    entries = _integer_entries(batch)
    if _entry(batch, token_key) is not None:
        labels = [token_key]
    else:
        labels = [k for k, v in entries if bool((v == ignore_index).any())]
    found = [Candidate(Weighting.SAMPLES, "sample shares")]
    for key in labels:
        where = f"{_name(key)} != {ignore_index}"
        found.append(Candidate(Weighting.TOKENS, f"tokens ({where})", key, ignore_index))
        found.append(
            Candidate(Weighting.TOKENS_SHIFTED, f"tokens ({where}, shifted by one)", key, ignore_index)
        )
    if token_key != "attention_mask" and _entry(batch, "attention_mask") is not None:
        masks: list[str | int] = ["attention_mask"]
    else:
        masks = [
            k
            for k, v in entries
            if k not in labels
            and bool(((v == 0) | (v == 1)).all())
            and any(o.shape == v.shape for j, o in entries if j != k)
        ]
    for key in masks:
        found.append(Candidate(Weighting.MASK_TOKENS, f"tokens ({_name(key)} != 0)", key, 0))
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
        replayed: the step drew random numbers, and the parts ran with the piece's (``replay.py``).
        refusal: why no weighting can be found from the user's loss, one line for the user (random numbers
            the check cannot replay, tokens selected at random inside the step); ``None`` when it compared.
        reason: the same, short, for the decision of a weighting given explicitly (used unchecked).
        out_of_memory: the check ran out of memory (the error's first line); nothing was decided.
        alike: the candidates that reproduce the loss and count every checked sample in proportion, so that
            they weight such micro-batches alike: which one is the loss's own waits for samples that tell them
            apart (``chosen`` is the first, exact meanwhile).
    """

    chosen: Candidate | None
    errors: dict[str, float]
    tolerance: float
    tied: bool = False
    checked: bool = True
    replayed: bool = False
    refusal: str | None = None
    reason: str | None = None
    out_of_memory: str | None = None
    alike: tuple[str, ...] = ()

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
            if option.kind is HEAD_WEIGHTING[head]:
                return CheckResult(option, errors, tol, tied=True)
    if all(_same_per_sample(matched[0], o, parts) for o in matched[1:]):
        # Proportional counts on every checked sample (equal lengths): these samples cannot tell them apart.
        return CheckResult(matched[0], errors, tol, alike=tuple(o.description for o in matched))
    for option in matched:
        if option.kind is Weighting.SAMPLES:
            return CheckResult(option, errors, tol, tied=True)
    return CheckResult(matched[0], errors, tol, tied=True)


def selected_tokens_match(
    piece_loss: float, part_losses: Sequence[float], selected: Sequence[float | None], tol: float
) -> bool:
    """Whether the parts' losses, weighted by the targets each part's mean ``nll_loss`` counted inside the step,
    reproduce the piece's loss: a mean over tokens the step selected itself (random masking), which no count
    taken from the batch can give.

    Example:
        >>> selected_tokens_match(17 / 5, [1.0, 4.0], [1, 4], 1e-6)
        True
        >>> selected_tokens_match(17 / 5, [1.0, 4.0], [None, 4], 1e-6)
        False
    """
    if any(s is None or s <= 0 for s in selected):
        return False
    total = sum(selected)
    combined = sum(s / total * loss for s, loss in zip(selected, part_losses))
    return abs(combined - piece_loss) <= tol * max(abs(piece_loss), 1e-30)


def _same_per_sample(a: Candidate, b: Candidate, parts: Sequence[Any]) -> bool:
    try:
        sizes = [batch_size_of(part) for part in parts]
        samples = [slice_samples(part, n, i, i + 1) for part, n in zip(parts, sizes) for i in range(n)]
        counts_a = [a.count(sample) for sample in samples]
        counts_b = [b.count(sample) for sample in samples]
    except Exception:
        return False
    total_a, total_b = sum(counts_a), sum(counts_b)
    if total_a <= 0 or total_b <= 0:
        return False
    return all(abs(x / total_a - y / total_b) <= 1e-12 for x, y in zip(counts_a, counts_b))


def check_pair(batch: Any, options: Sequence[Candidate]) -> tuple[int, int]:
    """The two samples of ``batch`` the check runs on, the one counted least first.

    Two samples are the smallest piece whose parts (one sample each) can tell the candidates apart: the
    shortest and the longest, by the token candidate whose counts vary most across the batch, among the
    samples in which every candidate counts something (a part with nothing to count has no mean). Where
    that pair counts two candidates in proportion although they differ on the batch, the pair that
    separates them best is taken instead. A batch without token candidates gives its first two samples.

    Example:
        >>> labels = torch.tensor([[1, 1, 1, 1], [1, 1, -100, -100], [1, 1, 1, -100]])
        >>> check_pair({"labels": labels}, candidates({"labels": labels}))  # 2 and 4 tokens
        (1, 0)
    """
    n = batch_size_of(batch)
    rows: list[Tensor] = []
    for option in options:
        try:
            found = option.per_sample(batch)
        except (KeyError, IndexError, TypeError):
            found = None
        if found is not None and found.numel() == n:
            rows.append(found.detach().to("cpu", torch.float64).flatten())
    valid = [i for i in range(n) if all(float(r[i]) > 0 for r in rows)]
    if not rows or len(valid) < 2:
        return (0, 1)
    spread = [float(r[valid].std() / r[valid].mean()) for r in rows]
    counts = rows[max(range(len(rows)), key=lambda i: spread[i])]
    ranked = sorted(valid, key=lambda i: float(counts[i]))
    short, long = ranked[0], ranked[-1]
    if float(counts[short]) == float(counts[long]):
        return (valid[0], valid[1])
    kinds = [torch.ones(n, dtype=torch.float64), *rows]  # sample shares count 1 per sample
    pairs = [(a, b) for i, a in enumerate(kinds) for b in kinds[i + 1 :] if _differ(a[valid], b[valid])]

    def gap(i: int, j: int) -> float:
        shares = [(float(a[i] / (a[i] + a[j])), float(b[i] / (b[i] + b[j]))) for a, b in pairs]
        return min((abs(x - y) for x, y in shares), default=math.inf)

    if gap(short, long) > 1e-12:
        return (short, long)
    ends = sorted(
        {i for r in kinds[1:] for i in (min(valid, key=lambda v: r[v]), max(valid, key=lambda v: r[v]))}
    )
    pool = valid if len(valid) <= 64 else ends
    best = max(((i, j) for x, i in enumerate(pool) for j in pool[x + 1 :]), key=lambda p: gap(*p))
    return tuple(sorted(best, key=lambda i: float(counts[i])))  # type: ignore[return-value]


def _differ(a: Tensor, b: Tensor) -> bool:
    """Whether two per-sample counts are out of proportion somewhere (they weight micro-batches differently)."""
    return bool(((a / a.sum() - b / b.sum()).abs() > 1e-12).any())


def piece_of(batch: Any, options: Sequence[Candidate]) -> Any:
    """The check's piece of ``batch``: the two samples of :func:`check_pair`, the one counted least first."""
    first, second = check_pair(batch, options)
    if (first, second) == (0, 1):
        return first_samples(batch, 2)
    return take_samples(batch, batch_size_of(batch), [first, second])
