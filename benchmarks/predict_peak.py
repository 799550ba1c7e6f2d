"""predict_peak against SimulatedMemory on six models, and `gpuopt plan` on a 7B Llama-shaped model.

    python benchmarks/predict_peak.py [--skip-scale] [--out DIR]  # about 5 minutes on 2 busy cores

Accuracy: per model (the six of tests/memory/predict_models.py), batch size (4, 16, 64) and precision
(32-true, bf16-mixed), AdamW: the peak SimulatedMemory counts over two real training steps in Lightning's
order against :func:`~lightning_gpuopt.memory.predict_peak`, for two truths: the counting allocator
(every CPU allocation, kernel scratch included: the contract's truth; target +5 %, at most 3 % under) and
the dispatch backend (operator outputs only). Scale: ``gpuopt plan --config
examples/configs/llama7b_plan.yaml --trainer.devices 8 --gpuopt.device_memory 80GB`` in a subprocess:
wall time (target < 60 s) and peak RSS above a process that only imports the same modules (< 1 GB).
Size error (``--size-error-only`` runs just this): the batch size the predicted line answers at a budget
where the true answer is 64 samples, alone and after one real step at 16 calibrated it.
Writes ``predict_peak.json`` to ``--out``; prints markdown tables.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "memory"))  # the models of the accuracy tests

from common import arguments, markdown_header, markdown_row, write_json  # noqa: E402
from predict_models import MODELS, OPTIMIZERS  # noqa: E402

from lightning_gpuopt.memory import predict_peak, predict_peak_line  # noqa: E402
from lightning_gpuopt.testing import SimulatedMemory  # noqa: E402

SIZES = (4, 16, 64)
PRECISIONS = ("32-true", "bf16-mixed")


def measured(name: str, n: int, precision: str, backend: str) -> int:
    with SimulatedMemory(backend=backend) as mem:
        model, make_batch, step = MODELS[name]()
        opt = OPTIMIZERS["adamw"](model.parameters())
        mem.track(model)
        for _ in range(2):
            batch = make_batch(n)
            mem.track(batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = step(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            del loss, batch
        return mem.peak_bytes


def accuracy() -> list[dict]:
    rows = []
    for name in MODELS:
        for precision in PRECISIONS:
            for n in SIZES:
                truth = measured(name, n, precision, "allocator")
                outputs = measured(name, n, precision, "dispatch")
                model, make_batch, step = MODELS[name]()
                start = time.perf_counter()
                p = predict_peak(model, make_batch(n), OPTIMIZERS["adamw"], step=step, precision=precision)
                seconds = time.perf_counter() - start
                row = dict(model=name, precision=precision, batch=n, measured_allocator=truth)
                row.update(measured_outputs=outputs, predicted=p.peak_bytes)
                row.update(error_allocator=p.peak_bytes / truth - 1, error_outputs=p.peak_bytes / outputs - 1)
                row["phase"] = f"{p.phase} of step {p.step}"
                row.update(seconds=seconds, kernel_scratch_bytes=p.categories.get("kernel scratch", 0))
                rows.append(row)
                mib = (f"{b / 2**20:.1f}" for b in (truth, outputs, p.peak_bytes))
                errors = f"{row['error_allocator']:+.1%}", f"{row['error_outputs']:+.1%}"
                markdown_row(name, precision, n, *mib, *errors, row["phase"], f"{seconds:.1f}")
    return rows


def size_error(names=("mlp", "resnet18", "gpt2"), small: int = 16, large: int = 64) -> list[dict]:
    """The batch size the predicted line answers at a budget where the true answer is ``large``."""
    rows = []
    for name in names:
        true = {n: measured(name, n, "32-true", "allocator") for n in (small, large)}
        model, make_batch, step = MODELS[name]()
        line = predict_peak_line(model, make_batch, (small, large), optimizer=OPTIMIZERS["adamw"], step=step)
        budget, slope = true[large], (true[large] - true[small]) / (large - small)
        alone, shift = line.largest_fitting(budget), true[small] - line.peak(small)  # one real step at small
        per_sample = line.per_sample_bytes
        calibrated = int((budget - line.fixed_bytes - shift) // per_sample) if per_sample else 0
        row = dict(model=name, fixed_share=(budget - slope * large) / budget)
        row.update(peak_error=line.peak(large) / budget - 1, slope_error=per_sample / slope - 1)
        row.update(size_alone=alone, size_calibrated=calibrated, size_true=large)
        rows.append(row)
        errors = f"{row['fixed_share']:.0%}", f"{row['peak_error']:+.1%}", f"{row['slope_error']:+.1%}"
        sizes = (f"{size} ({size / large - 1:+.0%})" for size in (alone, calibrated))
        markdown_row(name, *errors, *sizes, large)
    return rows


def scale() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LIGHTNING_DISABLE_TIPS": "1"}
    imports = (
        "import resource, lightning_gpuopt.cli, transformers, examples.llama_plan; "
        "from transformers import LlamaForCausalLM; "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )

    def run(*args: str) -> str:
        command = [sys.executable, "-c", *args]
        return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True).stdout

    base = int(run(imports))
    code = (
        "import resource, sys, time; t = time.perf_counter(); from lightning_gpuopt.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('WALL', time.perf_counter() - t); print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    args = ["plan", "--config", "examples/configs/llama7b_plan.yaml", "--trainer.devices", "8"]
    args += ["--gpuopt.device_memory", "80GB"]
    out = run(code, *args)
    wall = float(out.split("WALL ")[1].split()[0])
    rss = int(out.split("RSS ")[1].split()[0])
    print(out[out.find("gpuopt plan:") : out.find("WALL")])
    rss_mib, base_mib = rss / 1024, base / 1024
    plan = f"7B plan: {wall:.1f} s (including the imports), peak RSS {rss_mib:.0f} MiB, imports alone {base_mib:.0f} MiB"
    print(plan)
    result = {"wall_seconds": wall, "rss_kib": rss, "imports_rss_kib": base}
    return {**result, "rss_above_imports_mib": rss_mib - base_mib}


def main() -> None:
    parser = arguments(__doc__, "predict_peak.json", out="build/benchmarks")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--size-error-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = "model|fixed share of the peak|peak error|slope error|size, prediction alone|size, calibrated by one step|true size"
    if args.size_error_only:
        markdown_header(header)
        write_json(args.out, "predict_peak_size_error.json", size_error())
        return
    accuracy_header = "model|precision|batch|allocator MiB|operator outputs MiB|predicted MiB|vs allocator|vs outputs|peak at|predict s"
    markdown_header(accuracy_header)
    result = {"torch": torch.__version__, "machine": platform.platform(), "threads": torch.get_num_threads()}
    result["accuracy"] = accuracy()
    markdown_header(header)
    result["size_error"] = size_error()
    if not args.skip_scale:
        result["scale"] = scale()
    write_json(args.out, "predict_peak.json", result)


if __name__ == "__main__":
    main()
