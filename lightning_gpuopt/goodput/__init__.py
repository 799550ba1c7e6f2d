"""Goodput: the gradient noise scale (is a larger batch worth it?) and the batch schedule built on it.

Pure functions and plain state, no Lightning: ``estimator.py`` (McCandlish et al.'s unbiased estimators and their
moving averages), ``schedule.py`` (the optimizer batch the noise scale asks for, the learning-rate scale). The
callbacks over them are :class:`~lightning_gpuopt.GradientNoiseScale` and :class:`~lightning_gpuopt.AdaptiveBatchSize`.
"""

from lightning_gpuopt.goodput.estimator import NoiseScaleEMA, noise_scale_terms
from lightning_gpuopt.goodput.schedule import held_because, lr_factor, next_accumulation

__all__ = ["NoiseScaleEMA", "held_because", "lr_factor", "next_accumulation", "noise_scale_terms"]
