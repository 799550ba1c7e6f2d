"""The pack's Lightning callbacks."""

from lightning_gpuopt.callbacks.batch_size import MemoryAwareBatchSize
from lightning_gpuopt.callbacks.data_stall import DataStallMonitor
from lightning_gpuopt.callbacks.oom_recovery import MicroBatchOOMError, OOMRecovery, TokenCount

__all__ = ["DataStallMonitor", "MemoryAwareBatchSize", "MicroBatchOOMError", "OOMRecovery", "TokenCount"]
