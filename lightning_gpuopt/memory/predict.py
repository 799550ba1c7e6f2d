"""Predict a training step's peak device memory without allocating it: :func:`predict_peak`.

The user's own training step runs twice (the first creates the optimizer state, the second is the steady
state) on *fake tensors*: nothing of the step is allocated. A ``TorchDispatchMode`` above the fake mode
counts every new storage until it dies, by category and by the module that made it, and keeps the
breakdown at the highest total. The precision is applied as Lightning applies it; DDP, FSDP2 and CPU
offload are emulated per device (:class:`ParallelLayout`).

torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` does the same counting (it works
under ``FakeTensorMode``); it is not used here because it counts each storage at its own size (the
emulation of sharding and offload needs to count a storage at a shard's size, or on the host), it
refuses a second iteration of the root module (the steady-state step) without dropping its module
statistics, and it lives in a private package. docs/memory.md says what is modelled and what is not.

The parts: :mod:`.prediction` (what is returned), :mod:`.counter` (the dispatch mode), :mod:`.fake_state`
(fake model state and batch), :mod:`.optimizers`, :mod:`.trace` (the traced steps, DDP and FSDP2
emulated), :mod:`.workspaces` (cuBLAS's), :mod:`.extrapolate` (in depth and in the batch size),
:mod:`.blocks` (the repeated blocks) and :mod:`.walk` (the batch walker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_gpuopt.memory.counter import StorageCounter
from lightning_gpuopt.memory.fake_state import FakeState, fake_batch, precision_dtypes
from lightning_gpuopt.memory.prediction_types import (
    MemoryCategory,
    ParallelLayout,
    PeakPrediction,
    Phase,
    PhasePeak,
    PredictionInputError,
    PredictionMethod,
)
from lightning_gpuopt.memory.trace import trace_step
from lightning_gpuopt.memory.walk import samples_in
from lightning_gpuopt.memory.workspaces import StepWorkspaces, workspaces_for

__all__ = [
    "predict_peak",
]


# over 80 lines: the public docstring documents its 11 arguments, with a doctest
def predict_peak(
    model: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer
    | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    | None = None,
    *,
    step: Callable[[nn.Module, Any], Any] | None = None,
    precision: str | None = "32-true",
    layout: ParallelLayout | None = None,
    device: torch.device | str = "cpu",
    rounding: Callable[[int], int] | None = None,
    workspace_bytes: int | None = None,
    kernel_scratch: bool | None = None,
    fallback: bool = True,
) -> PeakPrediction:
    """Predict the peak device memory of training ``model`` on ``batch``, without allocating it.

    Runs two training steps in Lightning's order -- forward, ``zero_grad(set_to_none=True)``,
    backward, optimizer step -- on fake tensors (nothing of the step is allocated, nothing in ``model``
    changes: its parameters, buffers and tensor attributes are swapped for fake ones during the trace
    and put back; for the CPU, ``kernel_scratch`` runs single operator calls), counting every storage
    the step makes until it dies. The peak is per device (``layout``: DDP's buckets, FSDP2's shards,
    CPU offload).

    Args:
        model: the model; a LightningModule works unchanged (its ``training_step`` and
            ``configure_optimizers`` are called). Parameters may live on any device, ``meta`` too.
        batch: one batch as the step receives it (tensors of any device; only shapes and dtypes are
            read). For variable-length data pass the longest batch.
        optimizer: an optimizer (its type and hyperparameters are reused over the fake parameters), a
            factory ``f(parameters) -> optimizer``, or ``None``: the module's ``configure_optimizers``.
        step: ``step(model, batch) -> loss`` (a tensor, a dict with ``"loss"`` or an object with
            ``.loss``); ``None``: ``model.training_step(batch, 0)`` when the model has one, else ``model(batch)``.
        precision: the Lightning precision: ``*-mixed`` runs the forward under autocast, ``*-true``
            converts the weights and floating-point inputs.
        layout: the distribution to emulate; ``None``: a single device.
        device: the device type to trace for (kernels and their saved tensors differ between CPU and
            CUDA); fake CUDA tensors need no GPU.
        rounding: bytes as the device's allocator hands them out; ``None``: on CUDA, the caching
            allocator's 512-byte blocks (:func:`lightning_gpuopt.memory.allocator.cuda_block_bytes`),
            else exact bytes.
        workspace_bytes: kernel workspaces alive through the step; ``None``: on CUDA, the cuBLAS (and
            cuBLASLt) workspaces the step's first matmuls take that this process does not hold yet,
            the calling thread's from the first forward on, autograd's thread's from the first backward
            on (:mod:`lightning_gpuopt.memory.workspaces`), else 0.
        kernel_scratch: measure what each CPU kernel allocates inside itself (oneDNN's layout
            reorders, softmax intermediates: :mod:`lightning_gpuopt.memory.scratch`) by running each
            distinct operator call once on zero-filled tensors of its shapes; ``None``: when predicting
            for the CPU and the counting allocator can be built here (else the prediction's
            ``decision`` says why not); ``True``: required (raises when it cannot be measured).
        fallback: when the trace fails (data-dependent operations), return the arithmetic estimate of
            :mod:`lightning_gpuopt.memory.estimate` with ``method=ESTIMATED`` and the reason in
            ``decision``; ``False``: raise.

    Returns:
        A :class:`PeakPrediction`.

    Raises:
        ValueError: ``precision`` is unknown, or no optimizer can be found.

    Example:
        >>> net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1))
        >>> p = predict_peak(net, torch.zeros(64, 256), torch.optim.SGD(net.parameters(), lr=0.1),
        ...                  step=lambda m, x: m(x).square().mean())
        >>> p.method.value, p.categories["parameters"] == 4 * sum(q.numel() for q in net.parameters())
        ('traced', True)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = layout or ParallelLayout()
    weight_dtype, autocast_dtype = precision_dtypes(precision)
    dev = torch.device(device)
    rounding, workspaces = _allocator_of(dev, model, rounding, workspace_bytes)
    n = samples_in(batch)
    if optimizer is None and not callable(getattr(model, "configure_optimizers", None)):
        raise ValueError(
            "`optimizer` must be an optimizer or a factory when the model has no `configure_optimizers`, got None"
        )
    # The autograd engine needs a real CUDA device for CUDA tensors, even fake ones: without one, trace
    # with the CPU's kernels (the same saved tensors for matmuls and attention, in the same dtypes).
    traced_on = dev if dev.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")
    state = FakeState(model, traced_on, weight_dtype)
    scratch, scratch_note = _kernel_scratch(kernel_scratch, dev, traced_on)
    counter = StorageCounter(traced_on.type, rounding, scratch)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False):
            state.swap()
            inputs = fake_batch(batch, traced_on, weight_dtype)
            with counter:
                trace_step(
                    model,
                    inputs,
                    optimizer,
                    step,
                    layout,
                    state,
                    counter,
                    autocast_dtype,
                    traced_on,
                    dev.type == "cuda",
                )
    except PredictionInputError:
        raise
    except Exception as err:
        if not fallback:
            raise
        return _estimated(model, batch, optimizer, precision, layout, n, dev, err)
    finally:
        state.restore()
    phases = _phase_peaks(counter, workspaces)
    best = max(phases, key=lambda ph: ph.peak_bytes)
    return PeakPrediction(
        **best.at_peak(),
        phases=tuple(phases),
        batch_size=n,
        method=PredictionMethod.TRACED,
        device=dev.type,
        decision=_traced_decision(dev, traced_on, counter, scratch, scratch_note),
    )


def _allocator_of(
    dev: torch.device, model: nn.Module, rounding: Callable[[int], int] | None, workspace_bytes: int | None
) -> tuple[Callable[[int], int] | None, StepWorkspaces]:
    """The device's rounding of a request and the kernel workspaces of a step (CUDA's when not given)."""
    workspaces = StepWorkspaces(workspace_bytes or 0, 0)
    if dev.type == "cuda":
        from lightning_gpuopt.memory.allocator import cuda_block_bytes

        rounding = rounding or cuda_block_bytes
        if workspace_bytes is None:
            held = [*model.parameters(), *model.buffers()]
            workspaces = workspaces_for(dev, held + [p.grad for p in held if p.grad is not None])
    return rounding, workspaces


def _phase_peaks(counter: StorageCounter, workspaces: StepWorkspaces) -> list[PhasePeak]:
    """The peak of each phase of each traced step, with the kernel workspaces alive in it."""
    phases = []
    for peak, state_at, transient in counter.phase_peaks:
        categories, modules = counter.peak_breakdown(state_at)
        phase, step_index, module, host, _, _ = state_at
        if phase is Phase.OTHER:
            continue
        # The backward's workspace (autograd's thread) is taken in the first backward and kept.
        first_forward = phase is Phase.FORWARD and step_index == 1
        extra = workspaces.forward + (0 if first_forward else workspaces.backward)
        categories[MemoryCategory.WORKSPACES.value] += extra
        modules = {**modules, "": modules.get("", 0) + extra} if extra else modules
        phases.append(
            PhasePeak(phase.value, step_index, peak + extra, categories, modules, module, host, transient)
        )
    return phases


def _traced_decision(
    dev: torch.device,
    traced_on: torch.device,
    counter: StorageCounter,
    scratch: Any,
    scratch_note: str | None,
) -> str | None:
    """What a traced prediction should say about how it was made (``None``: nothing)."""
    notes = []
    if traced_on != dev:
        notes.append(f"traced with {traced_on.type} kernels (no {dev.type} device here)")
    if counter.guessed:
        notes.append(
            f"data-dependent values guessed ({', '.join(sorted(counter.guessed))}): masks taken as checked, counts as 1"
        )
    if scratch_note:
        notes.append(scratch_note)
    if scratch is not None and scratch.skipped:
        notes.append(
            "kernel scratch not measured for "
            + ", ".join(f"{op} ({why})" for op, why in sorted(scratch.skipped.items()))
        )
    return "; ".join(notes) or None


def _kernel_scratch(
    wanted: bool | None, dev: torch.device, traced_on: torch.device
) -> tuple[Any, str | None]:
    """The scratch measurer for this prediction (or None) and, when it was wanted but is missing, why."""
    on_cpu = dev.type == "cpu" and traced_on.type == "cpu"
    if wanted is False or (wanted is None and not on_cpu):
        return None, None
    if not on_cpu:
        raise ValueError(
            f"kernel_scratch=True measures CPU kernels, but this prediction is for {dev.type}: "
            "pass kernel_scratch=None or False"
        )
    from lightning_gpuopt.memory.scratch import KernelScratch, kernel_scratch_unavailable

    why = kernel_scratch_unavailable()
    if why is not None:
        if wanted:
            raise RuntimeError(f"kernel_scratch=True, but kernel scratch cannot be measured here: {why}")
        return None, f"kernel scratch not measured ({why}): the peak may be a few percent low"
    return KernelScratch(), None


def _estimated(
    model: nn.Module,
    batch: Any,
    optimizer: Any,
    precision: str | None,
    layout: ParallelLayout,
    n: int,
    dev: torch.device,
    err: Exception,
) -> PeakPrediction:
    """The arithmetic estimate of memory/estimate.py when the trace fails, recorded as a decision."""
    from lightning_gpuopt.memory.estimate import CANDIDATES, count_parameters, estimate

    if layout.kind == "single":
        name = "single device"
    elif layout.kind == "ddp":
        name = "ddp"
    elif layout.cpu_offload:
        name = "fsdp: full shard + cpu offload"
    elif layout.replicate_size > 1 and layout.reshard_after_forward:
        name = "hsdp: full shard in node"
    else:
        name = "fsdp: full shard" if layout.reshard_after_forward else "fsdp: shard grads+optimizer"
    candidate = next(c for c in CANDIDATES if c.name == name)
    opt_kind: Any = optimizer if isinstance(optimizer, torch.optim.Optimizer) else "adam"
    e = estimate(count_parameters(model), candidate, layout.shard_size, precision, opt_kind, 0)
    categories = {c.value: 0 for c in MemoryCategory}
    categories[MemoryCategory.PARAMETERS.value] = e.parameters
    categories[MemoryCategory.GRADIENTS.value] = e.gradients
    categories[MemoryCategory.OPTIMIZER_STATE.value] = e.optimizer
    categories[MemoryCategory.GATHERED.value] = e.gathered
    categories[MemoryCategory.BUFFERS.value] = e.buffers
    reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return PeakPrediction(
        peak_bytes=e.total,
        categories=categories,
        modules={},
        phase=Phase.OTHER.value,
        step=0,
        module="",
        host_bytes=0,
        batch_size=n,
        method=PredictionMethod.ESTIMATED,
        device=dev.type,
        decision=f"tracing failed ({reason}): arithmetic estimate of model state, activations not counted",
    )
