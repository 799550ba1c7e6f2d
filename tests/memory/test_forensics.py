"""memory/forensics: the breakdown of the bytes in use, where the program was, the observer, the owners."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_gpuopt.memory import MemoryCategory, forensics
from lightning_gpuopt.testing import SimulatedMemory

CPU = torch.device("cpu")


def test_every_predicted_category_folds_into_one_of_the_five():
    assert set(forensics.CATEGORY_OF) == set(MemoryCategory)
    assert set(forensics.CATEGORY_OF.values()) <= set(forensics.CATEGORIES)
    folded = forensics.fold_categories({c.value: 1 for c in MemoryCategory})
    assert sum(folded.values()) == len(MemoryCategory) and folded["parameters"] == 1


def test_the_breakdown_counts_each_storage_once_and_what_a_backward_still_needs():
    # Graphs that other code in this process keeps alive count too (they hold memory): measure against them.
    before = sum(forensics.saved_activations(CPU).values())
    layer = nn.Linear(256, 256)
    x = torch.randn(64, 256)
    hidden = layer(x).tanh()  # saves x (64 KiB) and the tanh's output (64 KiB); the weight is a parameter
    params = list(layer.parameters())
    param_bytes = sum(p.numel() * 4 for p in params)
    c = forensics.categories_now(10**8, CPU, parameters=params, gradients=[], optimizer_state=[])
    assert c["parameters"] == param_bytes and c["activations"] - before == 2 * 64 * 256 * 4
    assert sum(c.values()) == 10**8
    hidden.sum().backward()  # released: nothing is saved any more
    assert forensics.categories_now(10**8, CPU, params)["activations"] == before
    grads = [p.grad for p in params]
    c = forensics.categories_now(10**6, CPU, params, grads + grads)  # a gradient given twice counts once
    assert c["gradients"] == param_bytes


def test_a_checkpointed_block_is_not_recomputed_and_its_inputs_are_not_its_activations():
    calls = []

    def block(t):
        calls.append(1)
        return (t @ t.T).tanh()

    x = torch.randn(32, 64, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False)
    assert len(calls) == 1
    forensics.saved_activations(CPU)
    assert len(calls) == 1, "reading the graph must not run the checkpointed block again"
    out.sum().backward()


def test_phase_from_the_code_on_the_stack():
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            seen["forward"] = forensics.phase_of_frames(forensics.stack_frames())
            return t * 1

        @staticmethod
        def backward(ctx, g):
            seen["backward"] = forensics.phase_of_frames(forensics.stack_frames())
            return g

    w = nn.Parameter(torch.ones(3))
    Probe.apply(w).sum().backward()

    class Watching(torch.optim.SGD):
        def step(self, closure=None):
            seen["optimizer"] = forensics.phase_of_frames(forensics.stack_frames())
            return super().step(closure)

    Watching([w], lr=0.1).step()
    assert seen == {
        "forward": "forward",
        "backward": "backward",
        "optimizer": "optimizer step",
    }


class Listener:
    def __init__(self) -> None:
        self.events: list[forensics.OOMEvent] = []
        self.caught: list[dict] = []
        self.actions: list[str] = []

    def oom_observed(self, event):
        self.events.append(event)

    def oom_caught(self, error, **context):
        self.caught.append(context)

    def oom_action(self, action):
        self.actions.append(action)


@pytest.mark.parametrize("backend", ["allocator", "dispatch"])
def test_simulated_memory_tells_the_listener_before_it_raises(backend):
    listener = Listener()
    forensics.watch(listener)
    try:
        with SimulatedMemory(2**20, backend=backend):
            kept = torch.zeros(2**16)  # 256 KiB
            with pytest.raises(torch.OutOfMemoryError):
                torch.zeros(2**18)  # 1 MiB more
            del kept
    finally:
        forensics.unwatch(listener)
    (event,) = listener.events
    assert (event.device, event.requested_bytes, event.allocated_bytes, event.limit_bytes) == (
        "cpu",
        2**20,
        2**18,
        2**20,
    )
    assert event.frames and forensics.listener() is None


def test_the_listener_is_held_weakly_and_its_errors_never_replace_the_oom():
    class Broken(Listener):
        def oom_observed(self, event):
            raise RuntimeError("a listener bug")

    broken = Broken()
    forensics.watch(broken)
    forensics.allocation_failed("cpu", 1, 2, 2, 3)  # no exception
    del broken
    gc.collect()
    assert forensics.listener() is None
    forensics.failure_caught(RuntimeError("x"), stage="train")  # no listener: nothing happens
    forensics.action_taken("nothing")


def test_activation_owners_attribute_what_is_saved_to_the_module_that_saved_it():
    model = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1))
    x = torch.randn(32, 16)
    with forensics.ActivationOwners(model, CPU) as owners:
        loss = model(x).sum()
        at_forward_end = dict(owners.by_module)
        loss.backward()
    assert at_forward_end["1"] == 32 * 512 * 4  # the Tanh keeps its output; the second Linear saves the same
    assert at_forward_end["0"] == 32 * 16 * 4  # the first Linear keeps its input
    assert owners.total == 0 and owners.peak == sum(at_forward_end.values())
    assert forensics.ActivationOwners.top(owners.at_peak, n=1) == [{"module": "1", "bytes": 32 * 512 * 4}]


def test_memory_history_is_cuda_only():
    history = forensics.MemoryHistory(entries=10)
    if not torch.cuda.is_available():
        assert history.start() is False and not history.recording
