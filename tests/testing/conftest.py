"""Fixtures for the SimulatedMemory tests: the backend matrix and a torch.profiler reference peak."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.memory.counting_allocator import native_status

BACKENDS = ("allocator", "dispatch")


def require_native() -> None:
    """Skip when this machine cannot build C++ at all; fail when it can but the build is broken."""
    status = native_status()
    if status is None:
        return
    if "no C++ compiler" in status or "supports Linux and macOS" in status:
        pytest.skip(f"the counting allocator cannot be built here: {status}")
    pytest.fail(f"the counting allocator failed to build on a machine with a C++ compiler: {status}")


@pytest.fixture
def native() -> None:
    """For tests of the allocator backend only: skip or fail as :func:`require_native` says."""
    require_native()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param == "allocator":
        require_native()
    return request.param


def _profiler_peak(fn) -> tuple[int, int]:
    """(peak, end) of CPU memory allocated by ``fn``, relative to its start, from torch.profiler's events.

    Every c10 CPU allocation and free is an event (op outputs and kernel-internal temporaries alike);
    frees of blocks allocated before profiling started are not (the profiler does not know their size),
    so ``fn`` must not free memory it did not allocate for the figures to be meaningful.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
    events.sort(key=lambda e: e[0])
    assert events, "torch.profiler recorded no CPU memory events"
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak, current


@pytest.fixture
def profiler_peak():
    return _profiler_peak


@pytest.fixture(autouse=True)
def _no_simulation_left_behind():
    yield
    from lightning_gpuopt.memory import get_probe
    from lightning_gpuopt.testing import simulated_memory

    leaked = simulated_memory._active_instance
    if leaked is not None:  # exit it so that one failing test does not fail all the following ones
        leaked.__exit__(None, None, None)
        pytest.fail(f"a test left {leaked!r} entered")
    assert get_probe("cpu").kind == "cpu"
    assert (
        torch.utils.data.dataloader._BaseDataLoaderIter.__next__.__qualname__
        == "_BaseDataLoaderIter.__next__"
    )
