"""GPU check section ``memory``: the CUDA memory probe against torch.cuda on a real device, under a memory fraction.

    bash benchmarks/gpu_check.sh memory [OUT_DIR]      # or: python benchmarks/gpu/memory.py --out DIR

Sets ``torch.cuda.set_per_process_memory_fraction`` (default 0.1), then compares every figure of
``get_probe()`` with the torch.cuda call it stands for, with live tensors, after ``reset_peak``, while
filling the budget up to the real out-of-memory error (the probe's ``free`` must predict which
allocation fails: ``mem_get_info`` cannot, it ignores the fraction), after ``free_memory()``
(cuBLAS workspace and cache returned) and across a small training step. Writes ``memory.json`` to
``--out`` and exits 1 on any mismatch (2 when no GPU is visible). Needs torch and this checkout
only (no installs); the fraction is restored at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MiB = 2**20


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.info: dict = {}

    def check(self, name: str, ok: bool, **details) -> bool:
        ok = bool(ok)
        self.rows.append({"name": name, "ok": ok, **{k: _plain(v) for k, v in details.items()}})
        shown = ", ".join(f"{k}={_plain(v)}" for k, v in details.items())
        print(f"[{'ok' if ok else 'MISMATCH'}] {name}" + (f"  ({shown})" if shown else ""), flush=True)
        return ok

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r["ok"] for r in self.rows)


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def compare_figures(c: Checks, probe, torch, label: str) -> None:
    """Each probe figure equals the torch.cuda call it stands for, read just before and just after."""
    dev = probe.device
    torch.cuda.synchronize(dev)

    def torch_figures():
        driver_free, device_total = torch.cuda.mem_get_info(dev)
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = getter(dev) if getter else 1.0
        total = int(fraction * device_total)
        reserved = torch.cuda.memory_reserved(dev)
        return {
            "total": total,
            "free": max(0, min(driver_free, total - reserved)),
            "allocated": torch.cuda.memory_allocated(dev),
            "reserved": reserved,
            "peak": torch.cuda.max_memory_allocated(dev),
            "peak_reserved": torch.cuda.max_memory_reserved(dev),
            "alloc_retries": torch.cuda.memory_stats(dev).get("num_alloc_retries", 0),
        }

    before = torch_figures()
    snap = probe.snapshot()
    after = torch_figures()
    for key in before:
        stable = before[key] == after[key]
        c.check(
            f"{label}: probe.{key} == torch.cuda",
            snap[key] in (before[key], after[key]),
            probe=snap[key],
            torch_before=before[key],
            torch_after=after[key],
            torch_stable=stable,
        )


def run(c: Checks, fraction: float) -> None:
    import torch

    from lightning_gpuopt.memory import CudaMemoryProbe, free_memory, get_probe, is_oom_error

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    c.info.update(
        device=props.name,
        total_memory=props.total_memory,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        fraction=fraction,
        has_fraction_getter=hasattr(torch.cuda, "get_per_process_memory_fraction"),
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    )
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old_fraction = float(getter(dev)) if getter else 1.0
    c.info["fraction_before"] = old_fraction
    torch.cuda.set_per_process_memory_fraction(float(fraction), dev)
    try:
        _checks_under_fraction(c, torch, dev, fraction, CudaMemoryProbe, get_probe, is_oom_error, free_memory)
    finally:
        torch.cuda.set_per_process_memory_fraction(old_fraction, dev)


def _checks_under_fraction(
    c, torch, dev, fraction, CudaMemoryProbe, get_probe, is_oom_error, free_memory
) -> None:
    probe = get_probe(dev)
    c.check(
        "get_probe(cuda:0) is a CudaMemoryProbe for cuda:0",
        isinstance(probe, CudaMemoryProbe) and probe.device == dev,
        probe=repr(probe),
    )
    c.check("get_probe() picks the current CUDA device", get_probe().device == dev, probe=repr(get_probe()))
    driver_free, device_total = torch.cuda.mem_get_info(dev)
    budget = int(fraction * device_total)
    c.check(
        "probe.fraction is the fraction set",
        abs(probe.fraction - fraction) < 1e-9,
        probe=probe.fraction,
        set=fraction,
    )
    c.check(
        "probe.total == int(fraction * device total)",
        probe.total == budget,
        probe=probe.total,
        expected=budget,
    )
    c.info["mem_get_info_ignores_fraction"] = driver_free > budget
    c.info["driver_free_at_start"] = driver_free
    c.info["budget"] = budget

    # 1. live tensors of several sizes (small pool, large pool, odd sizes)
    blocks = [torch.empty(n, dtype=torch.uint8, device=dev) for n in (1000, MiB, 3 * MiB + 7, 64 * MiB)]
    compare_figures(c, probe, torch, "live tensors")
    c.check(
        "allocated counts the live tensors",
        probe.allocated >= sum(b.numel() for b in blocks),
        allocated=probe.allocated,
        tensors=sum(b.numel() for b in blocks),
    )
    c.check(
        "reserved >= allocated",
        probe.reserved >= probe.allocated,
        reserved=probe.reserved,
        allocated=probe.allocated,
    )

    # 2. peak and reset_peak
    tmp = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    del tmp
    c.check(
        "peak saw a freed 256 MiB temporary",
        probe.peak >= probe.allocated + 256 * MiB,
        peak=probe.peak,
        allocated=probe.allocated,
    )
    probe.reset_peak()
    c.check(
        "after reset_peak, peak == allocated",
        probe.peak == probe.allocated == torch.cuda.max_memory_allocated(dev),
        peak=probe.peak,
        allocated=probe.allocated,
    )
    compare_figures(c, probe, torch, "after reset_peak")
    del blocks
    free_memory()

    # 3. fill the budget in 256 MiB chunks: probe.free must predict the allocation that fails
    chunk = 256 * MiB
    held, predictions, err = [], [], None
    retries_before = probe.alloc_retries
    for _ in range(budget // chunk + 8):
        free_before = probe.free
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device=dev))
        except Exception as caught:
            err = caught
            predictions.append(("failed", free_before))
            break
        predictions.append(("ok", free_before))
    failed = err is not None
    err_type = type(err).__name__ if failed else None
    err_text = str(err)[:300] if failed else None
    is_oom = is_oom_error(err) if failed else None
    try:
        from lightning.pytorch.utilities.memory import is_oom_error as lightning_is_oom_error

        lightning_oom = lightning_is_oom_error(err) if failed else None
    except ImportError:
        lightning_oom = "lightning not importable"
    del err
    c.check("filling the budget ends in an OOM", failed, chunks_allocated=len(held), error=err_type)
    c.check(
        "the OOM is torch.OutOfMemoryError and is_oom_error says so",
        failed and err_type == "OutOfMemoryError" and is_oom,
        error=err_type,
        message=err_text,
    )
    c.check("Lightning's is_oom_error agrees", lightning_oom is True, lightning=lightning_oom)
    wrong = [
        (i, state, free) for i, (state, free) in enumerate(predictions) if (state == "ok") != (free >= chunk)
    ]
    c.check(
        "probe.free predicted each 256 MiB allocation (fits iff free >= 256 MiB)",
        failed and not wrong,
        wrong=wrong[:5],
        last=predictions[-3:],
    )
    c.check(
        "the fraction held: peak reserved <= budget",
        torch.cuda.max_memory_reserved(dev) <= budget,
        peak_reserved=torch.cuda.max_memory_reserved(dev),
        budget=budget,
    )
    c.info["driver_free_at_oom"] = torch.cuda.mem_get_info(dev)[0]
    c.info["alloc_retries_delta_at_oom"] = probe.alloc_retries - retries_before
    compare_figures(c, probe, torch, "at the OOM")
    c.check("free is (almost) exhausted at the OOM", probe.free < chunk, free=probe.free)
    del held

    # 4. free_memory returns the cache and the cuBLAS workspace
    free_memory()
    base_allocated = probe.allocated
    a = torch.randn(1024, 1024, device=dev)
    b = a @ a  # creates the cuBLAS handle and workspace (a live allocation of the caching allocator)
    del a, b
    torch.cuda.synchronize(dev)
    with_workspace = probe.allocated
    reserved_before = probe.reserved
    free_memory()
    c.check(
        "free_memory() returns the cache",
        probe.reserved < reserved_before,
        before=reserved_before,
        after=probe.reserved,
    )
    # Informational: whether every workspace went (cuBLASLt's may live apart from cuBLAS's on some builds).
    c.info["cublas_clear_hook"] = hasattr(torch._C, "_cuda_clearCublasWorkspaces")
    c.info["workspace_bytes_before_free_memory"] = with_workspace - base_allocated
    c.info["workspace_bytes_after_free_memory"] = probe.allocated - base_allocated
    compare_figures(c, probe, torch, "after free_memory")

    # 5. a training step: the probe's peak is torch's peak
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).to(
        dev
    )
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(512, 1024, device=dev)
    y = torch.randint(0, 10, (512,), device=dev)
    for _ in range(2):
        probe.reset_peak()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    compare_figures(c, probe, torch, "after a training step")
    del model, opt, x, y
    free_memory()


def simulated_on_this_machine(c: Checks) -> None:
    """Informational: does SimulatedMemory work here (which backend), and does it take over get_probe()?"""
    import torch

    from lightning_gpuopt.memory import get_probe
    from lightning_gpuopt.memory._native import native_status
    from lightning_gpuopt.testing import SimulatedMemory

    started = time.perf_counter()
    status = native_status()
    c.info["simulated_native_status"] = status or "available"
    c.info["simulated_native_load_seconds"] = round(time.perf_counter() - started, 2)
    with SimulatedMemory(limit_bytes=64 * MiB) as mem:
        takes_over = get_probe("cuda:0") is mem
        x = torch.zeros(MiB, dtype=torch.uint8)
        counted = mem.allocated_bytes
        del x
    c.info["simulated_backend"] = mem.backend
    c.check("under SimulatedMemory, get_probe('cuda:0') is the simulated probe", takes_over)
    c.check("SimulatedMemory counts a CPU tensor exactly", counted == MiB, counted=counted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT", "gpu_check_out"), help="directory for memory.json"
    )
    parser.add_argument(
        "--fraction", type=float, default=0.1, help="per-process memory fraction to test under"
    )
    args = parser.parse_args(argv)
    if not 0.0 < args.fraction < 1.0:
        parser.error(f"--fraction must be in (0, 1), got {args.fraction}")
    os.makedirs(args.out, exist_ok=True)
    c = Checks()
    started = time.perf_counter()
    error = None
    try:
        import torch

        if not torch.cuda.is_available():
            print("memory: no CUDA device visible (torch.cuda.is_available() is False)", file=sys.stderr)
            error = "no CUDA device"
        else:
            run(c, args.fraction)
            simulated_on_this_machine(c)
    except Exception:
        error = traceback.format_exc()
        print(error, file=sys.stderr)
    result = {
        "section": "memory",
        "ok": c.ok and error is None,
        "error": error,
        "seconds": round(time.perf_counter() - started, 2),
        "info": _plain(c.info),
        "checks": c.rows,
    }
    path = os.path.join(args.out, "memory.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    failed = [r["name"] for r in c.rows if not r["ok"]]
    print(f"memory: {len(c.rows) - len(failed)}/{len(c.rows)} checks ok; wrote {path}")
    if error == "no CUDA device":
        return 2
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
