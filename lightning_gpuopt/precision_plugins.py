"""The Lightning side of a precision change: which plugin takes a precision, and when none can.

PrecisionSwitch (``callbacks/precision_switch.py``) decides with the pure ladder of ``precision.py`` and
installs what these functions give it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    FSDPPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
)
from lightning.pytorch.strategies import (
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceXLAStrategy,
    Strategy,
    XLAStrategy,
)

from lightning_gpuopt.precision import is_faster
from lightning_gpuopt.support import Feature, StrategyKind, strategy_kind, supports

__all__ = ["SpentScaler", "is_faster", "plugin_for", "why_precision_fixed"]


class SpentScaler:
    """Takes the place of the GradScaler of a plugin replaced in the middle of its own optimizer step.

    The batch already ran again in the new precision inside the closure; the old plugin's remaining
    calls (``unscale_``, ``step``, ``update``) must neither unscale the new gradients nor skip the
    step on the old scaler's state.
    """

    def scale(self, outputs: Any) -> Any:
        return outputs

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        return None

    def is_enabled(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


def why_precision_fixed(strategy: Strategy, module: pl.LightningModule) -> str | None:
    """Why the precision cannot change during this fit; ``None`` when it can."""
    name = type(strategy).__name__
    if isinstance(strategy, (XLAStrategy, SingleDeviceXLAStrategy)):
        return f"{name} manages precision itself"
    answer = supports(Feature.PRECISION_SWITCH, strategy)
    if not answer.supported:
        if strategy_kind(strategy) is StrategyKind.OTHER:
            return f"{answer.reason}, not {name}"
        return f"{name} {answer.reason}"
    if not module.automatic_optimization:
        return "manual optimization steps the optimizer itself (use automatic optimization for the fallback)"
    return None


def plugin_for(precision: str, strategy: Strategy) -> Precision | None:
    """A fresh Lightning precision plugin for ``precision`` under ``strategy``; ``None`` when it cannot take one."""
    if isinstance(strategy, (XLAStrategy, SingleDeviceXLAStrategy)):
        return None
    if isinstance(strategy, FSDPStrategy):
        return FSDPPrecision(precision) if precision != "transformer-engine" else None
    if isinstance(strategy, DeepSpeedStrategy):
        return DeepSpeedPrecision(precision) if precision != "transformer-engine" else None
    if isinstance(strategy, ModelParallelStrategy) and precision == "16-mixed":
        return None  # Lightning's ModelParallelStrategy supports 32-true and bf16 only
    if precision == "32-true":
        return Precision()
    if precision in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(precision, strategy.root_device.type)
    if precision == "transformer-engine":
        return TransformerEnginePrecision(weights_dtype=torch.bfloat16)
    return None
