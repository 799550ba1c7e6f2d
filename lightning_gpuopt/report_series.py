"""What the report's readers share, below both ``report.py`` (the JSON record and the table) and ``report_plot.py``
(the pictures): the run picture's size, samples/s over a window of steps, a precision as a number.

``report.py`` re-exports every name here; ``report_plot.py`` imports them from here, so that neither of the two
imports the other in a circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PNG_DPI", "PNG_SIZE", "THROUGHPUT_WINDOW", "precision_code", "windowed_samples_per_s"]

#: Picture size in inches at PNG_DPI dots per inch: 1200 x 800 pixels.
PNG_SIZE = (12.0, 8.0)
PNG_DPI = 100
#: Steps in the moving window of the throughput curve.
THROUGHPUT_WINDOW = 10


def windowed_samples_per_s(
    steps: Sequence[dict[str, Any]], window: int = THROUGHPUT_WINDOW
) -> list[float | None]:
    """Samples/s over the last ``window`` steps at each step (``None`` where no time was measured yet).

    A window smooths the per-step wall time, which on a GPU is the host's, not the device's: the host
    may queue a few steps ahead and then wait.

    Example:
        >>> windowed_samples_per_s([{"samples": 10, "step_time_s": None}, {"samples": 10, "step_time_s": 0.5},
        ...                         {"samples": 10, "step_time_s": 1.5}], window=2)
        [None, 20.0, 10.0]
    """
    out: list[float | None] = []
    for i in range(len(steps)):
        recent = [s for s in steps[max(0, i - window + 1) : i + 1] if s.get("step_time_s")]
        seconds = sum(s["step_time_s"] for s in recent)
        out.append(sum(s["samples"] for s in recent) / seconds if seconds > 0 else None)
    return out


#: Significand bits of each precision's compute dtype: ``gpuopt/precision`` in the loggers.
_SIGNIFICAND_BITS = (("64", 53), ("32", 24), ("bf16", 8), ("16", 11), ("transformer-engine", 4))


def precision_code(precision: str) -> float | None:
    """A Lightning precision as a number for the loggers: the significand bits of its compute dtype (53
    float64, 24 float32, 11 float16, 8 bfloat16, 4 FP8); ``None`` for one it does not know.

    Example:
        >>> [precision_code(p) for p in ("32-true", "bf16-mixed", "16-mixed", "64-true", "mystery")]
        [24.0, 8.0, 11.0, 53.0, None]
    """
    for prefix, bits in _SIGNIFICAND_BITS:
        if str(precision).startswith(prefix):
            return float(bits)
    return None
