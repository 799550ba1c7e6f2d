"""What the micro-batch engine exchanges between ranks: one vote per batch, gradients at the optimizer step.

Under DDP every micro-batch runs under ``no_sync`` (DDP's bucket all-reduce inside the backward cannot
survive an OOM that stops one rank mid-backward). Once per batch, after every rank finished its attempt,
:meth:`DDPExchange.vote` (one small ``int64`` all-reduce of each rank's status and proposed k) gives every
rank the same decision; at the optimizer-step boundary :meth:`DDPExchange.reduce` averages the gradients
and broadcasts rank 0's buffers, in buckets through one reusable staging buffer per dtype.
:class:`LocalExchange` is the same interface for a single device.

Under FSDP2 the collectives stay inside the step, so :class:`FSDP2Exchange` votes before *each* of FSDP's
collectives (under HSDP in one global group, and once more before the replicas' all-reduce): a rank out of
memory casts its vote, the others meet it at their next collective and stop (:class:`PeerFailure`), and
the ranks' sequences of collectives stay identical. The long form: docs/oom-recovery.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor

from lightning_gpuopt import _compat
from lightning_gpuopt.microbatch.errors import Refused
from lightning_gpuopt.votes import PeerFailure, Vote

__all__ = [
    "DDPExchange",
    "FSDP2Exchange",
    "LocalExchange",
    "PeerFailure",
    "broadcast_from_rank_zero",
    "first_rank_where",
    "fsdp2_roots",
    "make_exchange",
    "register_exit_grace",
]

#: How long a process that ran the pack's collectives waits at exit before the interpreter shuts down.
EXIT_GRACE_SECONDS = 0.2
_exit_grace_registered = False


def register_exit_grace() -> None:
    """At exit, sleep :data:`EXIT_GRACE_SECONDS` so that the process group's worker threads finish freeing the
    tensors of the pack's collectives before the interpreter shuts down (else gloo can abort a run that
    succeeded). Registered once per process.
    """
    global _exit_grace_registered
    if _exit_grace_registered:
        return
    import atexit
    import time

    atexit.register(time.sleep, EXIT_GRACE_SECONDS)
    _exit_grace_registered = True


class LocalExchange:
    """A single device: the vote is this process's own, and there is nothing to reduce."""

    world_size = 1
    rank = 0
    #: Whether the ranks also vote inside a step, before each collective (FSDP2's all-gathers in the forward):
    #: a rank that runs out of memory anywhere in a step, an evaluation step or an extra forward, stops them all.
    votes_inside_step = False

    def prepare(self) -> None:
        """Nothing to allocate."""

    def begin(self, k: int) -> None:
        """An attempt at a batch starts with ``k`` micro-batches (nothing to do here)."""

    def recover(self) -> None:
        """After an attempt raised: nothing to put back."""

    def vote(self, status: int, k: int) -> list[Vote]:
        return [Vote(status, k)]

    def reduce(self) -> None:
        """Nothing to reduce."""

    def total(self, value: float) -> float:
        """``value`` summed over the ranks: this process's own."""
        return value


class DDPExchange:
    """Votes and gradient averaging for a ``DistributedDataParallel`` module whose backward never syncs.

    Args:
        ddp: the DDP-wrapped module (``trainer.strategy.model``).
        bucket_bytes: the most bytes one all-reduce carries (DDP's ``bucket_cap_mb``).
    """

    votes_inside_step = False

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
        # The reduced prefixes of each staging buffer, kept: a view made per all-reduce and dropped at
        # once would be freed by the process group's worker thread (see register_exit_grace).
        self._prefixes: dict[tuple[int, int], Tensor] = {}
        register_exit_grace()

    def prepare(self) -> None:
        """Allocate the vote tensor and the staging buffers once (an OOM here is the attempt's own)."""
        if self._votes is None:
            self._votes = torch.zeros(
                2 * self.world_size + len(self.params), dtype=torch.int64, device=self.device
            )
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for t in [*self.params, *self.buffers]:
            key = (t.dtype, t.device)
            sizes[key] = sizes.get(key, 0) + t.numel()
        for (dtype, device), numel in sizes.items():
            if (dtype, device) not in self._staging:
                cap = max(1, self.bucket_bytes // torch.empty((), dtype=dtype).element_size())
                self._staging[(dtype, device)] = torch.empty(min(numel, cap), dtype=dtype, device=device)

    def begin(self, k: int) -> None:
        """An attempt at a batch starts (its collectives all come after it, in :meth:`reduce`)."""

    def recover(self) -> None:
        """After an attempt raised: DDP's state is untouched (its backward never synced)."""

    def vote(self, status: int, k: int) -> list[Vote]:
        """Every rank's (status, k), in rank order; also learns which parameters have a gradient on any rank."""
        self.prepare()
        mask = [p.grad is not None for p in self.params]
        votes, extra = _all_reduce_votes(self._votes, self.rank, self.world_size, status, k, self.group, mask)
        self._used = [v > 0 for v in extra]
        return votes

    def total(self, value: float) -> float:
        """``value`` summed over the ranks (one all-reduce; every rank calls it at the same point of a batch)."""
        return _sum_over_ranks(value, self.device, self.group)

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
            prefix = self._prefixes.get((id(staging), cursor))
            if prefix is None:
                prefix = self._prefixes[(id(staging), cursor)] = staging[:cursor]
            dist.all_reduce(prefix, group=self.group)
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


def _sum_over_ranks(value: float, device: torch.device, group: Any) -> float:
    summed = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(summed, group=group)
    return float(summed.item())


def _all_reduce_votes(
    tensor: Tensor,
    rank: int,
    world_size: int,
    status: int,
    k: int,
    group: Any,
    extra: list[bool] | None = None,
) -> tuple[list[Vote], list[int]]:
    """One all-reduce of ``tensor``: this rank's (status, k) in its own two slots, ``extra`` flags summed after them.

    Returns every rank's vote in rank order, and the summed ``extra`` slots.
    """
    tensor.zero_()
    tensor[2 * rank] = status
    tensor[2 * rank + 1] = k
    n = 2 * world_size
    if extra:
        tensor[n:] = torch.tensor(extra, dtype=torch.int64)
    dist.all_reduce(tensor, group=group)
    values = tensor.tolist()
    return [Vote(int(values[2 * r]), int(values[2 * r + 1])) for r in range(world_size)], values[n:]


def fsdp2_roots(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``fully_shard`` modules of ``module`` with no ``fully_shard`` module above them (FSDP2's roots)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    roots: list[torch.nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():  # pre-order: a module comes before everything under it
        if id(sub) in inside:
            continue
        if isinstance(sub, FSDPModule):
            roots.append(sub)
            inside.update(id(m) for m in sub.modules())
    return roots


class _VotingComm:
    """One of FSDP's collectives (all-gather or reduce-scatter), preceded by the ranks' vote.

    FSDP allocates the collective's buffers (``allocate``) before it calls the collective, so a rank
    that runs out of memory for them does so before the vote, where its own vote can still meet the
    others'.
    """

    def __init__(self, inner: Any, exchange: FSDP2Exchange, vote_after: bool = False) -> None:
        self.inner, self.exchange, self.vote_after = inner, exchange, vote_after

    def allocate(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.exchange.check()
        out = self.inner(*args, **kwargs)
        if self.vote_after:  # HSDP: the replicas' all-reduce of this reduce-scatter's output comes next
            self.exchange.check()
        return out


def _mesh_groups(mesh_info: Any) -> tuple[Any, Any]:
    """(shard group, replicate group or ``None``) of one FSDP parameter group's mesh."""
    return getattr(mesh_info, "shard_process_group", None), getattr(
        mesh_info, "replicate_process_group", None
    )


class FSDP2Exchange:
    """Votes for a module sharded with FSDP2 ``fully_shard`` over one mesh (see the module docs).

    The mesh is one-dimensional (the ranks vote in its process group) or HSDP's ``(replicate, shard)``
    mesh covering every rank (the ranks vote in the default group, once more before each replicas'
    all-reduce).

    Args:
        module: the LightningModule (``trainer.strategy.model``), already sharded.

    Raises:
        ValueError: nothing in ``module`` is sharded, its units shard over different meshes, an HSDP
            mesh does not cover every rank or shards over groups of one rank, or a unit only
            replicates (``replicate``, DDP-style).
    """

    votes_inside_step = True

    def __init__(self, module: torch.nn.Module) -> None:
        register_exit_grace()
        self.roots = fsdp2_roots(module)
        self.groups = [g for root in self.roots for g in _compat.fsdp_param_groups(root)]
        if not self.groups:
            raise ValueError(f"{type(module).__name__} has no `fully_shard` module with parameters")
        meshes = {
            tuple(id(pg) for pg in _mesh_groups(g.mesh_info)): _mesh_groups(g.mesh_info) for g in self.groups
        }
        if len(meshes) != 1:
            raise ValueError(
                "every `fully_shard` unit must shard over the same mesh (one data-parallel dimension, or one HSDP "
                "(replicate, shard) mesh for all units)"
            )
        ((shard_group, replicate_group),) = meshes.values()
        if shard_group is None:
            raise ValueError(
                "a unit only replicates (`replicate`, no shard dimension): its all-reduce cannot be voted; shard it "
                "with `fully_shard`"
            )
        #: HSDP: the units' gradients are all-reduced across replicas after each reduce-scatter.
        self.hybrid = replicate_group is not None
        if self.hybrid:
            shards, replicas = dist.get_world_size(shard_group), dist.get_world_size(replicate_group)
            if shards < 2 or shards * replicas != dist.get_world_size():
                raise ValueError(
                    f"an HSDP mesh of {replicas} replica(s) x {shards} shard(s) must cover all {dist.get_world_size()} "
                    "ranks with at least 2 ranks per shard group (FSDP2Strategy(hsdp=True) builds one)"
                )
        self.group = None if self.hybrid else shard_group  # HSDP: every rank votes in the default group
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = self.groups[0].device
        self.k = 1
        #: How often another rank's failure stopped this rank at a vote before one of FSDP's collectives.
        self.peer_stops = 0
        self._votes: Tensor | None = None
        self._originals: list[tuple[Any, Any, Any]] = []

    def install(self) -> None:
        """Put a vote before every all-gather and reduce-scatter of every unit."""
        if self._originals:
            return
        for g in self.groups:
            all_gather, reduce_scatter = _compat.fsdp_collectives(g)
            self._originals.append((g, all_gather, reduce_scatter))
            _compat.set_fsdp_collectives(
                g,
                _VotingComm(all_gather, self),
                _VotingComm(reduce_scatter, self, vote_after=self.hybrid),
            )

    def uninstall(self) -> None:
        """Give FSDP its own collectives back."""
        for g, all_gather, reduce_scatter in self._originals:
            _compat.set_fsdp_collectives(g, all_gather, reduce_scatter)
        self._originals = []

    def prepare(self) -> None:
        """Allocate the vote tensor once."""
        if self._votes is None:
            self._votes = torch.zeros(2 * self.world_size, dtype=torch.int64, device=self.device)

    def begin(self, k: int) -> None:
        """An attempt with ``k`` micro-batches starts; every rank must run as many (one vote checks it).

        Each micro-batch issues its own all-gathers and reduce-scatters, so ranks running different
        numbers of them would pair mismatched collectives. Raises ``RuntimeError`` on every rank alike
        when the counts differ (ranks with different batch sizes, or a batch one rank cannot split).
        """
        self.prepare()
        self.install()
        self.k = k
        counts = [v.k for v in self.vote(0, k)]
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"Under FSDP2 every rank must run a batch as the same number of micro-batches (each one all-gathers "
                f"and reduce-scatters), but the ranks would run {counts}: their batches differ in size, or one cannot "
                "be split. Give every rank batches of the same size (Lightning's DistributedSampler does; "
                "`drop_last=True` for a custom sampler) and declare batches unsplittable alike on every rank."
            )

    def vote(self, status: int, k: int) -> list[Vote]:
        """Every rank's (status, k), in rank order."""
        self.prepare()
        return _all_reduce_votes(self._votes, self.rank, self.world_size, status, k, self.group)[0]

    def check(self) -> None:
        """This rank is fine so far; raise :class:`PeerFailure` when another one is not."""
        votes = self.vote(0, self.k)
        if any(v.status for v in votes):
            self.peer_stops += 1
            raise PeerFailure(votes)

    def recover(self) -> None:
        """Before a retry, on every rank: reshard every unit, reset FSDP's per-step state, drop unsharded gradients.

        ``reset_iter_state`` keeps the unsharded parameters' ``.grad`` (gradients autograd accumulated in an
        interrupted backward before FSDP reduce-scattered them); the retry would add to them. Under HSDP it
        also waits for and drops the replicas' all-reduce state and any partial (not yet all-reduced)
        gradient; the sharded gradients of the interrupted attempt are dropped by the engine, on every rank.
        """
        for root in self.roots:
            root.reset_iter_state()
        for g in self.groups:
            for fsdp_param in getattr(g, "fsdp_params", []):
                unsharded = _compat.fsdp_unsharded_param(fsdp_param)
                if unsharded is not None:
                    unsharded.grad = None
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None

    def reduce(self) -> None:
        """Nothing: FSDP reduce-scattered the gradients in each backward."""

    def total(self, value: float) -> float:
        """``value`` summed over the ranks, after a vote (a rank that ran out of memory before it stops them all)."""
        self.check()
        return _sum_over_ranks(value, self.device, self.group)


def make_exchange(strategy: Any) -> LocalExchange | DDPExchange | FSDP2Exchange:
    """The exchange for ``strategy``'s ranks (a strategy :mod:`~lightning_gpuopt.microbatch.setup_checks` accepted)."""
    if isinstance(strategy, ModelParallelStrategy):
        try:
            return FSDP2Exchange(strategy.model)
        except ValueError as err:
            raise Refused(
                f"Micro-batching under {type(strategy).__name__} needs the model sharded with FSDP2 `fully_shard`: "
                f"{err}. Use FSDP2Strategy (it shards an unchanged module), or train without OOMRecovery here."
            ) from err
    if isinstance(strategy, DDPStrategy):
        bucket_mb = _compat.ddp_kwargs(strategy).get("bucket_cap_mb", 25) or 25
        return DDPExchange(strategy.model, bucket_bytes=int(bucket_mb * 2**20))
    return LocalExchange()


def broadcast_from_rank_zero(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` (plain, picklable values) on every rank; ``value`` itself without a process group."""
    if not _distributed():
        return value
    register_exit_grace()  # torch's broadcast drops its tensors at once: freed by gloo's worker thread
    payload = [value]
    dist.broadcast_object_list(payload, src=src)
    return payload[0]


def first_rank_where(flag: bool) -> int | None:
    """The lowest rank whose ``flag`` is true (every rank takes part), ``None`` where no rank's is."""
    if not _distributed():
        return 0 if flag else None
    register_exit_grace()
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return next((rank for rank, raised in enumerate(flags) if raised), None)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
