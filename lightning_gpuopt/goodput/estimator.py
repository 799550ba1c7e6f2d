"""The gradient noise scale from gradient norms at two batch sizes (McCandlish et al. 2018, appendix A.1).

For a gradient averaged over ``B`` samples, ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``. Two batch sizes give two
equations, hence unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from one measurement:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Each measurement is very noisy (either estimate can be negative), so the two are averaged separately with an
exponential moving average and only their ratio is taken: ``B_simple = tr(Sigma) / |G|^2``, in the units that
``B`` counts (samples, or tokens for a token loss).

No maintained library computes it for a Lightning run (k-diffusion's ``gns.py`` and nanoGNS are training-script
code, Pollux is unmaintained), and the math is ten lines: it lives here, without Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NoiseScaleEMA", "noise_scale_terms"]


def noise_scale_terms(small_sq: float, b_small: float, big_sq: float, b_big: float) -> tuple[float, float]:
    """Unbiased one-measurement estimates ``(|G|^2, tr(Sigma))`` from squared gradient norms at two batch sizes.

    Example:
        >>> g2, trace = noise_scale_terms(small_sq=5.0, b_small=32, big_sq=3.0, b_big=64)
        >>> g2, trace, trace / g2
        (1.0, 128.0, 128.0)
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"`b_small` must be in (0, b_big), got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


@dataclass
class NoiseScaleEMA:
    """Exponential moving averages of ``|G|^2`` and ``tr(Sigma)``, bias-corrected, and how far to trust their ratio.

    ``beta`` is the decay per measurement. Both averages start at 0 and are divided by ``1 - beta**count``
    (Adam's bias correction), so the first measurements are not pulled towards 0; the ratio does not depend on
    the correction, the reported ``|G|^2`` and ``tr(Sigma)`` do. ``relative_error`` is the standard error of the
    ratio relative to itself, from the same moving averages of the squares (weighted variances made unbiased by
    ``1 / (1 - concentration)``, delta method over the effective number of measurements the average holds):
    :attr:`NoiseScaleEMA.estimate` is ``None`` until it is at most ``trust`` and at least ``min_count``
    measurements were taken.

    The average holds at most ``(1 + beta) / (1 - beta)`` effective measurements (199 at 0.99), so the error
    levels off at the spread of one measurement over the square root of that: :attr:`needed` tells how many
    measurements the spread seen so far asks for.

    Example:
        >>> ema = NoiseScaleEMA(beta=0.5, min_count=2, trust=1.0)
        >>> for g2, trace in [(1.0, 100.0), (1.2, 110.0), (0.8, 90.0)]:
        ...     ema.update(g2, trace)
        >>> round(ema.estimate, 1)  # the ratio of the averages, not the average of the ratios
        103.0
    """

    beta: float = 0.99
    min_count: int = 20
    trust: float = 0.1
    g2: float = 0.0
    trace: float = 0.0
    g2_sq: float = 0.0
    trace_sq: float = 0.0
    cross: float = 0.0
    count: int = 0
    #: The sum of the weights' squares over the weights' sum squared: 1 / the effective number of measurements.
    concentration: float = 0.0

    def update(self, g2: float, trace: float) -> None:
        """Add one measurement (non-finite ones are the caller's to skip)."""
        b = self.beta
        self.g2 = b * self.g2 + (1 - b) * g2
        self.trace = b * self.trace + (1 - b) * trace
        self.g2_sq = b * self.g2_sq + (1 - b) * g2 * g2
        self.trace_sq = b * self.trace_sq + (1 - b) * trace * trace
        self.cross = b * self.cross + (1 - b) * g2 * trace
        self.count += 1
        # sum w_i^2 / (sum w_i)^2 for weights (1-b) b^(t-i): closed form, updated exactly.
        t = self.count
        self.concentration = (1 - b) * (1 + b**t) / ((1 + b) * (1 - b**t))

    @property
    def _correction(self) -> float:
        return 1 - self.beta**self.count

    @property
    def gradient_sq(self) -> float | None:
        """The bias-corrected average of ``|G|^2`` (``None`` before the first measurement)."""
        return self.g2 / self._correction if self.count else None

    @property
    def trace_sigma(self) -> float | None:
        """The bias-corrected average of ``tr(Sigma)`` (``None`` before the first measurement)."""
        return self.trace / self._correction if self.count else None

    @property
    def value(self) -> float | None:
        """``tr(Sigma) / |G|^2`` now, trusted or not (``None`` while ``|G|^2`` is not positive)."""
        if not self.count or self.g2 <= 0 or self.trace <= 0:
            return None
        return self.trace / self.g2

    def _moments(self) -> tuple[float, float, float, float, float]:
        """The averages of ``|G|^2`` and ``tr(Sigma)``, and their averages' variances and covariance (count >= 2)."""
        c = self._correction
        mg, mt = self.g2 / c, self.trace / c
        # A weighted variance misses the factor 1 - sum(w^2) (= 1 - concentration): unbiased, the
        # first few measurements do not look more certain than they are.
        spread = self.concentration / (1 - self.concentration)
        var_g = max(self.g2_sq / c - mg * mg, 0.0) * spread
        var_t = max(self.trace_sq / c - mt * mt, 0.0) * spread
        cov = (self.cross / c - mg * mt) * spread
        return mg, mt, var_g, var_t, cov

    @property
    def relative_error(self) -> float:
        """The ratio's standard error over the ratio (``inf`` until it can be told)."""
        if self.count < 2 or self.g2 <= 0 or self.trace <= 0:
            return math.inf
        mg, mt, var_g, var_t, cov = self._moments()
        rel2 = var_t / (mt * mt) + var_g / (mg * mg) - 2 * cov / (mg * mt)
        return math.sqrt(max(rel2, 0.0))

    def lower_bound(self, sigmas: float = 2.0) -> float | None:
        """A cautious ``B_simple``: ``tr(Sigma)``'s average less ``sigmas`` standard errors over ``|G|^2``'s plus
        ``sigmas`` standard errors.

        It exists while the ratio itself does not: when the average of ``|G|^2`` is still negative (a batch far
        below the noise scale), its upper end is positive and says the noise scale is at least that large.
        ``None`` before two measurements, or while either end says nothing (``tr(Sigma)``'s lower end at or
        below 0, or ``|G|^2``'s upper end at or below 0).

        Example:
            >>> ema = NoiseScaleEMA(beta=0.9)
            >>> for g2, trace in [(0.5, 100.0), (-1.0, 110.0), (0.3, 90.0)]:
            ...     ema.update(g2, trace)
            >>> ema.value, round(ema.lower_bound())  # |G|^2 averages below 0: no ratio, yet at least ~100
            (None, 101)
        """
        if self.count < 2:
            return None
        mg, mt, var_g, var_t, _ = self._moments()
        low, high = mt - sigmas * math.sqrt(var_t), mg + sigmas * math.sqrt(var_g)
        if low <= 0 or high <= 0:
            return None
        return low / high

    @property
    def memory(self) -> float:
        """The most effective measurements the moving average can hold: ``(1 + beta) / (1 - beta)``."""
        return (1 + self.beta) / (1 - self.beta)

    @property
    def needed_effective(self) -> float | None:
        """Effective measurements the spread seen so far needs for a relative error of ``trust`` (``None`` until
        the error is known). At or above :attr:`memory`, no run length reaches it at this ``beta``."""
        error = self.relative_error
        if not math.isfinite(error):
            return None
        # error^2 = (one measurement's relative variance) x concentration, and concentration = 1 / effective count.
        return (error / self.trust) ** 2 / self.concentration

    @property
    def needed(self) -> float | None:
        """Measurements in all after which the relative error reaches ``trust`` at the spread seen so far (``inf``:
        never at this ``beta``; ``None`` until the error is known).

        Example:
            >>> ema = NoiseScaleEMA(beta=0.99, trust=0.1)
            >>> for g2, trace in [(1.0, 100.0), (0.0, 110.0), (2.0, 90.0), (1.0, 100.0)]:
            ...     ema.update(g2, trace)
            >>> round(ema.relative_error, 2), round(ema.needed)
            (0.45, 85)
        """
        n = self.needed_effective
        if n is None:
            return None
        memory = self.memory
        if n >= memory:
            return math.inf
        # The effective count after t measurements is memory * (1 - beta^t) / (1 + beta^t): solved for t.
        return max(math.log((memory - n) / (memory + n)) / math.log(self.beta), 1.0)

    @property
    def trusted(self) -> bool:
        """Enough measurements, and a standard error within ``trust``."""
        return self.count >= self.min_count and self.relative_error <= self.trust

    @property
    def estimate(self) -> float | None:
        """``B_simple`` once :attr:`trusted`, else ``None``."""
        return self.value if self.trusted else None

    def state_dict(self) -> dict[str, float | int]:
        return {
            name: getattr(self, name)
            for name in ("g2", "trace", "g2_sq", "trace_sq", "cross", "count", "concentration")
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        for name in ("g2", "trace", "g2_sq", "trace_sq", "cross", "concentration"):
            setattr(self, name, float(state.get(name, 0.0)))
        self.count = int(state.get("count", 0))
