"""Peak FLOP/s of CUDA devices, per compute dtype, for the model FLOPs utilisation (MFU).

The pack owns this table instead of using Lightning's ``get_available_flops``, which (Lightning 2.6)
misses ``"NVIDIA H200"`` (the name torch reports on an H200 SXM), gives the H200's figures *with*
sparsity, and maps ``"NVIDIA L40S"`` to the L4's figures.

Every figure is the **dense** peak (without 2:4 structured sparsity) from NVIDIA's datasheet for the
board, in FLOP/s, keyed on the exact name ``torch.cuda.get_device_name()`` returns. Where a datasheet
only gives the sparse figure (marked ``*`` there), the dense one is half of it. Choices:

- ``bf16`` / ``fp16`` are the tensor-core peaks with float32 accumulation, which is what PyTorch's
  matmuls use under autocast. Data-centre boards run it at the full fp16 rate; GeForce boards at
  half the rate (the RTX 4090: 165.2 TFLOP/s with fp32 accumulation, 330.3 with fp16 accumulation,
  per NVIDIA's Ada Lovelace whitepaper; the table holds 165.2).
- ``tf32`` is the tensor-core TF32 peak; ``fp32`` the CUDA-core (non-tensor) peak.
- ``fp8`` is the tensor-core FP8 peak (``None`` on boards without FP8: the A100).
- SXM and PCIe/NVL boards differ (clocks and power): the H100 SXM (``"NVIDIA H100 80GB HBM3"``)
  and the H200 SXM (``"NVIDIA H200"``) share 989.4 TFLOP/s bf16; the H100 NVL and the H200 NVL
  share 835.5; the H100 PCIe has 756.5 (NVIDIA rounds: 1513 sparse).

Example:
    >>> peak = peak_flops_of("NVIDIA H200")
    >>> peak.bf16, peak.form_factor
    (989400000000000.0, 'SXM')
    >>> device_peak_flops("NVIDIA H200", "bf16-mixed")
    989400000000000.0
    >>> print(peak_flops_of("Some New GPU"))
    None
    >>> mfu_unknown_message("Some New GPU")
    'MFU unknown for Some New GPU (pass peak_flops=)'
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "PEAK_FLOPS",
    "ComputeDtype",
    "PeakFlops",
    "compute_dtype_of",
    "device_peak_flops",
    "mfu_unknown_message",
    "peak_flops_of",
    "resolve_peak_flops",
    "tf32_matmuls_enabled",
]

T = 1e12


class ComputeDtype(str, enum.Enum):
    """The dtype a training step's matmuls run in, which picks the peak."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s of one board, per compute dtype (``None``: the board has no such unit)."""

    fp32: float
    tf32: float
    bf16: float
    fp16: float
    fp8: float | None
    form_factor: str
    source: str

    def of(self, dtype: ComputeDtype | str) -> float | None:
        """The peak for ``dtype`` (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``)."""
        return getattr(self, ComputeDtype(dtype).value)


_H100_SXM = "NVIDIA H100 Tensor Core GPU datasheet (SXM5 column; dense = half the sparse figure)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (dense = half the sparse figure)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (same tensor-core peaks for SXM4 and PCIe)"
_ADA = "NVIDIA Ada Lovelace GPU architecture whitepaper (GeForce RTX 4090: fp16/bf16 with fp32 accumulate)"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet (dense = half the sparse figure)"
_L40S = "NVIDIA L40S datasheet (dense = half the sparse figure)"
_B200 = "NVIDIA HGX B200 datasheet, per GPU (dense = half the sparse figure)"

_h100_sxm = PeakFlops(67.0 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T, "SXM", _H100_SXM)
_h200_sxm = PeakFlops(67.0 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T, "SXM", _H200)
_nvl = "NVL (PCIe board)"
_h100_nvl = PeakFlops(
    60.0 * T, 417.5 * T, 835.5 * T, 835.5 * T, 1670.5 * T, _nvl, _H100_SXM.replace("SXM5", "NVL")
)
_h200_nvl = PeakFlops(60.0 * T, 417.5 * T, 835.5 * T, 835.5 * T, 1670.5 * T, _nvl, _H200 + ", NVL column")
_h100_pcie = PeakFlops(
    51.0 * T, 378.0 * T, 756.5 * T, 756.5 * T, 1513.0 * T, "PCIe", _H100_SXM.replace("SXM5", "PCIe")
)
_a100 = PeakFlops(19.5 * T, 156.0 * T, 312.0 * T, 312.0 * T, None, "SXM4", _A100)
_a100_pcie = PeakFlops(19.5 * T, 156.0 * T, 312.0 * T, 312.0 * T, None, "PCIe", _A100)
_l4 = PeakFlops(30.3 * T, 60.0 * T, 121.0 * T, 121.0 * T, 242.5 * T, "PCIe", _L4)
_l40s = PeakFlops(91.6 * T, 183.0 * T, 366.5 * T, 366.5 * T, 733.0 * T, "PCIe", _L40S)
_rtx4090 = PeakFlops(82.6 * T, 82.6 * T, 165.2 * T, 165.2 * T, 330.3 * T, "PCIe (GeForce)", _ADA)
_b200 = PeakFlops(75.0 * T, 1100.0 * T, 2250.0 * T, 2250.0 * T, 4500.0 * T, "SXM", _B200)

#: Dense peaks keyed on the exact name CUDA reports (``torch.cuda.get_device_name``).
PEAK_FLOPS: dict[str, PeakFlops] = {
    "NVIDIA H200": _h200_sxm,
    "NVIDIA H200 NVL": _h200_nvl,
    "NVIDIA H100 80GB HBM3": _h100_sxm,
    "NVIDIA H100 NVL": _h100_nvl,
    "NVIDIA H100 PCIe": _h100_pcie,
    "NVIDIA A100-SXM4-80GB": _a100,
    "NVIDIA A100-SXM4-40GB": _a100,
    "NVIDIA A100 80GB PCIe": _a100_pcie,
    "NVIDIA A100-PCIE-40GB": _a100_pcie,
    "NVIDIA L4": _l4,
    "NVIDIA L40S": _l40s,
    "NVIDIA GeForce RTX 4090": _rtx4090,
    "NVIDIA B200": _b200,
}


def peak_flops_of(device_name: str) -> PeakFlops | None:
    """The dense peaks of the board CUDA calls ``device_name``; ``None`` for a board the table does not hold."""
    return PEAK_FLOPS.get(device_name.strip())


def tf32_matmuls_enabled() -> bool:
    """Whether float32 matmuls may run in TF32: torch's ``fp32_precision`` API where it exists (torch >= 2.9).

    Older torch has only the legacy ``torch.backends.cuda.matmul.allow_tf32`` flag, read as a fallback.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if isinstance(precision, str):
        return precision.lower() == "tf32"
    return bool(matmul.allow_tf32)


def compute_dtype_of(precision: str, tf32: bool | None = None) -> ComputeDtype | None:
    """The compute dtype of a Lightning precision string (``None`` for 64-bit, which has no tensor-core peak).

    ``tf32``: whether float32 matmuls run in TF32 (default: :func:`tf32_matmuls_enabled`).

    Example:
        >>> [compute_dtype_of(p, tf32=False).value for p in ("bf16-mixed", "16-mixed", "32-true", "transformer-engine")]
        ['bf16', 'fp16', 'fp32', 'fp8']
        >>> compute_dtype_of("32-true", tf32=True).value, compute_dtype_of("64-true")
        ('tf32', None)
    """
    text = str(precision)
    if text.startswith("bf16"):
        return ComputeDtype.BF16
    if text.startswith("16"):
        return ComputeDtype.FP16
    if text.startswith("64"):
        return None
    if text.startswith("transformer-engine"):
        return ComputeDtype.FP8
    if tf32 is None:
        tf32 = tf32_matmuls_enabled()
    return ComputeDtype.TF32 if tf32 else ComputeDtype.FP32


def device_peak_flops(device_name: str, precision: str, tf32: bool | None = None) -> float | None:
    """The dense peak FLOP/s of ``device_name`` for the compute dtype of ``precision``; ``None`` when unknown."""
    peak, dtype = peak_flops_of(device_name), compute_dtype_of(precision, tf32)
    if peak is None or dtype is None:
        return None
    return peak.of(dtype)


def resolve_peak_flops(
    device: torch.device, precision: str, override: float | None = None
) -> tuple[float | None, str | None]:
    """The peak FLOP/s an MFU divides by on ``device`` under ``precision``, and why there is none.

    Returns ``(peak, None)``: ``override`` when given (any device), else the table's dense peak of a CUDA
    device; ``(None, message)`` for a CUDA device the table does not hold (or 64-bit precision), with
    the message the report shows; ``(None, None)`` on other devices (no MFU there unless ``override``).
    """
    if override is not None:
        return float(override), None
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    peak = device_peak_flops(name, precision)
    if peak is None:
        return None, mfu_unknown_message(name if peak_flops_of(name) is None else f"{name} in {precision}")
    return peak, None


def mfu_unknown_message(device_name: str) -> str:
    """What the report says instead of an MFU for a device without a known peak."""
    return f"MFU unknown for {device_name} (pass peak_flops=)"
