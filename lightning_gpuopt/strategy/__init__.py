"""Choose how to spread training over devices from memory needs: :func:`select_strategy`, and FSDP2 for unchanged modules.

:func:`select_strategy` estimates, per device, the bytes of parameters, gradients, optimizer state,
gathered units and activations under each candidate (single device, DDP, FSDP sharding gradients and
optimizer state, full sharding, full sharding with CPU offload, DeepSpeed ZeRO stages) with
:mod:`lightning_gpuopt.memory.estimate`, compares them with the device's memory, and picks the
candidate with the least communication that fits. The returned :class:`StrategyPlan` prints as a
table and carries the Lightning strategy to pass to the Trainer.

:class:`FSDP2Strategy` is Lightning's ``ModelParallelStrategy`` (FSDP2, ``fully_shard``; it also runs
on CPU over gloo) for a LightningModule that does not define ``configure_model``: the pack applies
``fully_shard`` to the repeated blocks it finds (or the module types named) and to each child holding
parameters.
"""

from lightning_gpuopt.strategy.fsdp2 import FSDP2Strategy, hsdp_shape, shard_module, shard_units
from lightning_gpuopt.strategy.plan import (
    PlanRow,
    StrategyPlan,
    StrategyPlanError,
    optimizer_of,
    select_strategy,
)
from lightning_gpuopt.strategy.sample import sample_batch_of

__all__ = [
    "FSDP2Strategy",
    "PlanRow",
    "StrategyPlan",
    "StrategyPlanError",
    "hsdp_shape",
    "optimizer_of",
    "sample_batch_of",
    "select_strategy",
    "shard_module",
    "shard_units",
]
