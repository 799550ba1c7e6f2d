"""Tracing the user's training step on fake tensors: the start of the search from a prediction.

:func:`start_search` traces the step (:func:`~lightning_gpuopt.memory.predict_peak`) at the sizes
:func:`~lightning_gpuopt.batch_size.predicted.plan_traces` picks and returns the
:class:`~lightning_gpuopt.batch_size.predicted.PredictedSearch` that verifies the prediction in real
steps, or the measured search with the reason why the step could not be traced. The trace runs inside
:class:`~lightning_gpuopt.batch_size.trial.TrialSteps` (``self.log`` is silent, attributes the step
touches are put back) on fake tensors: none of the step is allocated, the parameters are swapped for
fake ones and back (on the CPU each distinct operator call runs once on zeros to measure its kernel's
scratch, kept for the process). The batch is the trial's own, resized in its
sample dimension on the ``meta`` device, so any size is traced without making its samples. A
:class:`Tracer` keeps its traces for the process, by the step's structure: a later search of the same
step (another fit, a re-search) reuses them instead of tracing again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning_utilities import apply_to_collection

from lightning_gpuopt.batch_size.predicted import PredictedSearch, TracedStep, TransientCurve, plan_traces
from lightning_gpuopt.batch_size.search import SizeSearch, TrialBatch
from lightning_gpuopt.memory import MemoryCategory, PredictionMethod, predict_peak, predict_peak_deep
from lightning_gpuopt.memory.counter import TraceTimeout, time_limit
from lightning_gpuopt.memory.predict import Phase

__all__ = ["CannotPredict", "Tracer", "forget_traces", "make_tracer", "start_search"]

_GROWING = (Phase.FORWARD.value, Phase.BACKWARD.value)
#: What forward and backward allocate and free again: the rest of a phase's peak is held (parameters, inputs, ...).
_ALLOCATED_IN_STEP = (
    MemoryCategory.ACTIVATIONS.value,
    MemoryCategory.TEMPORARIES.value,
    MemoryCategory.SCRATCH.value,
)
_MODEL = (MemoryCategory.PARAMETERS, MemoryCategory.BUFFERS)


class CannotPredict(Exception):
    """Why the step could not be traced; the search runs without a prediction and says so."""


def _resized(batch: Any, samples: int, n: int) -> Any:
    """``batch`` with ``n`` samples: tensors whose first dimension holds ``samples`` resized, on ``meta``."""

    def resize(x: torch.Tensor) -> torch.Tensor:
        shape = tuple(x.shape)
        if shape and shape[0] == samples:
            shape = (n, *shape[1:])
        return torch.empty(shape, dtype=x.dtype, device="meta")

    return apply_to_collection(batch, torch.Tensor, resize)


def traced_step(prediction: Any, whole: bool = False) -> TracedStep:
    """A :class:`TracedStep` from a :class:`~lightning_gpuopt.memory.PeakPrediction`.

    ``whole``: the step starts without gradients (a whole batch: the micro-batch engine zeroes them before
    the forward), so forward and backward are those of the traced first step, where no gradients are alive
    before the backward allocates them; what they add is their peak above the memory held after the step,
    all gradients included (what a trial step measures). Not the activations alone: the backward frees
    activations as it allocates gradients, so that at a small batch the peak is where the gradients are
    complete, and the activations of the forward show only where they outgrow the gradients. Else the
    step starts with the gradients alive (a micro-batch after the first, the steady state of the trace):
    the most activations and temporaries alive at once.

    With ``whole`` the optimizer step's bytes are also counted as a trial measures them, above the memory
    held after the step (the state it creates included), and the parameters and buffers are reported:
    the plan aims from them where the probe does not count them yet.
    """
    optimizer = [ph.transient_bytes for ph in prediction.phases if ph.phase == Phase.OPTIMIZER.value]
    state = max((ph.categories.get("optimizer state", 0) for ph in prediction.phases), default=0)
    model = 0
    if whole:
        optimizer = [max(0, b - state) for b in optimizer]  # the first step's transient holds the new state
        model = max(
            (sum(ph.categories.get(c.value, 0) for c in _MODEL) for ph in prediction.phases), default=0
        )
        grads = MemoryCategory.GRADIENTS.value
        held_grads = max((ph.categories.get(grads, 0) for ph in prediction.phases), default=0)
        growing = [
            max(0, sum(ph.categories.get(c, 0) for c in (*_ALLOCATED_IN_STEP, grads)) - held_grads)
            for ph in prediction.phases
            if ph.phase in _GROWING and ph.step == 1
        ]
    else:
        growing = [ph.transient_bytes for ph in prediction.phases if ph.phase in _GROWING]
    return TracedStep(
        size=prediction.batch_size,
        forward_backward_bytes=max(growing, default=0),
        optimizer_bytes=max(optimizer, default=0),
        state_bytes=state,
        peak_bytes=prediction.peak_bytes,
        model_bytes=model,
    )


#: Searches whose traces are kept for the next search of the same step (the oldest is dropped first).
_KEPT = 8
#: Traced steps of earlier searches, by the step's structure (:func:`_structure`): ``{size: TracedStep}``.
_TRACES: OrderedDict[tuple, dict[int, TracedStep]] = OrderedDict()
#: Seconds one trace of the step took, whether it finished (else it was stopped after that long), at what size.
_TRACE_SECONDS: dict[tuple, tuple[float, bool, int]] = {}
#: Optimizer settings that change no memory (a schedule moves them between searches).
_UNSIZED = frozenset({"params", "lr", "initial_lr"})


def forget_traces() -> None:
    """Drop every trace and trace time kept for the process: the next search starts as in a fresh process."""
    _TRACES.clear()
    _TRACE_SECONDS.clear()


def _structure(module: pl.LightningModule, optimizer: Any, batch: Any, samples: int, *rest: Any) -> tuple:
    """What a traced step's memory depends on: the module's class, its tensors' shapes and dtypes, the
    optimizer's type and settings, the batch's shapes (the sample dimension left out), and ``rest``."""
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in module.named_parameters())
    buffers = tuple((name, tuple(t.shape), t.dtype) for name, t in module.named_buffers())
    groups = tuple(
        tuple(sorted((k, repr(v)) for k, v in group.items() if k not in _UNSIZED))
        for group in optimizer.param_groups
    )

    def shape(x: torch.Tensor) -> tuple:
        return tuple(-1 if i == 0 and d == samples else d for i, d in enumerate(x.shape)), x.dtype

    layout = hash(repr(apply_to_collection(batch, torch.Tensor, shape)))
    return (
        type(module).__module__,
        type(module).__qualname__,
        tensors,
        buffers,
        type(optimizer),
        groups,
        layout,
        *rest,
    )


class Tracer:
    """``tracer(n)``: the training step traced at ``n`` samples, a :class:`TracedStep`; or :class:`CannotPredict`.

    Traces are kept for the process, by the step's structure (:func:`_structure`): a size traced once, in
    this search or an earlier one, is not traced again (:attr:`traced` counts the traces run, :attr:`reused`
    the ones served from before). Kernel scratch is measured as :func:`~lightning_gpuopt.memory.predict_peak`
    does by default: the real steps calibrate a constant and a slope, not scratch that grows faster than
    the batch (an attention over the batch's n x n scores: its answer fell from 54 to 48 samples without it).
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        batch: Any,
        samples: int,
        batch_idx: int,
        whole: bool,
    ) -> None:
        # The template on `meta`: a tracer that a search keeps holds none of the device's memory.
        batch = _resized(batch, samples, samples)
        self.module, self.batch, self.samples, self.whole = module, batch, samples, whole
        self.optimizer = trainer.optimizers[0]
        self.precision = str(trainer.precision)  # Lightning's precision string: "32-true", "bf16-mixed", ...
        self.device = trainer.strategy.root_device.type
        with_idx = is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2)
        self.step = lambda m, b: m.training_step(b, batch_idx) if with_idx else m.training_step(b)
        key = _structure(
            module, self.optimizer, batch, samples, self.precision, self.device, whole, batch_idx
        )
        self.key = key
        self.traces = _TRACES.pop(key, {})
        _TRACES[key] = self.traces  # the newest last
        while len(_TRACES) > _KEPT:
            _TRACE_SECONDS.pop(_TRACES.popitem(last=False)[0], None)
        self.traced = self.reused = 0

    @property
    def seconds(self) -> tuple[float, bool, int] | None:
        """How long one trace of this step took in an earlier search, whether it finished, at what size."""
        return _TRACE_SECONDS.get(self.key)

    def __call__(self, n: int) -> TracedStep:
        if n in self.traces:
            self.reused += 1
            return self.traces[n]
        started = time.perf_counter()
        self.traces[n] = traced = self._trace(n)
        # Any finished trace times the step's trace for the next search's choice (predict=None).
        _TRACE_SECONDS[self.key] = (time.perf_counter() - started, True, n)
        return traced

    def _trace(self, n: int) -> TracedStep:
        args = (self.module, _resized(self.batch, self.samples, n), self.optimizer)
        kwargs = dict(step=self.step, precision=self.precision, device=self.device, fallback=False)
        self.traced += 1
        try:
            try:  # a deep model's repeated blocks: one and two of them traced, extrapolated (seconds, not minutes)
                prediction = predict_peak_deep(*args, **kwargs)
            except TraceTimeout:
                raise
            except Exception:  # e.g. a forward that indexes its blocks by position: the whole model
                prediction = predict_peak(*args, **kwargs)
        except TraceTimeout:
            raise
        except Exception as err:  # a prediction is a head start, never a reason to fail: said, not raised
            reason = (str(err).strip().splitlines() or [""])[0][:200]
            raise CannotPredict(
                f"the training step cannot be predicted ({type(err).__name__}: {reason})"
            ) from None
        if prediction.method is not PredictionMethod.TRACED:
            raise CannotPredict(f"the training step cannot be predicted ({prediction.decision})")
        return traced_step(prediction, self.whole)

    def timed(self, n: int, limit_s: float) -> tuple[float, bool, int] | None:
        """Seconds a trace at ``n`` samples takes, stopped once past ``limit_s``, and whether it finished
        (``None``: the step cannot be traced). Traced even where ``n`` is kept (a kept trace has no time);
        the time, and a finished trace, are kept for the next search of this step."""
        started = time.perf_counter()
        try:
            with time_limit(limit_s):
                traced = self._trace(n)
            self.traces.setdefault(n, traced)
            finished = True
        except TraceTimeout:
            finished = False
        except CannotPredict:
            return None
        _TRACE_SECONDS[self.key] = timing = (time.perf_counter() - started, finished, n)
        return timing


def make_tracer(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    make_batch: Callable[[int], TrialBatch],
    batch_idx: int,
    size: int,
) -> Tracer:
    """The :class:`Tracer` of the mode's trial step, its template one of ``make_batch``'s batches of ``size``."""
    template, samples, _, whole = make_batch(size)
    return Tracer(trainer, module, template, samples, batch_idx, whole)


def start_search(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    make_batch: Callable[[int], TrialBatch],
    batch_idx: int,
    pending_bytes: int,
    tracer: Callable[[int], TracedStep] | None = None,
    **search: Any,
) -> tuple[SizeSearch, str]:
    """The search to run and how it starts: from traced steps (:class:`PredictedSearch`), else plain, with the reason.

    Args:
        trainer: the Trainer (its optimizer, precision and device are traced).
        module: the LightningModule (its ``training_step`` is traced).
        make_batch: ``make_batch(size)``, the mode's trial batches; one small batch is made as the template
            of the traced ones.
        batch_idx: passed to ``training_step``.
        pending_bytes: what the first real step adds to the held memory besides the optimizer state
            (gradients it allocates, the engine's copies): where the traces aim.
        tracer: the :class:`Tracer` (or a stand-in with its call) to use; ``None``: a new one.
        **search: :class:`SizeSearch`'s arguments.
    """
    if not trainer.optimizers:
        return SizeSearch(**search), "measured only: no optimizer yet, so the step cannot be predicted"
    # Whole batches (mode='max') start without gradients, micro-batches with them: traced as they run.
    small = min(search["largest"], max(search["smallest"], 2))
    trace = tracer or make_tracer(trainer, module, make_batch, batch_idx, small)
    held = search.get("held_bytes_per_sample", 0.0)

    def peak(
        curve: TransientCurve, n: int
    ) -> float:  # the state counted in full: the trace aims a little low
        # The parameters as traced where the probe does not count them yet (a module not yet run).
        base = max(search["base_bytes"], curve.model_bytes) + pending_bytes
        return base + curve.state_bytes + held * n + max(curve(n), curve.optimizer_bytes)

    try:
        curve = plan_traces(trace, peak, search["budget_bytes"], search["smallest"], search["largest"])
    except CannotPredict as err:
        return SizeSearch(**search), f"measured only: {err}"
    return PredictedSearch(**search, curve=curve, tracer=trace), ""
