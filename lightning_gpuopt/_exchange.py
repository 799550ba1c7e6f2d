"""What the micro-batch engine exchanges between ranks: one vote per batch, gradients at the optimizer step (private).

Under DDP the engine runs every micro-batch under ``no_sync`` (DDP's own bucket all-reduce, launched
from inside the backward, cannot survive an OOM that stops one rank mid-backward: the other ranks'
collectives then mismatch and gloo/NCCL abort). Instead, once per batch, after every rank has
finished its attempt (successfully or with an OOM):

1. :meth:`DDPExchange.vote`: one small ``int64`` all-reduce carries each rank's status (ok, OOM,
   fatal, ...) and the k it proposes, in a slot of its own, plus which parameters have a gradient.
   Every rank reads the same votes, so every rank takes the same decision (retry the batch with the
   largest proposed k, stop together, or go on).
2. At the optimizer-step boundary only, when every rank succeeded, :meth:`DDPExchange.reduce` averages
   the gradients and gives every rank rank 0's module buffers (BatchNorm statistics, as DDP's
   ``broadcast_buffers`` does), in buckets of ``bucket_bytes`` through one reusable staging buffer
   per dtype: a few all-reduces per step, no allocation during the exchange.

:class:`LocalExchange` is the same interface for a single device: no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpuopt.oom_policy import Vote

__all__ = ["DDPExchange", "LocalExchange"]


class LocalExchange:
    """A single device: the vote is this process's own, and there is nothing to reduce."""

    world_size = 1
    rank = 0

    def prepare(self) -> None:
        """Nothing to allocate."""

    def vote(self, status: int, k: int) -> list[Vote]:
        return [Vote(status, k)]

    def reduce(self) -> None:
        """Nothing to reduce."""


class DDPExchange:
    """Votes and gradient averaging for a ``DistributedDataParallel`` module whose backward never syncs.

    Args:
        ddp: the DDP-wrapped module (``trainer.strategy.model``).
        bucket_bytes: the most bytes one all-reduce carries (DDP's ``bucket_cap_mb``).
    """

    def __init__(self, ddp: torch.nn.Module, bucket_bytes: int = 25 * 2**20) -> None:
        self.module = ddp.module
        self.group = getattr(ddp, "process_group", None)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.buffers = list(self.module.buffers()) if getattr(ddp, "broadcast_buffers", True) else []
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._votes: Tensor | None = None
        self._used: list[bool] = [True] * len(self.params)
        self._staging: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def prepare(self) -> None:
        """Allocate the vote tensor and the staging buffers once (an OOM here is the attempt's own)."""
        if self._votes is None:
            self._votes = torch.zeros(2 * self.world_size + len(self.params), dtype=torch.int64, device=self.device)
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for t in [*self.params, *self.buffers]:
            key = (t.dtype, t.device)
            sizes[key] = sizes.get(key, 0) + t.numel()
        for (dtype, device), numel in sizes.items():
            if (dtype, device) not in self._staging:
                cap = max(1, self.bucket_bytes // torch.empty((), dtype=dtype).element_size())
                self._staging[(dtype, device)] = torch.empty(min(numel, cap), dtype=dtype, device=device)

    def vote(self, status: int, k: int) -> list[Vote]:
        """Every rank's (status, k), in rank order; also learns which parameters have a gradient on any rank."""
        self.prepare()
        votes = self._votes
        votes.zero_()
        votes[2 * self.rank] = status
        votes[2 * self.rank + 1] = k
        n = self.world_size
        if self.params:
            votes[2 * n :] = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int64)
        dist.all_reduce(votes, group=self.group)
        values = votes.tolist()
        self._used = [v > 0 for v in values[2 * n :]]
        return [Vote(int(values[2 * r]), int(values[2 * r + 1])) for r in range(n)]

    def reduce(self) -> None:
        """Average the gradients over the ranks and give every rank rank 0's buffers (after a successful vote).

        A parameter without a gradient here but with one on another rank (at the last vote)
        contributes zeros and gets the average; one without a gradient anywhere keeps ``None``, as DDP
        leaves globally unused parameters.
        """
        self.prepare()
        groups: dict[tuple[torch.dtype, torch.device], list[tuple[Tensor, bool]]] = {}
        for p, is_used in zip(self.params, self._used):
            if not is_used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            groups.setdefault((p.grad.dtype, p.grad.device), []).append((p.grad, True))
        for b in self.buffers:
            groups.setdefault((b.dtype, b.device), []).append((b, False))
        for key, entries in groups.items():
            self._reduce_group(self._staging[key], entries)

    def _reduce_group(self, staging: Tensor, entries: list[tuple[Tensor, bool]]) -> None:
        size, cursor = staging.numel(), 0
        pending: list[tuple[Tensor, int, int, int]] = []  # (target, offset in it, staging offset, count)

        def flush() -> None:
            nonlocal cursor
            dist.all_reduce(staging[:cursor], group=self.group)
            for target, offset, start, count in pending:
                target.view(-1)[offset : offset + count].copy_(staging[start : start + count])
            pending.clear()
            cursor = 0

        for tensor, is_grad in entries:
            flat, offset, total = tensor.view(-1), 0, tensor.numel()
            while offset < total:
                count = min(total - offset, size - cursor)
                part = staging[cursor : cursor + count]
                if is_grad:  # averaged: divided before the sum, as DDP's own all-reduce does
                    part.copy_(flat[offset : offset + count]).div_(self.world_size)
                elif self.rank == 0:  # buffers: rank 0's value plus zeros from every other rank
                    part.copy_(flat[offset : offset + count])
                else:
                    part.zero_()
                pending.append((tensor, offset, cursor, count))
                cursor += count
                offset += count
                if cursor == size:
                    flush()
        if cursor:
            flush()
