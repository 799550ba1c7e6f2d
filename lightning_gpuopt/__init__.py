"""lightning_gpuopt: train an unchanged LightningModule as fast as the GPU allows, without dying of OOM.

The public names of the design's API table are re-exported here; see docs/index.md.
"""

__version__ = "0.1.0.dev0"

from typing import Any

from lightning_gpuopt._warnings import GPUOptWarning
from lightning_gpuopt.callbacks import (
    AdaptiveBatchSize,
    DataStallMonitor,
    ExactResume,
    GPUOptReport,
    GradientNoiseScale,
    MemoryAwareBatchSize,
    MicroBatchOOMError,
    OOMRecovery,
    PrecisionSwitch,
    TokenCount,
)
from lightning_gpuopt.data import GPUOptDataModule, MemmapDataset
from lightning_gpuopt.microbatch import LossWeightingError, OptimizerStepOOMError, Rung
from lightning_gpuopt.strategy import FSDP2Strategy, StrategyPlan, StrategyPlanError, select_strategy

__all__ = [
    "AdaptiveBatchSize",
    "DataStallMonitor",
    "ExactResume",
    "FSDP2Strategy",
    "GPUOptCLI",
    "GPUOptDataModule",
    "GPUOptReport",
    "GPUOptWarning",
    "GradientNoiseScale",
    "LossWeightingError",
    "MemmapDataset",
    "MemoryAwareBatchSize",
    "MicroBatchOOMError",
    "OOMRecovery",
    "OptimizerStepOOMError",
    "PrecisionSwitch",
    "Rung",
    "StrategyPlan",
    "StrategyPlanError",
    "TokenCount",
    "__version__",
    "select_strategy",
]


def __getattr__(name: str) -> Any:
    """``GPUOptCLI`` loads on first use: the command line's parser (jsonargparse) is not needed by the Python API."""
    if name == "GPUOptCLI":
        from lightning_gpuopt.cli import GPUOptCLI

        return GPUOptCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
