"""The pack's Lightning callbacks."""

from lightning_gpuopt.callbacks.oom_recovery import MicroBatchOOMError, OOMRecovery, TokenCount

__all__ = ["MicroBatchOOMError", "OOMRecovery", "TokenCount"]
