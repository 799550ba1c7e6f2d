"""Reading device memory, recognising out-of-memory errors, and predicting a training step's peak memory.

Callbacks never call ``torch.cuda.*`` memory functions directly: they read a :class:`MemoryProbe`
from :func:`get_probe`, so every algorithm runs in CI on CPU under
:class:`lightning_gpuopt.testing.SimulatedMemory` and on a GPU unchanged. Imports torch only.
"""

from lightning_gpuopt.memory import forensics
from lightning_gpuopt.memory.extrapolate import PeakLine, predict_peak_deep, predict_peak_line, scale_to_batch
from lightning_gpuopt.memory.oom import (
    MAYBE_SIZE_MESSAGES,
    OOM_MESSAGES,
    free_memory,
    is_maybe_size_error,
    is_oom_error,
)
from lightning_gpuopt.memory.predict import predict_peak
from lightning_gpuopt.memory.prediction_types import (
    MemoryCategory,
    ParallelLayout,
    PeakPrediction,
    PhasePeak,
    PredictionMethod,
)
from lightning_gpuopt.memory.probe import CpuMemoryProbe, CudaMemoryProbe, MemoryProbe, get_probe
from lightning_gpuopt.memory.units import format_bytes

__all__ = [
    "MAYBE_SIZE_MESSAGES",
    "OOM_MESSAGES",
    "CpuMemoryProbe",
    "CudaMemoryProbe",
    "MemoryCategory",
    "MemoryProbe",
    "ParallelLayout",
    "PeakLine",
    "PeakPrediction",
    "PhasePeak",
    "PredictionMethod",
    "forensics",
    "format_bytes",
    "free_memory",
    "get_probe",
    "is_maybe_size_error",
    "is_oom_error",
    "predict_peak",
    "predict_peak_deep",
    "predict_peak_line",
    "scale_to_batch",
]
