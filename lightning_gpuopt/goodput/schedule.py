"""How far to grow the optimizer batch for a measured noise scale, and how to scale the learning rate with it.

McCandlish et al. (2018): training to a loss takes ``S = S_min (1 + B_noise / B)`` steps and
``E = E_min (1 + B / B_noise)`` samples at batch ``B``. A batch of ``f * B_noise`` costs ``(1 + f)`` times the
fewest samples; the default target, a quarter of the measured ``B_simple`` (which is itself an upper estimate of
``B_noise``), keeps that within about 25 % while the steps shrink as ``B`` grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["held_because", "lr_factor", "next_accumulation"]


def next_accumulation(
    accumulate: int,
    samples_per_batch: int,
    noise_scale: float,
    *,
    target_fraction: float,
    factor: int,
    min_accumulate: int,
    max_accumulate: int,
) -> int:
    """The accumulation for the next windows: one ``factor`` step towards ``target_fraction * noise_scale``.

    ``samples_per_batch`` is one batch on every rank (batch_size x world size): the optimizer batch is
    ``accumulate * samples_per_batch``. It grows by ``factor`` while the grown batch stays within the target, and
    shrinks by ``factor`` (never below ``min_accumulate``) when the batch is more than ``factor`` times the
    target; otherwise it stays.

    Example:
        >>> next_accumulation(1, 64, 1000.0, target_fraction=0.25, factor=2, min_accumulate=1, max_accumulate=8)
        2
        >>> next_accumulation(2, 64, 1000.0, target_fraction=0.25, factor=2, min_accumulate=1, max_accumulate=8)
        2
    """
    target = target_fraction * noise_scale
    if accumulate < min_accumulate:  # clamped to [min_batch, max_batch]: up to the floor first
        return min(accumulate * factor, max_accumulate)
    if accumulate * factor * samples_per_batch <= target and accumulate * factor <= max_accumulate:
        return accumulate * factor
    if accumulate * samples_per_batch > factor * target and accumulate // factor >= min_accumulate:
        if accumulate % factor == 0:
            return accumulate // factor
    return accumulate


def held_because(
    accumulate: int,
    samples_per_batch: int,
    noise_scale: float,
    *,
    target_fraction: float,
    factor: int,
    max_accumulate: int,
    label: str = "noise scale",
) -> str:
    """Why :func:`next_accumulation` does not grow the batch, in words (its other arguments alike; ``label`` names
    ``noise_scale``).

    Example:
        >>> held_because(1, 64, 300.0, target_fraction=0.25, factor=2, max_accumulate=8)
        'a batch of 128 would pass the target 75 (target_fraction 0.25 x noise scale 300)'
    """
    batch, grown = accumulate * samples_per_batch, accumulate * factor * samples_per_batch
    if accumulate * factor > max_accumulate:
        return f"a batch of {grown:,} would pass the largest allowed, {max_accumulate * samples_per_batch:,} (max_batch)"
    target = target_fraction * noise_scale
    if grown > target:
        return (
            f"a batch of {grown:,} would pass the target {target:,.0f} (target_fraction {target_fraction:g} x "
            f"{label} {noise_scale:,.0f})"
        )
    return f"the batch {batch:,} is where the target {target:,.0f} puts it"


def lr_factor(ratio: float, rule: str | Callable[[float], float]) -> float:
    """The learning rate's factor for an optimizer batch ``ratio`` times larger.

    Example:
        >>> lr_factor(4.0, "sqrt"), lr_factor(4.0, "linear"), lr_factor(4.0, "none")
        (2.0, 4.0, 1.0)
    """
    if callable(rule):
        return float(rule(ratio))
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "linear":
        return ratio
    return 1.0
