"""The memory a training step on padded sequences adds, as a function of its batch size ``b`` and length ``L``.

A step on ``b`` sequences padded to ``L`` keeps activations per token (embeddings, projections, the MLP: ``b·L``)
and, where attention materialises its scores, per token per position (``b·L²``); a part does not grow with the
batch at all (weight-gradient temporaries, workspaces)::

    forward_backward(b, L) = intercept + per_token · b·L + per_token_length · b·L²

:func:`fit_token_peaks` fits it to a few measured shapes (least squares; neither token term below zero: memory
does not shrink with more tokens. The intercept may be: measured above what a step holds after it, gradients
included, a small step's peak can be less than those gradients), and :meth:`TokenPeakModel.max_tokens` turns a memory budget into the largest
``max_tokens`` whose costliest batch fits: under a token budget ``T`` a batch at length ``L`` holds at most
``T // L`` samples, so its cost is ``intercept + per_token·T + per_token_length·T·L``, largest at the longest
length the data has (an attention term makes long batches the costly ones; without one, all cost alike).

Pure Python: no torch, no Lightning, no device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ShapeMeasurement", "TokenPeakModel", "even_batches", "fit_token_peaks"]


@dataclass(frozen=True)
class ShapeMeasurement:
    """What one measured step on ``size`` sequences of ``length`` tokens added at its peak, in bytes, above what
    was held when it began."""

    size: int
    length: int
    added_bytes: int


@dataclass(frozen=True)
class TokenPeakModel:
    """``intercept + per_token·b·L + per_token_length·b·L²``: what a step on ``b`` sequences of ``L`` tokens adds.

    Example:
        >>> model = TokenPeakModel(intercept_bytes=1000, per_token_bytes=10, per_token_length_bytes=0.5)
        >>> model.added(4, 100)  # 1000 + 10·400 + 0.5·40000
        25000
        >>> model.max_tokens(even_batches([50, 100, 200]), 200, budget_bytes=25000)  # at 400: 2 x 200 adds 45,000
        399
        >>> model.costliest(even_batches([50, 100, 200])(399))
        (1, 200)
    """

    intercept_bytes: float
    per_token_bytes: float
    per_token_length_bytes: float = 0.0

    def added(self, size: int, length: int) -> int:
        """The predicted bytes a step on ``size`` sequences of ``length`` tokens adds (rounded up)."""
        tokens = size * length
        return math.ceil(
            self.intercept_bytes
            + self.per_token_bytes * tokens
            + self.per_token_length_bytes * tokens * length
        )

    def costliest(self, shapes: Iterable[tuple[int, int]]) -> tuple[int, int]:
        """The costliest of ``shapes`` (``(size, length)`` pairs)."""
        return max(shapes, key=lambda shape: (self.added(*shape), shape))

    def max_tokens(
        self, shapes_at: Callable[[int], Iterable[tuple[int, int]]], longest: int, budget_bytes: float
    ) -> int | None:
        """The largest ``max_tokens`` whose every batch adds at most ``budget_bytes``; ``None`` when even the longest
        sample alone does not fit.

        Args:
            shapes_at: the ``(size, length)`` of every batch a budget forms (:func:`even_batches`, or the
                sampler's own batches).
            longest: the longest sample's length (the smallest budget worth asking about).
            budget_bytes: what a step may add.
        """
        if self.added(1, longest) > budget_bytes:
            return None

        def fits(tokens: int) -> bool:
            return self.added(*self.costliest(shapes_at(tokens))) <= budget_bytes

        lo, hi = longest, longest
        while fits(hi) and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while lo < hi:  # invariant: lo fits
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


def even_batches(lengths: Sequence[int]) -> Callable[[int], set[tuple[int, int]]]:
    """The batches a budget ``T`` allows at each length, as many samples as fit: ``(T // L, L)``.

    Example:
        >>> sorted(even_batches([50, 100, 100])(300))
        [(3, 100), (6, 50)]
    """
    distinct = set(lengths)
    return lambda tokens: {(max(1, tokens // n), n) for n in distinct if n <= tokens}


def _solve(rows: list[list[float]], values: list[float]) -> list[float] | None:
    """Least squares by the normal equations (Gaussian elimination, partial pivoting); ``None`` if singular."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * v for r, v in zip(rows, values)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(x) for row in a for x in row)):
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            a[r] = [x - f * y for x, y in zip(a[r], a[col])]
            b[r] -= f * b[col]
    out = [0.0] * k
    for r in reversed(range(k)):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, k))) / a[r][r]
    return out


def fit_token_peaks(measurements: Sequence[ShapeMeasurement]) -> TokenPeakModel:
    """The model that fits the measured shapes best with neither token term below zero.

    Every subset of the three terms is fitted by least squares, relative to each measurement (a large shape's
    bytes do not drown a small one's); of the fits whose token terms are not negative, the closest wins.

    Raises:
        ValueError: fewer than two measurements.

    Example:
        >>> shapes = [ShapeMeasurement(b, n, 1000 + 10 * b * n + b * n * n) for b, n in [(2, 10), (8, 10), (2, 40)]]
        >>> fit = fit_token_peaks(shapes)
        >>> round(fit.intercept_bytes), round(fit.per_token_bytes), round(fit.per_token_length_bytes, 6)
        (1000, 10, 1.0)
    """
    if len(measurements) < 2:
        raise ValueError(
            f"fitting a step's memory in (batch, length) needs 2 measured shapes or more, got {len(measurements)}"
        )
    columns = [
        lambda m: 1.0,
        lambda m: float(m.size * m.length),
        lambda m: float(m.size * m.length * m.length),
    ]
    best: tuple[float, list[float]] | None = None
    for chosen in (c for r in (3, 2, 1) for c in itertools.combinations(range(3), r)):
        weights = [1.0 / max(m.added_bytes, 1) for m in measurements]
        rows = [[columns[c](m) * w for c in chosen] for m, w in zip(measurements, weights)]
        solved = _solve(rows, [m.added_bytes * w for m, w in zip(measurements, weights)])
        if solved is None or any(value < 0 for c, value in zip(chosen, solved) if c > 0):
            continue
        coefficients = [0.0, 0.0, 0.0]
        for c, value in zip(chosen, solved):
            coefficients[c] = value
        error = sum(
            ((sum(col(m) * x for col, x in zip(columns, coefficients)) - m.added_bytes) * w) ** 2
            for m, w in zip(measurements, weights)
        )
        if best is None or error < best[0] * (1 - 1e-9):
            best = (error, coefficients)
    assert best is not None  # the intercept alone always solves
    return TokenPeakModel(*best[1])
