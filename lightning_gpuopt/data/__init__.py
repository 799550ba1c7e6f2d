"""Data loading: the DataModule base, its loader tuning, device prefetch, stall rules, memory-mapped data and
sharded streams."""

from lightning_gpuopt.data.cpus import auto_num_workers, available_cpus
from lightning_gpuopt.data.datamodule import GPUOptDataModule
from lightning_gpuopt.data.memmap import MemmapDataset
from lightning_gpuopt.data.prefetch import (
    BatchTransfer,
    CudaStreamTransfer,
    DevicePrefetcher,
    DevicePrefetchLoader,
    InFlight,
    PrefetchStats,
    batch_nbytes,
)
from lightning_gpuopt.data.resume import ResumableSampler, SeededSamples
from lightning_gpuopt.data.stall import (
    Advice,
    AutotuneStep,
    LoaderSettings,
    StallMeasurement,
    autotune_num_workers,
    data_wait_fraction,
    is_data_stalled,
    max_useful_workers,
    stall_advice,
    stall_message,
)
from lightning_gpuopt.data.stream import ShardedStream
from lightning_gpuopt.data.token_batches import TokenBatchSampler

__all__ = [
    "Advice",
    "AutotuneStep",
    "BatchTransfer",
    "CudaStreamTransfer",
    "DevicePrefetchLoader",
    "DevicePrefetcher",
    "GPUOptDataModule",
    "InFlight",
    "LoaderSettings",
    "MemmapDataset",
    "PrefetchStats",
    "ResumableSampler",
    "SeededSamples",
    "ShardedStream",
    "StallMeasurement",
    "TokenBatchSampler",
    "auto_num_workers",
    "autotune_num_workers",
    "available_cpus",
    "batch_nbytes",
    "data_wait_fraction",
    "is_data_stalled",
    "max_useful_workers",
    "stall_advice",
    "stall_message",
]
