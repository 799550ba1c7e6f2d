from __future__ import annotations

import mmap

import pytest
import torch

from lightning_gpuopt.memory import CpuMemoryProbe, CudaMemoryProbe, MemoryProbe, get_probe
from lightning_gpuopt.memory.probe import pop_active_probe, push_active_probe

GiB = 2**30
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)


class FakeCuda:
    """The torch.cuda memory API of one imaginary 80 GiB device, with a settable process fraction."""

    def __init__(self, fraction=1.0, driver_free=70 * GiB, allocated=3 * GiB, reserved=5 * GiB):
        self.device_total = 80 * GiB
        self.fraction = fraction
        self.driver_free = driver_free
        self.allocated = allocated
        self.reserved = reserved
        self.peak_allocated = 6 * GiB
        self.peak_reserved = 7 * GiB
        self.retries = 4
        self.calls = []

    def install(self, monkeypatch, with_fraction_getter=True):
        def record(name, result):
            def fn(device=None):
                self.calls.append((name, device))
                return result() if callable(result) else result

            return fn

        c = torch.cuda
        monkeypatch.setattr(c, "is_available", lambda: True)
        monkeypatch.setattr(c, "current_device", lambda: 0)
        monkeypatch.setattr(
            c, "mem_get_info", record("mem_get_info", lambda: (self.driver_free, self.device_total))
        )
        monkeypatch.setattr(c, "memory_allocated", record("memory_allocated", lambda: self.allocated))
        monkeypatch.setattr(c, "memory_reserved", record("memory_reserved", lambda: self.reserved))
        monkeypatch.setattr(
            c, "max_memory_allocated", record("max_memory_allocated", lambda: self.peak_allocated)
        )
        monkeypatch.setattr(
            c, "max_memory_reserved", record("max_memory_reserved", lambda: self.peak_reserved)
        )
        monkeypatch.setattr(
            c, "memory_stats", record("memory_stats", lambda: {"num_alloc_retries": self.retries})
        )
        monkeypatch.setattr(c, "reset_peak_memory_stats", record("reset_peak_memory_stats", None))
        if with_fraction_getter:
            monkeypatch.setattr(
                c, "get_per_process_memory_fraction", record("fraction", lambda: self.fraction), raising=False
            )
        else:
            monkeypatch.delattr(c, "get_per_process_memory_fraction", raising=False)
        return self


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCuda().install(monkeypatch)


def test_total_honours_the_per_process_fraction(fake_cuda):
    probe = CudaMemoryProbe(0)
    assert probe.total == 80 * GiB
    fake_cuda.fraction = 0.25
    assert probe.total == 20 * GiB  # read live: a fraction set after construction counts
    assert probe.device_total == 80 * GiB
    assert probe.fraction == 0.25


def test_total_truncates_like_the_caching_allocator(fake_cuda):
    fake_cuda.device_total = 1001
    fake_cuda.fraction = 0.5
    assert CudaMemoryProbe(0).total == 500  # static_cast<size_t>(fraction * total)


def test_free_is_limited_by_the_budget_not_only_by_the_driver(fake_cuda):
    # mem_get_info says 70 GiB free, but with fraction 0.1 the process may reserve 8 GiB, 5 already.
    fake_cuda.fraction = 0.1
    probe = CudaMemoryProbe(0)
    assert probe.free == int(0.1 * 80 * GiB) - 5 * GiB
    # Without a fraction the driver's free memory is the tighter bound (other processes use the GPU).
    fake_cuda.fraction = 1.0
    fake_cuda.driver_free = 2 * GiB
    assert probe.free == 2 * GiB


def test_free_never_negative(fake_cuda):
    fake_cuda.fraction = 0.01  # budget 0.8 GiB, but 5 GiB already reserved
    assert CudaMemoryProbe(0).free == 0


def test_reports_reserved_as_well_as_allocated(fake_cuda):
    probe = CudaMemoryProbe(0)
    assert (probe.allocated, probe.reserved) == (3 * GiB, 5 * GiB)
    assert (probe.peak, probe.peak_reserved) == (6 * GiB, 7 * GiB)
    assert probe.alloc_retries == 4
    snap = probe.snapshot()
    assert snap["kind"] == "cuda" and snap["device"] == "cuda:0" and snap["reserved"] == 5 * GiB


def test_missing_alloc_retries_stat_reads_zero(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    assert CudaMemoryProbe(0).alloc_retries == 0


def test_every_call_names_the_probed_device(fake_cuda):
    probe = CudaMemoryProbe("cuda:3")
    probe.reset_peak()
    probe.snapshot()
    devices = {device for _, device in fake_cuda.calls}
    assert devices == {torch.device("cuda", 3)}
    assert ("reset_peak_memory_stats", torch.device("cuda", 3)) in fake_cuda.calls


def test_torch_without_fraction_getter_uses_the_whole_device(monkeypatch):
    FakeCuda(fraction=0.25).install(monkeypatch, with_fraction_getter=False)
    probe = CudaMemoryProbe(0)
    assert probe.fraction == 1.0
    assert probe.total == 80 * GiB


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (None, "cuda:0"),
        (2, "cuda:2"),
        ("cuda", "cuda:0"),
        ("cuda:1", "cuda:1"),
        (torch.device("cuda", 5), "cuda:5"),
    ],
    ids=["none", "int", "bare-cuda", "str", "torch-device"],
)
def test_device_forms(fake_cuda, device, expected):
    assert str(CudaMemoryProbe(device).device) == expected


@pytest.mark.parametrize(
    "device", ["cpu", torch.device("meta"), 1.5, True], ids=["cpu", "meta", "float", "bool"]
)
def test_cuda_probe_rejects_other_devices(fake_cuda, device):
    with pytest.raises(ValueError, match="`device` must be a CUDA device"):
        CudaMemoryProbe(device)


def test_get_probe_picks_cuda_when_available(fake_cuda):
    assert isinstance(get_probe(), CudaMemoryProbe)
    assert get_probe(1).device == torch.device("cuda", 1)
    assert isinstance(get_probe("cpu"), CpuMemoryProbe)


def test_get_probe_falls_back_to_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(get_probe(), CpuMemoryProbe)


@pytest.mark.parametrize("device", ["mps", "meta", "not-a-device"], ids=["mps", "meta", "garbage"])
def test_get_probe_rejects_unknown_devices(device):
    with pytest.raises(ValueError, match="`device` must be"):
        get_probe(device)


class _Stub(MemoryProbe):
    kind = "stub"
    device = torch.device("cpu")
    total = free = allocated = reserved = peak = alloc_retries = 7

    def reset_peak(self):
        pass


def test_active_probe_wins_over_any_device(fake_cuda):
    stub = _Stub()
    push_active_probe(stub)
    try:
        assert get_probe() is stub
        assert get_probe("cuda:0") is stub
        assert get_probe("cpu") is stub
    finally:
        pop_active_probe(stub)
    assert isinstance(get_probe(), CudaMemoryProbe)


def test_active_probes_must_be_removed_in_order():
    a, b = _Stub(), _Stub()
    push_active_probe(a)
    push_active_probe(b)
    try:
        with pytest.raises(RuntimeError, match="reverse order"):
            pop_active_probe(a)
    finally:
        pop_active_probe(b)
        pop_active_probe(a)


def test_cpu_probe_reports_the_host():
    probe = CpuMemoryProbe()
    snap = probe.snapshot()
    assert snap["kind"] == "cpu" and snap["alloc_retries"] == 0
    assert probe.total > 0
    assert 0 <= probe.free <= probe.total
    assert probe.allocated == probe.reserved
    resident = probe.allocated  # read first: the peak read after it has seen at least this much
    assert probe.peak >= resident > 0


def test_cpu_probe_sees_the_process_grow():
    probe = CpuMemoryProbe()
    if probe.reserved == 0:
        pytest.skip("this platform reports no resident set size")
    before = probe.reserved
    # 64 MiB of fresh pages, touched: a torch tensor could reuse memory the allocator freed earlier in
    # this process and still holds resident (it did after the ResNet-18 fits of other tests).
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert probe.reserved - before > 32 * 2**20
    assert probe.peak >= probe.reserved
    block.close()


# --- on a real GPU ------------------------------------------------------------------------------


@pytest.fixture
def memory_fraction():
    device = torch.cuda.current_device()
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = getter(device) if getter else 1.0
    yield device
    torch.cuda.set_per_process_memory_fraction(old, device)


@pytest.mark.cuda
@requires_cuda
def test_cuda_probe_matches_torch_cuda(memory_fraction):
    device = memory_fraction
    torch.cuda.set_per_process_memory_fraction(0.3, device)
    probe = get_probe(device)
    assert isinstance(probe, CudaMemoryProbe)
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    driver_free, device_total = torch.cuda.mem_get_info(device)
    assert probe.total == int(0.3 * device_total)
    assert probe.allocated == torch.cuda.memory_allocated(device)
    assert probe.reserved == torch.cuda.memory_reserved(device)
    assert probe.peak == torch.cuda.max_memory_allocated(device)
    assert probe.free == max(
        0, min(driver_free, int(0.3 * device_total) - torch.cuda.memory_reserved(device))
    )
    del x


@pytest.mark.cuda
@requires_cuda
def test_cuda_oom_under_a_fraction_is_recognised_and_freed(memory_fraction):
    from lightning_gpuopt.memory import free_memory, is_oom_error

    device = memory_fraction
    torch.cuda.set_per_process_memory_fraction(0.05, device)
    probe = get_probe(device)
    free_memory()  # what earlier tests left for the garbage collector is not this test's to count
    before = probe.allocated
    try:
        torch.empty(probe.total + 2**20, dtype=torch.uint8, device=device)
        err = None
    except Exception as caught:
        err = caught
    assert err is not None and is_oom_error(err)
    del err
    free_memory()
    assert probe.allocated == before
