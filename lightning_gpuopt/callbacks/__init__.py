"""The pack's Lightning callbacks."""

from lightning_gpuopt.callbacks.data_stall import DataStallMonitor
from lightning_gpuopt.callbacks.oom_recovery import MicroBatchOOMError, OOMRecovery, TokenCount
from lightning_gpuopt.callbacks.precision_switch import PrecisionSwitch

__all__ = ["DataStallMonitor", "MicroBatchOOMError", "OOMRecovery", "PrecisionSwitch", "TokenCount"]
