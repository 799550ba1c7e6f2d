"""SimulatedMemory against torch.profiler's memory events, and its determinism, on real training steps."""

from __future__ import annotations

import functools

import pytest
import torch
import torchvision
from torch import nn

from lightning_gpuopt.testing import SimulatedMemory

TOLERANCE = 0.03  # the contract; the allocator backend is byte-exact in practice


pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    return model, torch.randn(64, 512), torch.randint(0, 10, (64,))


def _resnet18():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    return model, torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))


MODELS = {"mlp": _mlp, "resnet18": _resnet18}


def _setup(name: str):
    model, x, y = MODELS[name]()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), x, y


def _phases(model, opt, x, y, upto: str, keep: list | None = None) -> None:
    """Run one training step up to the end of ``upto`` ("forward", "backward" or "step")."""
    loss = nn.functional.cross_entropy(model(x), y)
    if keep is not None:
        keep.append(loss)  # a forward-only run keeps its graph, as the step would
    if upto == "forward":
        return
    loss.backward()
    if upto == "step":
        opt.step()


def _full_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    _phases(model, opt, x, y, "step")


PHASES = ("forward", "backward", "step")


def simulated_phases(model, opt, x, y, backend: str = "auto") -> tuple[dict[str, int], int]:
    """One training step under SimulatedMemory: the peak above the start up to the end of each phase, and
    what the step left allocated above it."""
    simulated = {}
    with SimulatedMemory(backend=backend) as mem:
        mem.track(model, opt, x, y)
        mem.reset_peak()
        start = mem.allocated_bytes
        loss = nn.functional.cross_entropy(model(x), y)
        simulated["forward"] = mem.peak_bytes - start
        loss.backward()
        simulated["backward"] = mem.peak_bytes - start
        opt.step()
        simulated["step"] = mem.peak_bytes - start
        del loss
        return simulated, mem.allocated_bytes - start


_reference: dict = {}


def _prepared(model_name: str, first_step: bool):
    model, opt, x, y = _setup(model_name)
    if not first_step:
        _full_step(model, opt, x, y)  # Adam state exists: the steady-state step
    # Dropped before the measured step: the profiler cannot size frees of blocks allocated before it
    # started, so the measured step must not free such blocks.
    opt.zero_grad(set_to_none=True)
    return model, opt, x, y


@pytest.mark.parametrize("model_name", ["mlp", pytest.param("resnet18", marks=pytest.mark.slow)])
@pytest.mark.parametrize("first_step", [True, False], ids=["first-step", "steady-step"])
def test_peak_matches_the_profiler(backend, model_name, first_step, profiler_peak):
    # Peak (relative to the step's start) after the forward, after the backward and after Adam's
    # step: simulated in one run; each from its own torch.profiler run (default allocator) of the
    # step up to that phase, from the same state. Then what the step leaves allocated.
    key = (model_name, first_step)
    if key not in _reference:  # shared by the backends
        _reference[key] = {}
        for upto in PHASES:
            step = functools.partial(_phases, *_prepared(model_name, first_step), upto, [])
            _reference[key][upto] = profiler_peak(step)
    reference = _reference[key]

    model, opt, x, y = _prepared(model_name, first_step)
    simulated, end = simulated_phases(model, opt, x, y, backend)

    for upto in PHASES:
        peak, ref = simulated[upto], reference[upto][0]
        print(
            f"{model_name} {backend} first_step={first_step} {upto}: simulated {peak} / profiler {ref} = {peak / ref:.5f}"
        )
        if backend == "dispatch" and model_name == "resnet18":
            # Op outputs only: the buffers conv kernels allocate internally (oneDNN im2col and
            # workspaces, in forward and backward) are invisible to it. How much depends on the
            # CPU's conv algorithm: ResNet-18 reads 40 % low in forward and 31 % low in backward on
            # an AVX2 machine, within 3 % where convs run as dispatched ops. It reads low, never high.
            assert peak <= ref * (1 + TOLERANCE), upto
        else:
            assert abs(peak - ref) <= TOLERANCE * ref, upto
    reference_end = reference["step"][1]
    assert abs(end - reference_end) <= TOLERANCE * reference_end  # gradients (+ Adam's new state)


def _peaks_of_a_run(backend: str, model_name: str, steps: int = 3):
    model, opt, x, y = _setup(model_name)
    rows = []
    with SimulatedMemory(backend=backend) as mem:
        mem.track(model, x, y)
        for _ in range(steps):
            before = mem.allocated_bytes
            mem.reset_peak()
            _full_step(model, opt, x, y)
            rows.append((before, mem.peak_bytes, mem.allocated_bytes))
    return rows


@pytest.mark.parametrize("model_name", ["mlp", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_deterministic_across_runs_and_steps(backend, model_name):
    run1 = _peaks_of_a_run(backend, model_name)
    run2 = _peaks_of_a_run(backend, model_name)
    assert run1 == run2
    first, *steady = run1
    assert first[2] > first[0]  # the first step leaves gradients and Adam's state behind
    # From the second step on: the same peak each step, and each step ends where it started.
    assert len({row for row in steady}) == 1
    before, _, after = steady[0]
    assert after == before
    assert first[2] == before  # after the first step the state is in place: steady from there
