"""The pack's Lightning callbacks."""

from lightning_gpuopt.callbacks.adaptive_batch_size import AdaptiveBatchSize
from lightning_gpuopt.callbacks.batch_size import MemoryAwareBatchSize
from lightning_gpuopt.callbacks.data_stall import DataStallMonitor
from lightning_gpuopt.callbacks.exact_resume import ExactResume
from lightning_gpuopt.callbacks.gradient_noise_scale import GradientNoiseScale
from lightning_gpuopt.callbacks.oom_recovery import MicroBatchOOMError, OOMRecovery, TokenCount
from lightning_gpuopt.callbacks.precision_switch import PrecisionSwitch
from lightning_gpuopt.callbacks.report import GPUOptReport

__all__ = [
    "AdaptiveBatchSize",
    "DataStallMonitor",
    "ExactResume",
    "GPUOptReport",
    "GradientNoiseScale",
    "MemoryAwareBatchSize",
    "MicroBatchOOMError",
    "OOMRecovery",
    "PrecisionSwitch",
    "TokenCount",
]
