"""FSDP2 (``fully_shard``) for a LightningModule that does not shard itself: :class:`FSDP2Strategy`, the units it
shards (:func:`shard_units`) and the HSDP mesh's shape.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_gpuopt._validate import positive_int
from lightning_gpuopt.activation_checkpointing import describe_module_types, matching_modules
from lightning_gpuopt.memory.blocks import repeated_blocks

__all__ = [
    "FSDP2Strategy",
    "hsdp_shape",
    "shard_module",
    "shard_units",
]


def shard_units(module: nn.Module, types: list[str | type[nn.Module]] | None = None) -> list[nn.Module]:
    """The submodules a fully sharded strategy gathers one at a time (the units of ``fully_shard``).

    With ``types``, every submodule of those types (class, class name or qualified name). Without, the
    repeated blocks (:func:`lightning_gpuopt.memory.blocks.repeated_blocks`): the outermost modules
    that run and have a sibling of their type, each holding at least 1 % of the parameters
    (transformer layers, an encoder's and a decoder's, ResNet stages). A container without a
    ``forward`` (``ModuleList``, ``ModuleDict``) is never a unit: its items are. Units never nest: only
    the outermost matches count.

    Example:
        >>> net = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)), nn.Linear(64, 1))
        >>> [type(u).__name__ for u in shard_units(net)]
        ['Sequential', 'Sequential', 'Sequential', 'Sequential']
    """
    if not types:
        return repeated_blocks(module)
    found = matching_modules(module, types)
    outer: list[nn.Module] = []
    inside: set[int] = set()
    for m in found:
        if id(m) in inside:
            continue
        outer.append(m)
        inside.update(id(sub) for sub in m.modules())
    return outer


def _fully_shard() -> Any:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _sharded_by_the_pack() -> None:
    """Stands in for ``configure_model`` while Lightning checks that one exists: the pack already sharded."""


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) data parallelism over every process, for an unchanged LightningModule.

    Lightning's ``ModelParallelStrategy`` requires the LightningModule to apply ``fully_shard`` in its
    own ``configure_model``. This strategy does it for a module that does not: ``fully_shard`` on each
    unit (:func:`shard_units`: the repeated blocks, or the types in ``shard_modules``), then on each
    child of the LightningModule that holds parameters, over a one-dimensional data-parallel mesh of
    all processes. A module with its own ``configure_model`` is left to it. Runs on CUDA (NCCL) and on
    CPU (gloo).

    With ``hsdp=True`` (hybrid sharding, HSDP) the units are sharded over a ``(replicate, shard)`` mesh
    (:attr:`shard_mesh`): the ranks of a node shard the model, the nodes hold replicas, and only the sharded
    gradients cross nodes (docs/multi-gpu.md, "HSDP").

    Args:
        shard_modules: module types to shard as units; ``None``: the repeated blocks.
        reshard_after_forward: free each unit's gathered parameters after its forward (full sharding);
            ``False`` keeps them until the backward (sharding gradients and optimizer state only).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in host memory.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit (e.g. bfloat16 parameters gathered,
            float32 reductions); ``None``: FSDP2's default (the parameters' own dtype throughout).
            :class:`~lightning_gpuopt.PrecisionSwitch` sets it at setup when it chooses ``bf16-mixed``.
            Fixed once the model is sharded: FSDP2 has no API to change it afterwards.
        hsdp: shard within groups of ranks and replicate across them (HSDP) instead of sharding over
            every rank.
        replicate_size: with ``hsdp``, the number of replicas (groups sharding the model); ``None``: the
            number of nodes. It must divide the world size, leaving at least 2 ranks per group.
        **kwargs: passed to ``ModelParallelStrategy`` (``process_group_backend``, ``timeout``, ...).

    Raises:
        ValueError: ``replicate_size`` without ``hsdp=True`` or not a positive int; at setup, a
            ``replicate_size`` that does not divide the world size into groups of at least 2 ranks, the
            LightningModule holds parameters itself (not in a child module), ``shard_modules`` names no
            submodule, or ``mp_policy`` is given for a module that shards itself in ``configure_model``;
            the message names what to do.

    Example:
        >>> FSDP2Strategy(shard_modules=["TransformerBlock"], cpu_offload=False).reshard_after_forward
        True
        >>> FSDP2Strategy(hsdp=True).hsdp
        True
    """

    def __init__(
        self,
        shard_modules: list[str | type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        mp_policy: Any = None,
        hsdp: bool = False,
        replicate_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(hsdp, bool):
            raise ValueError(f"`hsdp` must be True or False, got {hsdp!r}")
        if replicate_size is not None:
            positive_int("replicate_size", replicate_size, unit="the number of replicas", allow_none=True)
            if not hsdp:
                raise ValueError(
                    f"`replicate_size` ({replicate_size}) sets the replicas of HSDP: pass `hsdp=True` with it, or leave "
                    "it out to shard over every rank"
                )
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)
        self.shard_modules = list(shard_modules) if shard_modules else None
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.mp_policy = mp_policy
        self.hsdp = hsdp
        self.replicate_size = replicate_size
        self._hsdp_mesh: Any = None

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # every process shards the model (no tensor parallelism)
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self.hsdp:  # before the process group exists: a bad size fails before any process waits on another
            hsdp_shape(self.num_nodes * self.num_processes, self.replicate_size or self.num_nodes)
        super().setup_environment()
        if self.hsdp:
            from torch.distributed.device_mesh import init_device_mesh

            replicas, shards = hsdp_shape(self.world_size, self.replicate_size or self.num_nodes)
            self._hsdp_mesh = init_device_mesh(
                self.root_device.type, (replicas, shards), mesh_dim_names=("replicate", "shard")
            )

    @property
    def shard_mesh(self) -> Any:
        """The mesh the pack shards over: HSDP's 2-D ``(replicate, shard)`` mesh, else Lightning's ``data_parallel`` one."""
        if self.hsdp:
            if self._hsdp_mesh is None:
                raise RuntimeError("Accessing the HSDP mesh before the strategy set up its processes")
            return self._hsdp_mesh
        return self.device_mesh["data_parallel"]

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        if is_overridden("configure_model", module):
            if self.mp_policy is not None:
                raise ValueError(
                    f"FSDP2Strategy(mp_policy=...) applies the policy when the pack shards the module, but "
                    f"{type(module).__name__} shards itself in `configure_model`. Pass `mp_policy=` to your own "
                    "`fully_shard` calls there, or leave FSDP2Strategy's `mp_policy` unset."
                )
            return super().setup(trainer)
        self.shard(module)
        module.configure_model = _sharded_by_the_pack
        try:
            super().setup(trainer)
        finally:
            vars(module).pop("configure_model", None)
        return None

    def shard(self, module: nn.Module) -> list[nn.Module]:
        """Apply ``fully_shard`` to ``module``'s units and parameter-holding children; returns what was sharded."""
        return shard_module(
            module,
            self.shard_mesh,
            self.shard_modules,
            self.reshard_after_forward,
            self.cpu_offload,
            mp_policy=self.mp_policy,
        )


def hsdp_shape(world_size: int, replicate_size: int) -> tuple[int, int]:
    """``(replicas, ranks per shard group)`` of HSDP over ``world_size`` ranks with ``replicate_size`` replicas.

    Raises:
        ValueError: ``replicate_size`` does not divide ``world_size`` into groups of at least 2 ranks.

    Example:
        >>> hsdp_shape(16, 2)   # 2 nodes of 8: each node shards the model, the nodes replicate it
        (2, 8)
    """
    if world_size % replicate_size:
        raise ValueError(
            f"HSDP needs `replicate_size` to divide the world size: {replicate_size} replicas of {world_size} ranks "
            "leave groups of unequal size. Pick a replicate_size that divides devices x num_nodes (by default it is "
            "num_nodes)."
        )
    shards = world_size // replicate_size
    if shards < 2:
        raise ValueError(
            f"HSDP with {replicate_size} replicas of {world_size} ranks leaves {shards} rank per shard group: nothing "
            "is sharded. Use strategy='ddp' for pure replication, or a smaller replicate_size."
        )
    return replicate_size, shards


def shard_module(
    module: nn.Module,
    mesh: Any,
    types: list[str | type[nn.Module]] | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    mp_policy: Any = None,
) -> list[nn.Module]:
    """``fully_shard`` every unit of ``module`` (:func:`shard_units`), then every child holding parameters, over ``mesh``.

    ``mp_policy`` (a ``MixedPrecisionPolicy``; ``None``: FSDP2's default) goes to every ``fully_shard`` call.
    Returns the modules sharded, units first.

    Raises:
        ValueError: ``module`` holds parameters itself, or ``types`` names no submodule.
    """
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"FSDP2Strategy shards the children of {type(module).__name__}, but it holds parameters itself "
            f"({', '.join(own)}). Move them into a submodule, or define `configure_model` and apply `fully_shard` there."
        )
    if types and not matching_modules(module, types):
        raise ValueError(
            f"`shard_modules` names {types}, but {type(module).__name__} has no such submodule; its module types are: "
            f"{describe_module_types(module)}."
        )
    fully_shard = _fully_shard()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        # Pinned host memory needs a CUDA driver; on a CPU mesh (gloo) the shards stay in plain host memory.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=getattr(mesh, "device_type", "cpu") == "cuda")
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    sharded = []
    for unit in shard_units(module, types):
        fully_shard(unit, **kwargs)
        sharded.append(unit)
    for child in module.children():
        if all(child is not unit for unit in sharded) and any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)
            sharded.append(child)
    return sharded
