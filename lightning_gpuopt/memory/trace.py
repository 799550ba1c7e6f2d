"""One traced training step on fake tensors: two steps in Lightning's order, counted, with DDP's buckets and
FSDP2's units emulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_gpuopt.memory.counter import StorageCounter
from lightning_gpuopt.memory.fake_state import FakeState
from lightning_gpuopt.memory.optimizers import build_optimizer
from lightning_gpuopt.memory.prediction_types import (
    MemoryCategory,
    ParallelLayout,
    Phase,
    PredictionInputError,
)
from lightning_gpuopt.memory.walk import tensors

__all__ = [
    "trace_step",
]


# ---------------------------------------------------------------------------------------------------
# Emulation of the distributed strategies
# ---------------------------------------------------------------------------------------------------
def _ddp_buckets(params: list[nn.Parameter], cap: int) -> list[tuple[int, list[nn.Parameter]]]:
    """DDP's buckets: parameters in reverse order, the first bucket 1 MiB, the others ``cap`` bytes."""
    buckets: list[tuple[int, list[nn.Parameter]]] = []
    current: list[nn.Parameter] = []
    size, limit = 0, min(cap, 2**20)
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > limit:
            buckets.append((size, current))
            current, size, limit = [], 0, cap
        current.append(p)
        size += nbytes
    if current:
        buckets.append((size, current))
    return buckets


def _fsdp_units(model: nn.Module, names: tuple[str, ...] | None) -> list[tuple[str, nn.Module]]:
    modules = dict(model.named_modules())
    if names:
        units = [(n, modules[n]) for n in names if n in modules]
    else:
        units = []
    covered = {id(p) for _, u in units for p in u.parameters()}
    for name, child in model.named_children():
        if any(id(p) not in covered for p in child.parameters()):
            units.append((name, child))
            covered.update(id(p) for p in child.parameters())
    if any(id(p) not in covered for p in model.parameters(recurse=False)):
        units.append(("", model))
    return units


def _shard_bytes(t: torch.Tensor, world: int) -> int:
    """Bytes of one rank's shard: FSDP2 pads dim 0 to a multiple of the world size."""
    if t.dim() == 0:
        return t.element_size()
    rows = -(-t.shape[0] // world)
    return rows * (t.numel() // max(1, t.shape[0])) * t.element_size()


# ---------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------
def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    loss = getattr(output, "loss", None)  # Hugging Face ModelOutput
    return loss if isinstance(loss, torch.Tensor) else None


def trace_step(
    model: nn.Module,
    batch: Any,
    optimizer: Any,
    step: Callable[[nn.Module, Any], Any] | None,
    layout: ParallelLayout,
    state: FakeState,
    counter: StorageCounter,
    autocast_dtype: torch.dtype | None,
    dev: torch.device,
    target_cuda: bool,
) -> None:
    """Trace two training steps of ``model`` on the fake ``batch`` into ``counter``, ``layout`` emulated."""
    params = [p for p in dict.fromkeys(model.parameters())]
    _count_held(model, params, batch, layout, state, counter)
    emulation = _Emulation(model, layout, counter, dev)
    handles = emulation.install(model, [p for p in params if p.requires_grad])
    try:
        opt = build_optimizer(model, optimizer, state, counter)
        if target_cuda:
            for group in opt.param_groups:  # on CUDA, torch's optimizers default to their foreach kernels
                if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                    group["foreach"] = True
        _first_step(model, batch, step, opt, emulation, autocast_dtype)
    finally:
        for h in handles:
            h.remove()
        counter.module_stack.clear()


def _count_held(
    model: nn.Module,
    params: list[nn.Parameter],
    batch: Any,
    layout: ParallelLayout,
    state: FakeState,
    counter: StorageCounter,
) -> None:
    """Count what exists before the first step: parameters (sharded, offloaded), buffers, tensor attributes, the batch."""
    for p in params:
        counter.add(
            p,
            MemoryCategory.PARAMETERS,
            nbytes=_shard_bytes(p, layout.shard_size) if layout.sharded else None,
            host=layout.cpu_offload,
            module="",
        )
    for name, module in model.named_modules():
        for b in module.buffers(recurse=False):
            counter.add(b, MemoryCategory.BUFFERS, module=name)
    for t in state.attributes:  # plain tensor attributes' storages: held like buffers
        counter.add(t, MemoryCategory.BUFFERS, module="")
    state.attributes = []  # the module holds them: replaced during the step, they are freed
    for t in tensors(batch):
        counter.add(t, MemoryCategory.INPUTS, module="")


class _Emulation:
    """The hooks that emulate the strategy during the trace: the module stack, FSDP2's units gathered and
    released, gradients classified when accumulated (DDP copies them into its buckets, FSDP2 reduce-scatters).
    """

    def __init__(self, model: nn.Module, layout: ParallelLayout, counter: StorageCounter, dev: torch.device):
        self.layout, self.counter, self.dev = layout, counter, dev
        self.names = {id(m): name for name, m in model.named_modules()}
        self.units = _fsdp_units(model, layout.units) if layout.sharded else []
        self.unit_of = {id(u): (name, u) for name, u in self.units}
        self.unit_params = {id(p): (name, u) for name, u in self.units for p in u.parameters()}
        self.pending: dict[int, int] = {id(u): len(list(u.parameters())) for _, u in self.units}
        self.gathered: dict[int, torch.Tensor] = {}
        self.bucket_views: dict[int, torch.Tensor] = {}
        self.buckets: list[torch.Tensor] = []  # DDP's flat buckets, alive through the step

    def install(self, model: nn.Module, trainable: list[nn.Parameter]) -> list[Any]:
        """DDP's buckets made, every hook registered; returns the handles to remove."""
        if self.layout.kind == "ddp":
            self._make_buckets(trainable)
        handles = []
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(self.pre_hook))
            handles.append(m.register_forward_hook(self.post_hook))
        for p in trainable:
            handles.append(p.register_post_accumulate_grad_hook(self.grad_ready))
        return handles

    def _make_buckets(self, trainable: list[nn.Parameter]) -> None:
        for size, members in _ddp_buckets(trainable, self.layout.bucket_cap_bytes):
            flat = torch.empty(size // members[0].element_size(), dtype=members[0].dtype, device=self.dev)
            self.counter.update(flat, MemoryCategory.GRADIENTS, module="")
            self.buckets.append(flat)
            offset = 0
            for p in members:
                self.bucket_views[id(p)] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    def gather(self, unit: nn.Module, name: str) -> None:
        if id(unit) in self.gathered:
            return
        numel = sum(p.numel() for p in unit.parameters())
        dtype = next(unit.parameters()).dtype
        buf = torch.empty(numel, dtype=dtype, device=self.dev)
        self.counter.update(buf, MemoryCategory.GATHERED, host=False, module=name)
        self.gathered[id(unit)] = buf

    def release(self, unit: nn.Module) -> None:
        self.gathered.pop(id(unit), None)

    def release_all(self) -> None:
        for _, u in self.units:
            self.release(u)

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        counter = self.counter
        counter.module_stack.append(self.names.get(id(module), ""))
        if id(module) in self.unit_of:
            self.gather(module, self.unit_of[id(module)][0])

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        counter = self.counter
        if counter.module_stack:
            counter.module_stack.pop()
        if id(module) in self.unit_of and not counter.in_backward:
            if self.layout.reshard_after_forward:
                self.release(module)
            name = self.unit_of[id(module)][0]
            # The unit is gathered again when the gradient of its output arrives, before its own backward.
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda g, module=module, name=name: self.gather(module, name))

    def grad_ready(self, p: nn.Parameter) -> None:
        g, layout, counter = p.grad, self.layout, self.counter
        if g is None:
            return
        if layout.kind == "ddp":
            view = self.bucket_views.get(id(p))
            if view is not None:
                view.copy_(g)
                if layout.gradient_as_bucket_view:
                    p.grad = view
                    return
        if not layout.sharded:
            counter.update(g, MemoryCategory.GRADIENTS)
            return
        _, unit = self.unit_params[id(p)]
        self.pending[id(unit)] -= 1
        counter.update(g, MemoryCategory.GRADIENTS)
        if self.pending[id(unit)] == 0:  # the unit's backward is done: reduce-scatter its gradients
            self.release(unit)
            for q in unit.parameters():
                if q.grad is not None:
                    counter.update(
                        q.grad,
                        MemoryCategory.GRADIENTS,
                        nbytes=_shard_bytes(q.grad, layout.shard_size),
                        host=layout.cpu_offload,
                    )


def _first_step(
    model: nn.Module,
    batch: Any,
    step: Callable[[nn.Module, Any], Any] | None,
    opt: torch.optim.Optimizer,
    emulation: _Emulation,
    autocast_dtype: torch.dtype | None,
) -> None:
    """Run the first step in Lightning's order, phase by phase, and add what the second one holds more."""
    import warnings

    counter, layout, dev = emulation.counter, emulation.layout, emulation.dev
    counter.step = 1
    grads_before = counter.by_category.get(MemoryCategory.GRADIENTS, 0)
    counter.start_phase(Phase.FORWARD)
    ctx = (
        torch.autocast(dev.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _run_step(model, batch, step)
    loss = _loss_of(out)
    if loss is None:
        raise PredictionInputError(
            "The training step must return a loss (a tensor, a dict with 'loss', or an object with "
            f"`.loss`), got {type(out).__name__}: pass `step=` returning the loss"
        )
    counter.start_phase(Phase.OTHER)
    opt.zero_grad(set_to_none=True)
    counter.start_phase(Phase.BACKWARD)
    counter.in_backward = True
    loss.backward()
    counter.in_backward = False
    del loss, out
    emulation.release_all()
    counter.start_phase(Phase.OPTIMIZER)
    if layout.sharded:
        counter.scale = layout.shard_size
        counter.host_phase = layout.cpu_offload
    opt.step()
    counter.scale = 1
    counter.host_phase = False
    for st in opt.state.values():
        for v in st.values() if isinstance(st, Mapping) else ():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                counter.update(v, MemoryCategory.OPTIMIZER_STATE)
    counter.start_phase(Phase.OTHER)
    # The second step runs the same operators with more alive: the first step's gradients during
    # its forward (zero_grad comes after it, Lightning's order), the optimizer state throughout,
    # and no state to create in its optimizer step.
    state_bytes = counter.by_category.get(MemoryCategory.OPTIMIZER_STATE, 0)
    grads_bytes = counter.by_category.get(MemoryCategory.GRADIENTS, 0) - grads_before
    counter.add_second_step(
        {
            Phase.FORWARD: {
                MemoryCategory.GRADIENTS: grads_bytes,
                MemoryCategory.OPTIMIZER_STATE: state_bytes,
            },
            Phase.BACKWARD: {MemoryCategory.OPTIMIZER_STATE: state_bytes},
        }
    )


def _run_step(model: nn.Module, batch: Any, step: Callable[[nn.Module, Any], Any] | None) -> Any:
    if step is not None:
        return step(model, batch)
    training_step = getattr(model, "training_step", None)
    if callable(training_step):
        return training_step(batch, 0)
    return model(batch)
