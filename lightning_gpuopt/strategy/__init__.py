"""How to spread training over devices: the plan (:mod:`.plan`, :func:`select_strategy`), FSDP2 for a module
that does not shard itself (:mod:`.fsdp2`, :class:`FSDP2Strategy`), and the sample batch a plan is traced
with (:mod:`.sample`, :func:`sample_batch_of`)."""

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
