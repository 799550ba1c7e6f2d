"""GPU section ``precision``: speed and stability per precision, PrecisionSwitch's choice and its fallback.

    bash benchmarks/gpu_check.sh precision OUT_DIR   # runs: python benchmarks/gpu/precision.py --out OUT_DIR

For a torchvision ResNet-50 (batch 128 at 224x224, SGD momentum) and the small causal transformer LM
of the ``oom`` section (batch 32 x 512 tokens, AdamW), at the same batch in every configuration:

1. **Per precision** (plain Lightning): samples/s and the final loss (mean of the last 3 steps) for
   ``32-true`` (TF32 off for matmuls and cuDNN convolutions), ``tf32`` (``32-true`` with TF32 matmuls
   and convolutions), ``bf16-mixed`` and ``16-mixed`` (GradScaler). A configuration is *stable* when
   its last losses are finite and, for ``16-mixed``, the GradScaler's scale ends >= 1.
2. **Cost when healthy**, reported: ``PrecisionSwitch(initial="keep")`` in ``32-true`` (one check and
   host sync per step) and in ``16-mixed`` (none: the GradScaler already knows), over plain.
3. **The automatic choice**: ``PrecisionSwitch()`` (``initial="auto"``, its watch included, from torch's
   default float32 settings). Check: its samples/s is within 5 % of the fastest stable configuration.
4. **The fallback on a real GPU**: a small MLP in ``16-mixed`` whose input overflows float16 from
   step 5: the run switches down, applies no step with a non-finite gradient (a torch step pre-hook
   checks every applied step), and ends with finite parameters.

Timing, configurations and report are those of ``benchmarks/precision.py`` (loaded from there):
configurations run interleaved, ``--repeats`` rounds after one untimed fit; samples/s is the median
over rounds of the mean step time from the end of the last warm-up batch to the end of the last
timed batch (``torch.cuda.synchronize`` at both ends only).

Writes ``precision.json`` to ``--out``; exits 1 when a check fails and when no CUDA device is present
(a skipped check must not pass). Estimated 2-3 minutes on an H200 (28 short fits; budget: 5); not yet run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch
import torchvision
from oom import WORKLOADS as OOM_WORKLOADS
from oom import CausalLM, Classifier, _image_batches, _token_batches
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import PrecisionSwitch


def _load_benchmark() -> ModuleType:
    """benchmarks/precision.py (configurations, timing, report), loaded by path: it shares this file's name."""
    path = Path(__file__).resolve().parents[1] / "precision.py"
    sys.path.insert(0, str(path.parent))  # for its own imports (oom_recovery, gpu.oom)
    spec = importlib.util.spec_from_file_location("precision_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


def workloads() -> list[Any]:
    return [
        bench.Workload(
            "resnet50",
            "torchvision resnet50(num_classes=1000), 3x224x224, SGD momentum",
            Classifier,
            lambda: _image_batches(128),
            batch_size=128,
        ),
        bench.Workload(
            "transformer",
            OOM_WORKLOADS["transformer"].description,
            CausalLM,
            lambda: _token_batches(32),
            batch_size=32,
        ),
    ]


def checks_of(r: dict[str, Any]) -> dict[str, bool]:
    auto = r["configs"]["auto"]
    return {
        "some_configuration_is_stable": r["fastest_stable"] is not None,
        "auto_is_stable_without_a_switch": auto["stable"] and not auto["switches"],
        "auto_within_5_percent_of_fastest_stable": r["auto"]["met"],
    }


# ----------------------------------------------------------------------------- the fallback, for real


class Overflowing(pl.LightningModule):
    """An MLP whose input is scaled by 1e5 from step ``at`` on (and its first layer's output scaled back)."""

    def __init__(self, at: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))
        self.at = at

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        big = 1e5 if self.global_step >= self.at else 1.0
        out = self.net[2](self.net[1](self.net[0](x * big) / big))
        return F.mse_loss(out.float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Applied(pl.Callback):
    """Counts applied optimizer steps, and those among them with a non-finite gradient."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.nonfinite = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.nonfinite += not all(bool(torch.isfinite(g).all()) for g in grads)
            self.steps.append(trainer.global_step)

        trainer.optimizers[0].register_step_pre_hook(pre)


def check_fallback(steps: int = 12, device: str = "cuda") -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 64, 64, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    switch, applied = PrecisionSwitch(initial="16-mixed"), Applied()
    model = Overflowing()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator=device,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[switch, applied],
    )
    trainer.fit(model, DataLoader(data, batch_size=64))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    changes = [[c.step, c.before, c.after, c.reason] for c in switch.switches]
    checks = {
        "switched_down_from_16_mixed": bool(changes) and changes[0][1] == "16-mixed",
        "no_nonfinite_step_applied": applied.nonfinite == 0,
        "finite_parameters": finite,
        "completed": trainer.global_step == steps,
    }
    return {
        "switches": changes,
        "applied_steps": applied.steps,
        "skipped_steps": switch.skipped_steps,
        "rerun_batches": switch.rerun_batches,
        "final_precision": trainer.precision,
        "checks": checks,
        "passed": all(checks.values()),
    }


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("gpu_check_out"), help="directory for precision.json"
    )
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per fit (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per fit (default 3)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu/precision.py: no CUDA device visible (torch.cuda.is_available() is False); "
            "this check needs a real GPU and cannot pass without one",
            file=sys.stderr,
        )
        return 1
    bench.quiet()
    torch.backends.cudnn.benchmark = True
    properties = torch.cuda.get_device_properties(0)
    started = time.perf_counter()
    try:
        results = bench.run(workloads(), "cuda", args.repeats, args.warmup, args.steps)
    except Exception as err:  # still write what is known, and fail
        traceback.print_exc()
        results = {"models": {}, "error": f"{type(err).__name__}: {err}"}
    results.update(
        section="precision",
        torchvision=torchvision.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        capability=f"{properties.major}.{properties.minor}",
        bf16_native=torch.cuda.is_bf16_supported(including_emulation=False),
    )
    for r in results["models"].values():
        r["checks"] = checks_of(r)
        r["passed"] = all(r["checks"].values())
    if results["models"]:
        bench.print_table(results)
    print("\nprecision: fallback ...", flush=True)
    try:
        results["fallback"] = check_fallback()
    except Exception as err:
        traceback.print_exc()
        results["fallback"] = {"passed": False, "error": f"{type(err).__name__}: {err}"}
    fallback = results["fallback"]
    print(
        f"fallback: {'PASS' if fallback['passed'] else 'FAIL'} {fallback.get('checks', fallback.get('error'))}; "
        f"switches {fallback.get('switches')}",
        flush=True,
    )
    results["passed"] = (
        bool(results["models"])
        and all(r["passed"] for r in results["models"].values())
        and fallback["passed"]
    )
    results["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "precision.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"precision: {'PASS' if results['passed'] else 'FAIL'} ({results['wall_s']:.0f} s); wrote {path}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
