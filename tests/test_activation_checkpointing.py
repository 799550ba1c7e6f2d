"""Activation checkpointing of chosen module types: same results, less memory kept, and fully undone."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from lightning_gpuopt.activation_checkpointing import (
    checkpoint_modules,
    matching_modules,
    uncheckpoint_modules,
)
from lightning_gpuopt.testing import SimulatedMemory


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 512), nn.Linear(512, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(6)), nn.Linear(32, 1))


def _grads_and_kept(net: nn.Module) -> tuple[list[torch.Tensor], int]:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with SimulatedMemory() as mem:
        mem.track(net, x)
        before = mem.allocated_bytes
        loss = net(x).square().mean()
        kept = mem.allocated_bytes - before  # what the forward keeps for the backward
        loss.backward()
    return [p.grad.clone() for p in net.parameters()], kept


def test_same_gradients_and_less_memory_kept_by_the_forward():
    plain, plain_kept = _grads_and_kept(_net())
    net = _net()
    changed = checkpoint_modules(matching_modules(net, [Block]))
    assert len(changed) == 6
    grads, kept = _grads_and_kept(net)
    for a, b in zip(grads, plain):
        torch.testing.assert_close(a, b)
    assert kept < plain_kept / 3


def test_matching_by_class_name_qualified_name_and_class():
    net = _net()
    assert len(matching_modules(net, ["Block"])) == 6
    assert len(matching_modules(net, [f"{Block.__module__}.{Block.__qualname__}"])) == 6
    assert len(matching_modules(net, [nn.Linear])) == 13
    assert matching_modules(net, ["Transformer"]) == []


def test_a_checkpointed_module_still_pickles_and_copies():
    net = _net()
    checkpoint_modules(net[:2])
    assert checkpoint_modules(net[:2]) == []  # already on: nothing changes twice
    x = torch.ones(2, 32)
    for clone in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        torch.testing.assert_close(clone(x), net(x))


def test_undo_restores_the_module_and_an_instance_forward_a_user_set():
    net = _net()
    own = lambda x: x  # noqa: E731 - an instance-level forward a user set
    net[0].forward = own
    checkpoint_modules(net[:2])
    torch.testing.assert_close(net[0](torch.ones(2, 32)), torch.ones(2, 32))  # still the user's forward
    uncheckpoint_modules(net[:2])
    assert net[0].forward is own and "forward" not in vars(net[1])
