"""GPU check section ``goodput``: the noise scale of the GPT-2-shaped model and what measuring it costs.

The cost is GradientNoiseScale beside OOMRecovery at k = 1 against OOMRecovery alone, in its steady state (a
measured step every ``every`` steps: the split into 2 micro-batches and two gradient norms), from interleaved
pairs of fits. A fit's figure is the *mean* of its steady steps (a median would hide the measured ones).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from common import figure, spread

from gpu import device
from gpu.speed import StepEvents, gpt_fit, interleaved_pairs
from lightning_gpuopt import GradientNoiseScale, OOMRecovery


def steady_noise_scale(every: int = 10) -> GradientNoiseScale:
    """A GradientNoiseScale already at its steady cadence (every ``every``-th step), as after its estimate is trusted."""
    return GradientNoiseScale(every=every, min_measurements=1, trust=math.inf)


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    steps, warmup, every, precision = sizes["steps"], sizes["warmup"], sizes["every"], sizes["precision"]
    noise = GradientNoiseScale()
    gpt_fit(sizes, sizes["estimate_steps"], [OOMRecovery(verbose=False), noise], precision=precision)
    value = noise.ema.value

    def timed_fit(name: str) -> float:
        events = StepEvents()
        extra = [steady_noise_scale(every)] if name == "noise scale" else []
        gpt_fit(sizes, steps, [OOMRecovery(verbose=False), *extra, events], precision=precision)
        return statistics.fmean(events.periods(warmup))

    per_fit = interleaved_pairs(
        ("OOMRecovery", "noise scale"), timed_fit, sizes["repeats"], sizes["min_repeats"]
    )
    percent = spread([100 * (a / b - 1) for a, b in zip(per_fit["noise scale"], per_fit["OOMRecovery"])])
    on_cuda = device.current().kind == "cuda"
    name = (
        f"GradientNoiseScale overhead vs OOMRecovery k=1 (every {every}th step measured; median of {percent['n']} "
        f"interleaved pairs, each the mean of {steps - warmup} steps; IQR {percent['q1']:+.1f}..{percent['q3']:+.1f} %, "
        f"min..max {percent['min']:+.1f}..{percent['max']:+.1f} %)"
    )
    b_simple = (
        f"B_simple of the GPT-2-shaped model after {sizes['estimate_steps']} steps (samples; relative error "
        f"{noise.relative_error:.2f})"
    )
    target, met = f"<= {sizes['target_percent']} %", percent["median"] <= sizes["target_percent"]
    figures = [figure(b_simple, None if value is None else round(value, 1))]
    figures.append(figure(name, percent["median"], "%", target, met if on_cuda else None))
    details = {"noise_scale": value, "measurements": noise.ema.count}
    details.update(seconds_per_step={k: spread(v) for k, v in per_fit.items()}, overhead_percent=percent)
    return {"figures": figures, "details": details}
