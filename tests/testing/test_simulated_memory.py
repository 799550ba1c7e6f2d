from __future__ import annotations

import copy
import gc
import pickle
import re
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.memory import get_probe, is_oom_error
from lightning_gpuopt.memory.units import ByteSize
from lightning_gpuopt.testing import SimulatedMemory

MiB = 2**20
OOM_PATTERN = re.compile(
    r"^CUDA out of memory \(simulated\)\. Tried to allocate (?P<req>[\d.]+ \w+ \((?P<req_b>\d+) bytes\)|(?P<req_s>\d+) bytes); "
    r"(?P<use>.+) in use; limit (?P<lim>.+)\. Raised by lightning_gpuopt\.testing\.SimulatedMemory"
)


def _bytes(text: str) -> int:
    m = re.search(r"\((\d+) bytes\)$", text) or re.fullmatch(r"(\d+) bytes", text)
    assert m, text
    return int(m.group(1))


def test_counts_allocations_and_frees_exactly(backend):
    with SimulatedMemory(backend=backend) as mem:
        assert mem.backend == backend
        assert mem.allocated_bytes == 0
        a = torch.empty(1000, dtype=torch.float32)
        assert mem.allocated_bytes == 4000
        b = torch.empty(10, 10, dtype=torch.float64)
        assert mem.allocated_bytes == 4800
        view = a[10:]  # a view allocates nothing
        assert mem.allocated_bytes == 4800
        del a
        assert mem.allocated_bytes == 4800  # the view keeps the storage alive
        del view
        assert mem.allocated_bytes == 800
        del b
        assert mem.allocated_bytes == 0
        assert mem.peak_bytes == 4800


def test_peak_and_reset_peak(backend):
    with SimulatedMemory(backend=backend) as mem:
        keep = torch.empty(MiB, dtype=torch.uint8)
        tmp = torch.empty(3 * MiB, dtype=torch.uint8)
        del tmp
        assert (mem.allocated_bytes, mem.peak_bytes) == (MiB, 4 * MiB)
        mem.reset_peak()
        assert mem.peak_bytes == MiB
        tmp = torch.empty(2 * MiB, dtype=torch.uint8)
        del tmp
        assert mem.peak_bytes == 3 * MiB
    # After exit the figures stay as they were; reset_peak still works on them.
    assert (mem.allocated_bytes, mem.peak_bytes) == (MiB, 3 * MiB)
    mem.reset_peak()
    assert mem.peak_bytes == MiB
    del keep


def test_reentering_starts_from_zero_and_counts_survivors_when_touched(backend):
    mem = SimulatedMemory(backend=backend)
    with mem:
        survivor = torch.ones(256, 256)  # 256 KiB, made inside the first session
        assert mem.allocated_bytes == 256 * 1024
    with mem:
        assert mem.allocated_bytes == 0
        mem.track(survivor)
        assert mem.allocated_bytes == 256 * 1024
        del survivor
        assert mem.allocated_bytes == 0


def test_over_limit_raises_cuda_like_oom(backend):
    with SimulatedMemory(limit_bytes=MiB, backend=backend) as mem:
        keep = torch.empty(MiB // 2, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(MiB, dtype=torch.uint8)
        message = str(info.value)
        del info  # the traceback would pin the frame
        m = OOM_PATTERN.match(message)
        assert m, message
        assert _bytes(m.group("req")) == MiB
        assert _bytes(m.group("use")) == MiB // 2
        assert _bytes(m.group("lim")) == MiB
        assert message.startswith(
            "CUDA out of memory (simulated). Tried to allocate 1.00 MiB (1048576 bytes); "
        )
        assert mem.num_ooms == 1
        assert mem.allocated_bytes == MiB // 2  # the failed request left nothing behind
        torch.empty(MiB // 4, dtype=torch.uint8)  # still fits
    del keep


def test_recognised_by_both_oom_checks(backend):
    from lightning.pytorch.utilities.memory import is_oom_error as lightning_is_oom_error

    with SimulatedMemory(limit_bytes=1024, backend=backend):
        try:
            torch.zeros(10_000)
        except Exception as caught:
            err = caught
    assert type(err) is torch.OutOfMemoryError
    assert is_oom_error(err)
    assert lightning_is_oom_error(err)


def test_oom_inside_backward_keeps_its_type(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(128, 256)
    with SimulatedMemory(backend=backend) as mem:
        loss = model(x).sum()
        after_forward = mem.allocated_bytes
        mem.limit_bytes = after_forward + 1  # the first gradient buffer of backward does not fit
        try:
            loss.backward()
            err = None
        except Exception as caught:
            err = caught
        assert isinstance(err, torch.OutOfMemoryError), repr(err)
        del err, loss
        mem.limit_bytes = None
        gc.collect()
        # The graph is gone once the exception is: only what the partial backward wrote may remain.
        leftover = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        assert mem.allocated_bytes <= after_forward - 128 * 512 * 4 * 2 + leftover


def test_limit_can_change_while_entered(backend):
    with SimulatedMemory(limit_bytes=4 * MiB, backend=backend) as mem:
        a = torch.empty(3 * MiB, dtype=torch.uint8)
        mem.limit_bytes = 2 * MiB  # below what is in use: nothing happens until the next allocation
        assert mem.limit_bytes == 2 * MiB and mem.allocated_bytes == 3 * MiB
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1, dtype=torch.uint8)
        mem.limit_bytes = 8 * MiB  # grow back
        b = torch.empty(4 * MiB, dtype=torch.uint8)
        mem.limit_bytes = None
        c = torch.empty(64 * MiB, dtype=torch.uint8)
        assert mem.allocated_bytes == 71 * MiB
    del a, b, c


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (5 * 2**30, 5 * 2**30),
        ("5GB", 5 * 10**9),
        ("5gb", 5 * 10**9),
        ("5 GiB", 5 * 2**30),
        ("5Gi", 5 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1.5e9", 1_500_000_000),
        ("64 KiB", 64 * 2**10),
        ("1024", 1024),
        (2.0**30, 2**30),
        (None, None),
    ],
)
def test_limit_takes_the_sizes_the_cli_takes(size, expected):
    """One reader of sizes: SimulatedMemory(limit_bytes=...) and ``--gpuopt.device_memory`` agree on every form."""
    assert SimulatedMemory(limit_bytes=size).limit_bytes == expected
    assert SimulatedMemory(size).limit_bytes == expected
    mem = SimulatedMemory()
    mem.limit_bytes = size
    assert mem.limit_bytes == expected
    if size is not None:
        assert expected == ByteSize(size)  # what the CLI makes of it


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (0, "`limit_bytes` must be at least 1 byte, got 0"),
        (-1, "`limit_bytes` must be positive, got -1"),
        ("-5GB", "`limit_bytes` must be positive, got '-5GB'"),
        (True, "`limit_bytes` must be bytes like 80GB, 80GiB or 80e9, got True"),
        (
            "1.5G",
            "`limit_bytes` of '1.5G' is ambiguous: write 1.5GB (1.5·10^9 bytes) or 1.5GiB (1.5·2^30 bytes)",
        ),
        ("5 potatoes", "`limit_bytes` must be a number of bytes with an optional unit"),
        ("", "`limit_bytes` must be a number of bytes with an optional unit"),
        ("GB", "`limit_bytes` must be a number of bytes with an optional unit"),
        ("2PiB", "`limit_bytes` must be at most 1 PiB"),
    ],
    ids=[
        "zero",
        "negative",
        "negative-str",
        "bool",
        "bare-prefix",
        "junk",
        "empty",
        "unit-only",
        "too-large",
    ],
)
def test_invalid_limit_is_one_clear_line(bad, message):
    with pytest.raises(ValueError) as err:
        SimulatedMemory(limit_bytes=bad)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    with pytest.raises(ValueError) as err_from_cli:
        ByteSize(bad)
    assert str(err_from_cli.value) == str(err.value).replace(
        "`limit_bytes`", "A memory size"
    )  # the same rule
    mem = SimulatedMemory()
    with pytest.raises(ValueError, match="`limit_bytes`"):
        mem.limit_bytes = bad
    assert mem.limit_bytes is None


def test_invalid_backend():
    with pytest.raises(ValueError, match="`backend` must be one of"):
        SimulatedMemory(backend="cuda")


def test_entering_twice_is_an_error(backend):
    mem = SimulatedMemory(backend=backend)
    with mem:
        with pytest.raises(RuntimeError, match="already entered"):
            mem.__enter__()
        other = SimulatedMemory(backend=backend)
        with pytest.raises(RuntimeError, match="Another SimulatedMemory is already active"):
            other.__enter__()
        assert not other.entered
        # The failed attempts changed nothing: the first one still counts and is still the probe.
        x = torch.empty(1000, dtype=torch.uint8)
        assert mem.allocated_bytes == 1000
        assert get_probe() is mem
    del x
    with SimulatedMemory(backend=backend):  # and once exited, another may enter
        pass


def test_is_the_active_probe_only_while_entered(backend):
    mem = SimulatedMemory(limit_bytes=10 * MiB, backend=backend)
    assert get_probe("cpu") is not mem
    with mem:
        probe = get_probe("cuda:0")  # stands in for any device
        assert probe is mem
        x = torch.empty(MiB, dtype=torch.uint8)
        snap = probe.snapshot()
        assert snap == {
            "kind": "simulated",
            "device": "cpu",
            "total": 10 * MiB,
            "free": 9 * MiB,
            "allocated": MiB,
            "reserved": MiB,
            "peak": MiB,
            "peak_reserved": MiB,
            "alloc_retries": 0,
        }
    assert get_probe("cpu") is not mem
    del x


def test_total_without_limit_is_the_host_ram():
    from lightning_gpuopt.memory import CpuMemoryProbe

    assert SimulatedMemory().total == CpuMemoryProbe().total


def test_modules_and_optimizers_made_before_entering_count_when_used(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 200), nn.BatchNorm1d(200), nn.Linear(200, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, 100)
    model(x).sum().backward()
    opt.step()  # momentum buffers exist before entering
    param_bytes = sum(p.nbytes for p in model.parameters())
    buffer_bytes = sum(b.nbytes for b in model.buffers())
    with SimulatedMemory(backend=backend) as mem:
        assert mem.allocated_bytes == 0
        model(x)  # a forward counts parameters, their gradients, buffers and the input, as if on the device
        assert mem.allocated_bytes == 2 * param_bytes + buffer_bytes + x.nbytes
        before_step = mem.allocated_bytes
        opt.step()  # the momentum buffers made before entering count at the first step
        assert mem.allocated_bytes == before_step + param_bytes
        del opt
        gc.collect()
        assert mem.allocated_bytes == before_step
        model.zero_grad(set_to_none=True)
        assert mem.allocated_bytes == before_step - param_bytes


def test_track_counts_once(backend):
    model = nn.Linear(1000, 1000)
    t = torch.zeros(1000)
    with SimulatedMemory(backend=backend) as mem:
        mem.track(model, t, [t, {"again": t}], model)
        assert mem.allocated_bytes == sum(p.nbytes for p in model.parameters()) + t.nbytes
        model(t[None])  # already counted: a forward adds only its activations
        assert mem.allocated_bytes == sum(p.nbytes for p in model.parameters()) + t.nbytes


def test_inputs_that_view_a_bigger_storage_count_like_a_copy(backend):
    # A DataLoader without collation yields slices of one big host tensor: on a GPU each slice would
    # be copied over and freed after its step; the dataset itself never is on the device.
    data = torch.randn(64, 1000)
    loader = DataLoader(data.split(16), batch_size=None)
    with SimulatedMemory(backend=backend) as mem:
        seen = []
        for x in loader:
            seen.append(mem.allocated_bytes)
            del x
        assert seen == [16 * 1000 * 4] * 4
        assert mem.allocated_bytes == 0
        row = data[3]
        mem.track(row, row)
        assert mem.allocated_bytes == 1000 * 4
        del row
        assert mem.allocated_bytes == 0
        mem.track(data)  # the whole tensor: its storage
        assert mem.allocated_bytes == data.nbytes


def test_track_outside_is_an_error():
    with pytest.raises(RuntimeError, match="only while entered"):
        SimulatedMemory().track(torch.zeros(1))


@pytest.mark.parametrize("num_workers", [0, 2], ids=["main-process", "workers"])
def test_dataloader_batches_count_on_arrival(backend, num_workers):
    data = TensorDataset(torch.randn(64, 1000), torch.arange(64))
    batch_bytes = 16 * 1000 * 4 + 16 * 8
    loader = DataLoader(data, batch_size=16, num_workers=num_workers)
    with SimulatedMemory(limit_bytes=3 * batch_bytes, backend=backend) as mem:
        seen = []
        for x, y in loader:
            seen.append(mem.allocated_bytes)
            del x, y
        del loader  # stops the workers
        gc.collect()
        assert seen == [batch_bytes] * 4
        assert mem.allocated_bytes == 0
        assert mem.num_ooms == 0  # the workers' own allocations never count here


def test_worker_allocations_do_not_count_and_the_arrival_is_limit_checked(backend):
    # Each worker collates its batch in its own process: nothing counts there. Here, the batch is
    # moved to the simulated device on arrival, which is an allocation like any other.
    data = TensorDataset(torch.randn(64, 1000))
    batch_bytes = 32 * 1000 * 4
    with SimulatedMemory(limit_bytes=batch_bytes + 1000, backend=backend) as mem:
        (x,) = next(iter(DataLoader(data, batch_size=32, num_workers=1)))
        assert mem.allocated_bytes == batch_bytes
        assert mem.num_ooms == 0
        torch.empty(1000, dtype=torch.uint8)  # exactly up to the limit fits
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1001, dtype=torch.uint8)
        del x
        mem.limit_bytes = batch_bytes - 1
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 125\.00 KiB"):
            next(iter(DataLoader(data, batch_size=32, num_workers=1)))
        assert mem.num_ooms == 2


def test_arrival_keeps_the_batch_structure(backend):
    import collections
    import dataclasses

    Pair = collections.namedtuple("Pair", "x y")

    @dataclasses.dataclass(frozen=True)
    class Sample:
        x: torch.Tensor
        name: str

    x = torch.randn(8, 4)
    batch = {"pair": Pair(x[:4], x[4:]), "sample": Sample(x[2:3], "a"), "ids": [1, 2], "same": x}
    loader = DataLoader([batch], batch_size=None)
    with SimulatedMemory(backend=backend) as mem:
        (moved,) = list(loader)
        assert type(moved["pair"]) is Pair and type(moved["sample"]) is Sample
        assert moved["sample"].name == "a" and moved["ids"] == [1, 2]
        assert torch.equal(moved["pair"].x, x[:4]) and moved["pair"].x.data_ptr() != x.data_ptr()
        assert mem.allocated_bytes == (4 + 4 + 1 + 8) * 4 * 4  # one copy per tensor, like .to(device)
        del moved
        assert mem.allocated_bytes == 0


def test_exit_removes_every_hook(backend):
    model = nn.Linear(10, 10)
    with SimulatedMemory(backend=backend) as mem:
        pass
    model(torch.zeros(1, 10))
    next(iter(DataLoader(TensorDataset(torch.zeros(4, 10)), batch_size=2)))
    torch.zeros(100)
    assert mem.allocated_bytes == 0


def test_exception_inside_exits_cleanly(backend):
    mem = SimulatedMemory(backend=backend)
    with pytest.raises(KeyError), mem:
        raise KeyError("boom")
    assert not mem.entered
    assert get_probe("cpu").kind == "cpu"


def test_copies_are_fresh_instances(backend):
    mem = SimulatedMemory(limit_bytes=123456, backend=backend)
    with mem:
        x = torch.zeros(100)
        for clone in (pickle.loads(pickle.dumps(mem)), copy.deepcopy(mem)):
            assert clone.limit_bytes == 123456 and not clone.entered
    with clone:  # a copy can be entered where the original is not
        assert clone.allocated_bytes == 0
    del x


def test_repr_names_the_figures():
    mem = SimulatedMemory(limit_bytes=2048, backend="dispatch")
    with mem:
        x = torch.zeros(8)
    assert (
        repr(mem)
        == "SimulatedMemory(limit_bytes=2048, backend='dispatch', allocated_bytes=32, peak_bytes=32)"
    )
    del x


@pytest.mark.usefixtures("native")
def test_allocator_counts_every_thread():
    with SimulatedMemory(backend="allocator") as mem:
        out = []
        worker = threading.Thread(target=lambda: out.append(torch.empty(MiB, dtype=torch.uint8)))
        worker.start()
        worker.join()
        assert mem.allocated_bytes == MiB
        out.clear()
        assert mem.allocated_bytes == 0


@pytest.mark.usefixtures("native")
def test_allocator_sees_kernel_temporaries_the_dispatch_backend_cannot(profiler_peak):
    # A sort of a non-contiguous tensor allocates internal buffers inside the kernel: the profiler
    # and the allocator see them, an op-level (dispatch) count cannot.
    x = torch.randn(512, 2048).t()
    reference, _ = profiler_peak(lambda: torch.sort(x, dim=0))
    peaks = {}
    for backend in ("allocator", "dispatch"):
        with SimulatedMemory(backend=backend) as mem:
            mem.track(x)
            mem.reset_peak()
            base = mem.allocated_bytes
            torch.sort(x, dim=0)
            peaks[backend] = mem.peak_bytes - base
    assert peaks["allocator"] == reference
    assert peaks["dispatch"] < reference


@pytest.mark.usefixtures("native")
def test_profiler_still_sees_memory_under_the_allocator(profiler_peak):
    with SimulatedMemory(backend="allocator"):
        peak, end = profiler_peak(lambda: torch.empty(MiB, dtype=torch.uint8))
    assert (peak, end) == (MiB, 0)


def _conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def test_an_oom_at_any_point_of_a_step_is_clean(backend):
    # Sweep the limit across the whole step: each run fails at a different allocation (forward,
    # backward inside the autograd engine, Adam's kernels, native conv/pool buffers). Every failure
    # must be a torch.OutOfMemoryError, and memory must come back once it is handled.
    model = _conv_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    with SimulatedMemory(backend=backend) as mem:
        mem.track(model, x, y)
        step()
        opt.zero_grad(set_to_none=True)
        baseline = mem.allocated_bytes
        mem.reset_peak()
        step()
        opt.zero_grad(set_to_none=True)
        peak = mem.peak_bytes
        failures = set()
        for i in range(1, 60):
            mem.limit_bytes = baseline + (peak - baseline) * i // 60
            try:
                step()
                outcome = "ok"
            except torch.OutOfMemoryError as err:
                outcome = str(err)
            mem.limit_bytes = None
            opt.zero_grad(set_to_none=True)  # drop what a partial backward wrote; no gc needed
            assert outcome != "ok", f"no OOM under a limit below the peak ({i}/60)"
            assert mem.allocated_bytes == baseline, f"memory not returned after an OOM at {outcome!r}"
            failures.add(outcome)
        step()  # and training still works
    assert len(failures) >= 30  # the sweep really hit many different allocations
