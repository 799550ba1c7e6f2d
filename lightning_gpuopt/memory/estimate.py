"""How much device memory a model's training state takes per device under each way of distributing it.

Pure arithmetic over a few counts (parameters, bytes per element), plus two small measurements that
need no device memory: :func:`count_parameters` (works on a model built on the ``meta`` device) and
:func:`activation_bytes_per_sample` (what a forward keeps for the backward, per sample, counted with
autograd's saved-tensor hooks; runs on ``meta`` too). Imports torch only.

The figures per device, for ``N`` parameters sharded over ``W`` ranks (the strategy table in
docs/multi-gpu.md says where each comes from):

- parameters: ``N × param_bytes`` (``/ W`` when sharded), with ``param_bytes`` from the precision
  (4 for ``32-true`` and the ``*-mixed`` ones, whose weights stay fp32; 2 for ``bf16-true``/``16-true``);
- gradients: the same size as the parameters (``/ W`` when sharded); plain DDP also keeps a copy of
  them in its communication buckets;
- optimizer state: ``N × state_elements × param_bytes`` (Adam/AdamW: 2, SGD with momentum: 1,
  SGD: 0, ...), ``/ W`` when sharded; DeepSpeed's mixed precision keeps an fp32 master copy too
  (the ZeRO paper's 16 bytes per parameter: 2 + 2 + 4 + 4 + 4);
- for fully sharded strategies, the largest unit gathered whole while it runs (twice: the next one
  is prefetched), in the compute dtype;
- HSDP (sharding within a node, replicating across nodes) is full sharding over the ranks of one
  node: ``W`` is then the devices per node, and its all-reduce across nodes runs in place on the
  sharded gradients;
- activations: ``micro-batch × bytes per sample``, measured when MemoryAwareBatchSize measured, else
  estimated with :func:`activation_bytes_per_sample`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gpuopt._compat import storage_id
from lightning_gpuopt.memory.walk import sample_count

__all__ = [
    "CANDIDATES",
    "Candidate",
    "MemoryEstimate",
    "ModelCounts",
    "activation_bytes_per_sample",
    "count_parameters",
    "estimate",
    "optimizer_state_elements",
    "precision_bytes",
]


@dataclass(frozen=True)
class ModelCounts:
    """What the estimate needs to know about a model.

    Attributes:
        trainable: parameters that get gradients and optimizer state.
        frozen: parameters without gradients.
        buffers_bytes: bytes of buffers (BatchNorm statistics, ...), replicated on every device.
        largest_unit: parameters of the largest module a fully sharded strategy gathers at once.
    """

    trainable: int
    frozen: int = 0
    buffers_bytes: int = 0
    largest_unit: int = 0

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def count_parameters(model: nn.Module, units: Iterable[nn.Module] | None = None) -> ModelCounts:
    """Count a model's parameters and buffers (a model on the ``meta`` device works: nothing is read).

    Args:
        model: the model.
        units: the modules a fully sharded strategy would gather one at a time; ``None``: the model's
            direct children (the parameters of the largest one count as the largest unit).

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Linear(1000, 1000), nn.BatchNorm1d(1000), nn.Linear(1000, 10))
        >>> count_parameters(net)
        ModelCounts(trainable=1013010, frozen=0, buffers_bytes=8008, largest_unit=1001000)
    """
    seen: set[int] = set()
    trainable = frozen = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    units = list(model.children()) if units is None else list(units)
    largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
    return ModelCounts(trainable, frozen, buffers, largest or trainable + frozen)


#: Optimizer state elements per parameter element, by optimizer class name (lower case).
_STATE_ELEMENTS = {
    "adam": 2,
    "adamw": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,
    "lamb": 2,
    "fusedadam": 2,
    "deepspeedcpuadam": 2,
    "adagrad": 1,
    "rmsprop": 1,
    "sgd": 0,
    "adadelta": 2,
    "asgd": 1,
    "rprop": 2,
    "lion": 1,
    "adafactor": 1,
}


def optimizer_state_elements(optimizer: Any) -> float:
    """State elements per parameter element that ``optimizer`` keeps (an optimizer, its class, or its name).

    SGD keeps one momentum buffer when ``momentum > 0`` (read from an instance's defaults); RMSprop one
    more with momentum and another when centered. Unknown optimizers count as Adam (2), the common case.

    Example:
        >>> optimizer_state_elements("AdamW"), optimizer_state_elements("sgd")
        (2, 0)
        >>> optimizer_state_elements(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9))
        1
    """
    if isinstance(optimizer, str):
        name, defaults = optimizer, {}
    elif isinstance(optimizer, type):
        name, defaults = optimizer.__name__, {}
    else:
        name, defaults = type(optimizer).__name__, getattr(optimizer, "defaults", {})
    key = name.lower()
    elements = _STATE_ELEMENTS.get(key, 2)
    if key == "sgd" and defaults.get("momentum", 0):
        elements = 1
    if key == "rmsprop":
        elements += int(bool(defaults.get("momentum", 0))) + int(bool(defaults.get("centered", False)))
    return elements


def precision_bytes(precision: str | int | None) -> tuple[int, int]:
    """(bytes per parameter element as stored, bytes per element the forward computes in) for a Lightning precision.

    Example:
        >>> precision_bytes("bf16-mixed"), precision_bytes("bf16-true"), precision_bytes("32-true")
        ((4, 2), (2, 2), (4, 4))
    """
    p = str(precision if precision is not None else "32-true")
    if p in ("64", "64-true", "double"):
        return 8, 8
    if p in ("bf16-true", "16-true", "bf16", "16", "half"):
        return 2, 2
    if p in ("bf16-mixed", "16-mixed", "transformer-engine", "transformer-engine-float16"):
        return 4, 2
    return 4, 4


@dataclass(frozen=True)
class Candidate:
    """One way of distributing the training state.

    Attributes:
        name: ``"single device"``, ``"ddp"``, ``"fsdp: shard grads+optimizer"``, ...
        shard_params, shard_grads, shard_optimizer: which parts are divided among the ranks.
        offload: parameters, gradients and optimizer state live in host memory (only the unit in use
            is on the device).
        gathers_units: the largest unit is gathered whole (twice, with prefetch) while it runs.
        grad_copies: copies of the gradients on the device (plain DDP: 2, its buckets).
        master_copy: DeepSpeed mixed precision's fp32 master weights (sharded like the optimizer).
        deepspeed: needs the deepspeed package.
        hybrid: HSDP: the sharded parts are divided among the devices of one node (the shard group),
            and the nodes hold replicas; its ``world_size`` in :func:`estimate` is the devices per node.
        cost: communication rank, lower first: among the candidates that fit, the cheapest is picked.
    """

    name: str
    shard_params: bool = False
    shard_grads: bool = False
    shard_optimizer: bool = False
    offload: bool = False
    gathers_units: bool = False
    grad_copies: int = 1
    master_copy: bool = False
    deepspeed: bool = False
    multi_device: bool = True
    hybrid: bool = False
    cost: int = 0


#: What every full-shard candidate (FSDP full shard, HSDP, ZeRO-3) shards, and its all-gathers per unit.
_FULL_SHARD: dict[str, Any] = {
    "shard_params": True,
    "shard_grads": True,
    "shard_optimizer": True,
    "gathers_units": True,
}

#: The candidates, cheapest communication first. HSDP (several nodes only) comes before every candidate
#: that shards across nodes: its all-gathers and reduce-scatters stay within a node, and only its
#: sharded gradients (1/devices of them) are all-reduced across nodes.
CANDIDATES: tuple[Candidate, ...] = (
    Candidate("single device", multi_device=False, cost=0),
    Candidate("ddp", grad_copies=2, cost=1),
    Candidate("deepspeed zero-1", shard_optimizer=True, master_copy=True, deepspeed=True, cost=2),
    Candidate("hsdp: full shard in node", **_FULL_SHARD, hybrid=True, cost=3),
    Candidate("fsdp: shard grads+optimizer", shard_grads=True, shard_optimizer=True, cost=4),
    Candidate(
        "deepspeed zero-2", shard_grads=True, shard_optimizer=True, master_copy=True, deepspeed=True, cost=4
    ),
    Candidate("fsdp: full shard", **_FULL_SHARD, cost=5),
    Candidate("deepspeed zero-3", **_FULL_SHARD, master_copy=True, deepspeed=True, cost=5),
    Candidate("fsdp: full shard + cpu offload", **_FULL_SHARD, offload=True, cost=7),
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one candidate, by component.

    ``host`` is what one rank keeps in host memory instead (CPU offload: its shards of the parameters,
    gradients and optimizer state); it is not part of :attr:`total`, which is device memory only.
    """

    candidate: Candidate
    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    buffers: int
    activations: int
    components: dict[str, int] = field(default_factory=dict)
    host: int = 0

    @property
    def model_state(self) -> int:
        """Parameters, gradients, optimizer state, gathered units and buffers: everything but activations."""
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.buffers

    @property
    def total(self) -> int:
        return self.model_state + self.activations


def estimate(
    counts: ModelCounts,
    candidate: Candidate,
    world_size: int,
    precision: str | None = "32-true",
    optimizer: Any = "adam",
    activation_bytes: int = 0,
) -> MemoryEstimate:
    """Per-device bytes of ``candidate`` for a model with ``counts``, trained on ``world_size`` ranks.

    Args:
        counts: the model's parameter counts (:func:`count_parameters`).
        candidate: how the state is distributed.
        world_size: ranks sharing the sharded parts (the data-parallel group; under HSDP, the devices of
            one node).
        precision: the Lightning precision (sets bytes per element, see :func:`precision_bytes`).
        optimizer: an optimizer, its class or name (sets the state elements, see :func:`optimizer_state_elements`).
        activation_bytes: activations of the micro-batch to plan for.

    Example:
        >>> counts = ModelCounts(trainable=1_000_000)
        >>> single = estimate(counts, CANDIDATES[0], 1, "32-true", "adam")
        >>> single.parameters, single.gradients, single.optimizer
        (4000000, 4000000, 8000000)
        >>> full_shard = next(c for c in CANDIDATES if c.name == "fsdp: full shard")
        >>> full = estimate(counts, full_shard, 4, "32-true", "adam")
        >>> full.parameters, full.optimizer
        (1000000, 2000000)
        >>> offload = estimate(counts, next(c for c in CANDIDATES if c.offload), 4, "32-true", "adam")
        >>> offload.parameters, offload.host  # the rank's shards of parameters, gradients and Adam state
        (0, 4000000)
    """
    world = max(1, int(world_size)) if candidate.multi_device else 1
    stored, compute = precision_bytes(precision)
    if candidate.deepspeed and stored == 4 and compute == 2:  # DeepSpeed runs the model in half precision
        stored = 2
    state = optimizer_state_elements(optimizer)

    def share(n: float, sharded: bool) -> int:
        return int(-(-n // world)) if sharded else int(n)

    params = share(counts.total * stored, candidate.shard_params)
    grads = share(counts.trainable * stored, candidate.shard_grads) * candidate.grad_copies
    state_bytes = counts.trainable * state * (4 if candidate.deepspeed else stored)
    if candidate.master_copy and stored < 4:
        state_bytes += counts.trainable * 4
    optimizer_bytes = share(state_bytes, candidate.shard_optimizer)
    gathered = 2 * counts.largest_unit * compute if candidate.gathers_units else 0
    on_device = 0 if candidate.offload else 1
    return MemoryEstimate(
        candidate=candidate,
        parameters=params * on_device,
        gradients=grads * on_device,
        optimizer=optimizer_bytes * on_device,
        gathered=gathered,
        buffers=counts.buffers_bytes,
        activations=int(activation_bytes),
        host=(params + grads + optimizer_bytes) * (1 - on_device),
    )


def activation_bytes_per_sample(
    model: nn.Module, sample_batch: Any, forward: Callable[[nn.Module, Any], Any] | None = None
) -> int:
    """Bytes the forward keeps for the backward, per sample, counted on one batch (on any device, ``meta`` too).

    Autograd's saved-tensor hooks see every tensor a forward saves for its backward; their bytes,
    each storage once, divided by the batch's samples, is the activation memory per sample the
    backward needs. Transient buffers that die within the forward are not counted: plan with headroom.

    Args:
        model: the module (its parameters may be on ``meta``).
        sample_batch: a batch whose first dimension is samples (a tensor, or what ``forward`` takes).
        forward: ``forward(model, batch) -> output``; ``None``: ``model(batch)``.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 1))
        ...     x = torch.empty(4, 8)
        >>> activation_bytes_per_sample(net, x)  # per sample: the input (8 floats) and the ReLU output (256)
        1056
    """
    n = max(1, sample_count(sample_batch))
    # Storages are told apart by their StorageImpl address (`_cdata`), which also works on `meta`;
    # parameters (and the transposed views of weights that matmuls save) are model state, not activations.
    seen = {storage_id(p.untyped_storage()) for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        try:
            key = storage_id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(model, sample_batch) if forward is not None else model(sample_batch)
    del out
    return total // n
