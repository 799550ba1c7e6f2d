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
from lightning_gpuopt.support import Feature, manual_optimization_refusal, unsupported_strategy

__all__ = ["check_strategy", "check_supported"]


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
