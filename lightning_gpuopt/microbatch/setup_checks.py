"""Where the micro-batch engine can run: the strategies and training setups it refuses, and why.

The answers per strategy come from :mod:`lightning_gpuopt.support` (the one support matrix, which also words
the refusals the engine shares with the callbacks); this module turns them into the engine's refusals, each
naming the alternative.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

from lightning_gpuopt import _compat
from lightning_gpuopt.microbatch.errors import Refused
from lightning_gpuopt.support import (
    Feature,
    StrategyKind,
    manual_optimization_refusal,
    strategy_kind,
    supports,
)

__all__ = ["check_strategy", "check_supported", "unsupported_strategy"]


def check_supported(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Refuse what micro-batching cannot run: manual optimization, several optimizers, closure optimizers, and
    the strategies of :func:`check_strategy`."""
    refusal = manual_optimization_refusal(Feature.OOM_RECOVERY, module, who="Micro-batching")
    if refusal is not None:
        raise Refused(refusal)
    optimizers = trainer.optimizers
    if len(optimizers) != 1:
        raise Refused(
            f"Micro-batching supports exactly one optimizer, got {len(optimizers)}. Combine the parameter "
            "groups into one optimizer, or remove OOMRecovery for this module."
        )
    if isinstance(optimizers[0], torch.optim.LBFGS):
        raise Refused(
            "Micro-batching cannot run closure optimizers such as LBFGS (they re-evaluate the closure "
            "several times per step). Use a first-order optimizer such as SGD or AdamW."
        )
    check_strategy(trainer.strategy, module)


def unsupported_strategy(strategy: Any, feature: Feature) -> str | None:
    """Why the engine cannot run ``feature`` under ``strategy``, naming the alternative; ``None`` when it can.

    The answer comes from :mod:`lightning_gpuopt.support`, for ``Feature.OOM_RECOVERY`` or
    ``Feature.BATCH_SIZE_SEARCH``: single device, DDP and FSDP2 without tensor parallelism, on a torch that
    can reset FSDP2 after an interrupted step. Not under FSDP1 (``FSDPStrategy``) or DeepSpeed, whose
    collectives inside the step cannot be kept in step when one rank runs out of memory.
    """
    feature = Feature(feature)
    if feature not in (Feature.OOM_RECOVERY, Feature.BATCH_SIZE_SEARCH):
        raise ValueError(
            f"`feature` must be a micro-batching feature (OOMRecovery, MemoryAwareBatchSize), got {feature}"
        )
    answer = supports(feature, strategy)
    if answer.supported:
        return None
    name = type(strategy).__name__
    kind = strategy_kind(strategy)
    if feature is Feature.OOM_RECOVERY and kind is StrategyKind.TENSOR_PARALLEL:
        return (
            f"micro-batching under {name} supports FSDP2 data parallelism only, got tensor_parallel_size="
            f"{_compat.tensor_parallel_size(strategy)} (tensor-parallel collectives inside the forward cannot be kept in "
            "step). Use tensor_parallel_size=1, or train without OOMRecovery here."
        )
    if kind is StrategyKind.FSDP2:
        return f"{answer.reason}, or train without {feature.value} under {name}."
    return (
        f"micro-batching supports single-device, DDP and FSDP2 (ModelParallelStrategy) training, got {name} "
        f"({answer.reason}). Use strategy='ddp' (or one device), or FSDP2Strategy for a sharded model, or train "
        "without the pack's micro-batching callbacks (OOMRecovery, MemoryAwareBatchSize) here."
    )


def check_strategy(strategy: Any, module: pl.LightningModule) -> None:
    """Refuse the strategies and settings under which the engine cannot keep ranks in step."""
    if isinstance(strategy, SingleDeviceStrategy):
        return
    reason = unsupported_strategy(strategy, Feature.OOM_RECOVERY)
    if reason is not None:
        raise Refused(reason[0].upper() + reason[1:])
    sync_norms = [type(m).__name__ for m in module.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    kind = "FSDP2" if isinstance(strategy, ModelParallelStrategy) else "DDP"
    if sync_norms:
        raise Refused(
            f"Micro-batching under {kind} cannot run SyncBatchNorm: it communicates inside the forward, so a rank "
            "that runs out of memory mid-forward would leave the other ranks waiting. Use plain BatchNorm "
            "(Trainer(sync_batchnorm=False)), or remove OOMRecovery for this run."
        )
    if isinstance(strategy, ModelParallelStrategy):
        return  # the DDP settings below do not apply; the exchange checks the sharded model when it is built
    ddp = strategy.model
    if _compat.ddp_comm_hook_set(strategy, ddp):
        raise Refused(
            "Micro-batching under DDP averages the gradients itself at the optimizer step, so a DDP "
            "communication hook (`ddp_comm_hook`) would never run. Remove the hook, or remove OOMRecovery."
        )
    if getattr(ddp, "static_graph", False):
        raise Refused(
            "Micro-batching under DDP cannot run with `static_graph=True`: DDP would all-reduce inside the "
            "first backward, which the engine keeps free of collectives. Use DDPStrategy(static_graph=False)."
        )
