"""Each batch's share of the optimizer step's loss, where the loss is a mean over tokens.

The engine weights a batch's micro-batches by their tokens, so a batch's loss is the mean over its own
tokens. An optimizer step also spans the ranks (DDP and FSDP2 average their gradients) and Lightning's
accumulated batches (each loss divided by ``accumulate_grad_batches``): averaging those means is the mean
over all the step's tokens only when every batch holds as many. With batches by tokens they do not. One
process on the union of the step's batches computes ``sum(tokens_rb * mean_rb) / T``, T all the step's
tokens; :class:`StepShares` gets there:

- before each batch's backward, one all-reduce of its token count gives the ranks' total ``T_b``; rank r's
  loss is multiplied by ``W * T_rb / T_b0``, where ``T_b0`` is the window's first batch's total (W ranks);
- at the optimizer step (after the ranks' reduction), the gradients are multiplied by ``A * T_b0 / T`` (A
  batches accumulated), which is 1, and skipped, without accumulation.

With equal counts every factor is exactly 1. Sample means and sums keep Lightning's own averaging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_gpuopt.microbatch.exchange import first_rank_where
from lightning_gpuopt.microbatch.loss_weighting_rules import Candidate, has_tokens

__all__ = ["StepShares"]


class _Totals(Protocol):
    world_size: int

    def total(self, value: float) -> float: ...


class StepShares:
    """The window's token totals, kept across its batches (one per engine)."""

    def __init__(self) -> None:
        #: The window's first batch's tokens on all ranks (``None``: no batch counted in this window yet).
        self.reference: float | None = None
        #: The kept batches' tokens on all ranks, in this window.
        self.kept = 0.0
        self._pending = 0.0
        self._wanted: bool | None = None
        #: The last finished step's tokens on all ranks (``None``: no step shared by tokens finished yet).
        self.last_total: float | None = None
        #: This rank's tokens in the batch counted last.
        self.mine = 0.0

    def wants_decision(self, trainer: Any, batch: Any, several: bool, weighting: Any) -> bool:
        """Whether the loss weighting must be decided on this batch although it runs whole: a first batch holds
        tokens (on any rank), and the step spans several ranks or accumulated batches, or the data is batched by
        tokens (whose evaluation losses are then averaged by tokens). Asked at the first batch only, on every rank."""
        if self._wanted is None:
            by_tokens = getattr(getattr(trainer, "datamodule", None), "max_tokens", None) is not None
            mine = (several or by_tokens) and has_tokens(batch, weighting.token_key, weighting.ignore_index)
            self._wanted = first_rank_where(mine) is not None
        return self._wanted

    @property
    def wanted(self) -> bool:
        """The first training batch asked for the weighting's decision (so a token-mean loss is shared by tokens
        across the run's steps, and its evaluation losses averaged by tokens from the first decision on)."""
        return bool(self._wanted)

    def factor(self, counting: Candidate, batch: Any, exchange: _Totals, first_in_window: bool) -> float:
        """The factor of this rank's loss for ``batch`` (one all-reduce under several ranks; every rank calls it)."""
        mine = self.mine = counting.count(batch)
        total = exchange.total(mine)
        if first_in_window or self.reference is None:
            self.reference, self.kept = total, 0.0
        self._pending = total
        if self.reference <= 0:
            raise ValueError(
                f"The optimizer step's first batch holds no tokens on any rank ({counting.description}): the loss "
                "is a mean over nothing. Check the labels' padding value, or pass `loss_reduction` to OOMRecovery."
            )
        return exchange.world_size * mine / self.reference

    def keep(self) -> None:
        """The batch counted last stands (its gradients join the window's)."""
        self.kept += self._pending
        self._pending = 0.0

    def finish(self, params: Sequence[torch.nn.Parameter], accumulate: int) -> None:
        """At the optimizer step, after the ranks' reduction: from the shares of the first batch's total to those
        of the whole step's."""
        if self.reference is None:
            return
        ratio = accumulate * self.reference / self.kept if self.kept > 0 else 1.0
        self.last_total = self.kept or None
        self.reference, self.kept = None, 0.0
        if ratio == 1.0:
            return
        grads: list[Tensor] = [p.grad for p in params if p.grad is not None]
        for grad in grads:
            grad.mul_(ratio)
