"""GPU section ``oom``: OOMRecovery against real CUDA out-of-memory errors.

    bash benchmarks/gpu_check.sh oom OUT_DIR        # runs: python benchmarks/gpu/oom.py --out OUT_DIR

For a torchvision ResNet-50 (batch 256 at 224x224) and a small causal transformer LM, in fp32 with
TF32 off and deterministic cuDNN:

1. **Calibrate**: two unlimited runs measure the steady-state peak of a step at k=1 and at k=8
   (``torch.cuda.max_memory_allocated``); the limit sits halfway between, so the full batch cannot
   fit and a split into at most 8 micro-batches can, the optimizer step included.
2. **Run out of memory for real**: train with ``OOMRecovery()``; after a few steps at k=1 the
   process is confined to the limit (``torch.cuda.set_per_process_memory_fraction``, then
   ``empty_cache`` so the cached blocks of the bigger steps cannot serve the next one). The next step
   raises CUDA OOM and must be retried with more micro-batches.
3. **Check**: the run completes and ``cb.failures`` holds real CUDA OOMs; ``memory_allocated`` at the
   start of a later step is within 1 % of its figure at the start of the failing step (nothing the
   failed attempts held survives); parameters and buffers after the run equal a reference run
   without a limit that uses the same micro-batch count per batch (k=1, then the final k) to a
   relative error of 1e-4. The reference follows the recovered run's schedule rather than forcing
   the final k from the start, because BatchNorm normalises over each micro-batch: the same
   schedule makes the two runs the same computation, so any difference is a leak of a failed attempt.

Writes ``oom.json`` to ``--out`` with every figure and a pass flag per check; exits 1 when a check
fails and when no CUDA device is present (a skipped check must not pass). Takes about 1-2 minutes
on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torchvision
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.memory import OOM_MESSAGES
from lightning_gpuopt.microbatch import MicroBatchEngine

CALIBRATION_K = 8
CALIBRATION_STEPS = 3
WARMUP_STEPS = 3  # batches 0..2 at k=1 without a limit; the limit applies from batch 3
STEPS_AFTER = 2  # batches after the recovering one; the memory check reads the last one
MEMORY_TOLERANCE = 0.01
PARAM_RTOL = 1e-4
#: What a real device OOM says (the caching allocator, the runtime, cuBLAS/cuDNN workspaces).
CUDA_OOM_MESSAGES = tuple(m for m in OOM_MESSAGES if m.startswith(("CUDA", "CUBLAS", "CUDNN")))

TRAINER_QUIET = {
    "accelerator": "cuda",
    "devices": 1,
    "precision": "32-true",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


# ----------------------------------------------------------------------------- models and data


class Classifier(pl.LightningModule):
    """ResNet-50 on uint8 images (normalised on the device), cross-entropy, SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = torchvision.models.resnet50(num_classes=1000)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images.float().div_(255)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class CausalLM(pl.LightningModule):
    """A small pre-norm causal transformer LM (nn.TransformerEncoder), next-token cross-entropy, AdamW.

    Dropout is off: a retried attempt draws random numbers the reference run does not (docs/oom-recovery.md's
    documented exception), which would hide the leaks this check looks for.
    """

    def __init__(
        self, vocab: int = 16384, width: int = 1024, heads: int = 16, layers: int = 4, seq_len: int = 512
    ) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = nn.Embedding(vocab, width)
            self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)
            layer = nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        length = inputs.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=inputs.device)
        hidden = self.encoder(self.embed(inputs) + self.position[:length], mask=mask, is_causal=True)
        logits = self.head(self.norm(hidden))
        # Every sequence has the same number of tokens, so the token mean is also a sample mean.
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Cycle(Dataset):
    """``length`` whole batches (``batch_size=None``), cycling over a few distinct ready-made ones."""

    def __init__(self, batches: list[tuple[Tensor, ...]], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:
        return self.batches[i % len(self.batches)]


def _image_batches(batch_size: int, size: int = 224, count: int = 3) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, generator=g),
            torch.randint(0, 1000, (batch_size,), generator=g),
        )
        for _ in range(count)
    ]


def _token_batches(
    batch_size: int, seq_len: int = 512, vocab: int = 16384, count: int = 3
) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g),) for _ in range(count)]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], pl.LightningModule]
    batches: Callable[[], list[tuple[Tensor, ...]]]
    batch_size: int


WORKLOADS = {
    "resnet50": Workload(
        "resnet50",
        "torchvision resnet50(num_classes=1000), 3x224x224, SGD momentum",
        Classifier,
        lambda: _image_batches(256),
        batch_size=256,
    ),
    "transformer": Workload(
        "transformer",
        "causal LM: nn.TransformerEncoder 4 x 1024 wide, 16 heads, 512 tokens, vocab 16384, AdamW",
        CausalLM,
        lambda: _token_batches(64),
        batch_size=64,
    ),
}


# ----------------------------------------------------------------------------- the device
# Every CUDA memory call of this script goes through these few functions.


def device_total() -> int:
    return torch.cuda.get_device_properties(0).total_memory


def set_limit(limit_bytes: int | None) -> None:
    """Confine this process to ``limit_bytes`` (``None``: the whole device) and drop cached blocks."""
    fraction = 1.0 if limit_bytes is None else limit_bytes / device_total()
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    gc.collect()
    torch.cuda.empty_cache()


def allocated() -> int:
    return torch.cuda.memory_allocated(0)


def peak() -> int:
    return torch.cuda.max_memory_allocated(0)


def reset_peak() -> None:
    torch.cuda.reset_peak_memory_stats(0)


def synchronize() -> None:
    torch.cuda.synchronize(0)


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 without TF32 and with deterministic cuDNN, so two equal computations agree to rounding."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ) = saved


# ----------------------------------------------------------------------------- instruments


class StepRecord(pl.Callback):
    """Per batch: device memory allocated at its start, the step's peak, its wall time, and k after it.

    Before reading the start of the batches in ``collect_at`` it collects garbage, so that the figure
    counts what is referenced, not unreferenced cycles that happen to await the collector.
    """

    def __init__(self, recovery: OOMRecovery | None = None, collect_at: tuple[int, ...] = ()) -> None:
        self.recovery = recovery
        self.collect_at = collect_at
        self.starts: list[int] = []
        self.peaks: list[int] = []
        self.seconds: list[float] = []
        self.ks: list[int] = []
        self._started = 0.0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx in self.collect_at:
            gc.collect()
        synchronize()
        self.starts.append(allocated())
        reset_peak()
        self._started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        synchronize()
        self.seconds.append(time.perf_counter() - self._started)
        self.peaks.append(peak())
        self.ks.append(self.recovery.k if self.recovery is not None else 1)


class LimitAt(pl.Callback):
    """Confines the process to ``limit_bytes`` from the start of one batch on."""

    def __init__(self, batch_idx: int, limit_bytes: int) -> None:
        self.batch_idx, self.limit_bytes = batch_idx, limit_bytes

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch_idx:
            set_limit(self.limit_bytes)


class FollowSchedule(pl.Callback):
    """The reference run: batch i runs as ``ks[i]`` micro-batches, as in the recovered run, with no OOM.

    It proposes k to the micro-batch engine the way the pack's own callbacks do (``MicroBatchEngine.propose``).
    """

    def __init__(self, ks: list[int]) -> None:
        self.ks = ks

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = MicroBatchEngine.get(trainer)
        engine.propose(
            self.ks[batch_idx], "reference", "the recovered run's micro-batch count for this batch"
        )


def _forced(k: int) -> OOMRecovery:
    recovery = OOMRecovery(verbose=False)
    if k > 1:
        recovery.load_state_dict({"k": k})
    return recovery


def fit(
    workload: Workload, batches: list[tuple[Tensor, ...]], steps: int, callbacks: list[pl.Callback]
) -> pl.LightningModule:
    """One seeded fit of ``steps`` batches; returns the trained module (on the CPU)."""
    set_limit(None)  # also collects what earlier fits left to the garbage collector
    pl.seed_everything(0, verbose=False)
    model = workload.build()
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, **TRAINER_QUIET)
    try:
        trainer.fit(model, DataLoader(Cycle(batches, steps), batch_size=None))
    finally:
        model.cpu()
        set_limit(None)
    return model


# ----------------------------------------------------------------------------- one workload


def calibrate(workload: Workload, batches: list[tuple[Tensor, ...]]) -> dict[str, Any]:
    peaks = {}
    for k in (1, CALIBRATION_K):
        record = StepRecord(collect_at=(CALIBRATION_STEPS - 1,))
        fit(workload, batches, CALIBRATION_STEPS, [record, _forced(k)])
        peaks[k] = record.peaks[-1]
    limit = (peaks[1] + peaks[CALIBRATION_K]) // 2
    return {
        "peak_k1_bytes": peaks[1],
        f"peak_k{CALIBRATION_K}_bytes": peaks[CALIBRATION_K],
        "limit_bytes": limit,
        "limit_fraction_of_device": limit / device_total(),
        "splitting_lowers_peak": peaks[CALIBRATION_K] < 0.97 * peaks[1],
    }


def _is_real_cuda_oom(message: str) -> bool:
    return "(simulated)" not in message and any(text in message for text in CUDA_OOM_MESSAGES)


def compare_states(got: nn.Module, want: nn.Module) -> dict[str, Any]:
    """Largest relative error ``||got - want|| / ||want||`` over parameters and floating buffers."""
    worst_key, worst_rel, worst_abs, mismatched_ints = None, 0.0, 0.0, []
    want_state = want.state_dict()
    for key, a in got.state_dict().items():
        b = want_state[key]
        if not a.is_floating_point():
            if not torch.equal(a, b):
                mismatched_ints.append(key)
            continue
        diff = a.double() - b.double()
        rel = (diff.norm() / b.double().norm().clamp_min(1e-30)).item()
        worst_abs = max(worst_abs, diff.abs().max().item())
        if rel > worst_rel:
            worst_key, worst_rel = key, rel
    return {
        "max_rel_error": worst_rel,
        "worst_tensor": worst_key,
        "max_abs_error": worst_abs,
        "mismatched_integer_buffers": mismatched_ints,
    }


def check_workload(workload: Workload) -> dict[str, Any]:
    started = time.perf_counter()
    batches = workload.batches()
    result: dict[str, Any] = {"description": workload.description, "batch_size": workload.batch_size}
    result["calibration"] = calibration = calibrate(workload, batches)
    if not calibration["splitting_lowers_peak"]:  # no limit can make a split fit where the full batch fails
        result.update(
            checks={"calibration_found_a_limit": False}, passed=False, wall_s=time.perf_counter() - started
        )
        return result
    limit = calibration["limit_bytes"]
    limit_at = WARMUP_STEPS
    steps = limit_at + 1 + STEPS_AFTER

    recovery = OOMRecovery()
    record = StepRecord(recovery, collect_at=(limit_at, steps - 1))
    run_error = None
    try:
        # LimitAt first: its empty_cache is not part of the recovering step's time.
        model = fit(workload, batches, steps, [LimitAt(limit_at, limit), record, recovery])
    except Exception as err:  # a failed recovery is a result: report it, run no reference
        run_error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    failures = [dataclasses.asdict(f) for f in recovery.failures]
    result.update(
        limit_at_batch=limit_at,
        steps=steps,
        failures=failures,
        retries=len(failures),
        final_k=recovery.k,
        k_per_batch=record.ks,
        step_start_allocated_bytes=record.starts,
        step_peak_bytes=record.peaks,
        step_ms=[1e3 * s for s in record.seconds],
        run_error=run_error,
    )
    checks = {
        "calibration_found_a_limit": True,
        "completed": run_error is None and len(record.ks) == steps,
        "real_cuda_oom": bool(failures) and all(_is_real_cuda_oom(f["message"]) for f in failures),
        "limit_forced_the_oom_at_its_batch": bool(failures)
        and failures[0]["batch_idx"] == limit_at
        and failures[0]["k"] == 1,
    }
    if checks["completed"]:
        before, later = record.starts[limit_at], record.starts[-1]
        drift = (later - before) / before
        result["memory"] = {
            "allocated_at_failing_step_start": before,
            "allocated_at_later_step_start": later,
            "relative_change": drift,
            "tolerance": MEMORY_TOLERANCE,
            "peak_after_limit_bytes": max(record.peaks[limit_at:]),
            "limit_bytes": limit,
        }
        checks["memory_returns_to_pre_oom"] = abs(drift) <= MEMORY_TOLERANCE
        checks["peaks_within_limit"] = max(record.peaks[limit_at:]) <= limit

        steady = record.seconds[1:limit_at]
        after = record.seconds[limit_at + 1 :]
        result["timing"] = {
            "steady_step_ms": 1e3 * min(steady),
            "recovering_step_ms": 1e3 * record.seconds[limit_at],
            "final_k_step_ms": 1e3 * min(after),
            "ratio_vs_steady": record.seconds[limit_at] / min(steady),
            "ratio_vs_final_k_step": record.seconds[limit_at] / min(after),
        }

        reference_recovery = _forced(1)
        reference_record = StepRecord(reference_recovery)
        reference = fit(
            workload, batches, steps, [reference_record, FollowSchedule(record.ks), reference_recovery]
        )
        comparison = compare_states(model, reference)
        comparison.update(
            reference_k_per_batch=reference_record.ks,
            reference_ooms=len(reference_recovery.failures),
            rtol=PARAM_RTOL,
        )
        result["parameters"] = comparison
        checks["reference_followed_the_schedule"] = (
            reference_record.ks == record.ks and not reference_recovery.failures
        )
        checks["parameters_match_reference"] = (
            comparison["max_rel_error"] <= PARAM_RTOL and not comparison["mismatched_integer_buffers"]
        )
    result["checks"] = checks
    result["passed"] = all(checks.values())
    result["wall_s"] = time.perf_counter() - started
    return result


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="directory for oom.json")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=list(WORKLOADS),
        help="which workloads to check (default: all)",
    )
    return parser.parse_args(argv)


def _summary_line(name: str, r: dict[str, Any]) -> str:
    if "checks" not in r:
        return f"{name}: ERROR {r.get('error')}"
    failed = [c for c, ok in r["checks"].items() if not ok]
    calibration = r["calibration"]
    parts = [
        f"{name}: {'PASS' if r['passed'] else 'FAIL ' + ', '.join(failed)}",
        f"peak k=1 {calibration['peak_k1_bytes'] / 2**30:.2f} GiB, "
        f"k={CALIBRATION_K} {calibration[f'peak_k{CALIBRATION_K}_bytes'] / 2**30:.2f} GiB",
    ]
    if "retries" in r:
        parts += [
            f"limit {calibration['limit_bytes'] / 2**30:.2f} GiB "
            f"({calibration['limit_fraction_of_device']:.1%} of the device)",
            f"retries {r['retries']}",
            f"final k {r['final_k']}",
        ]
    if "memory" in r:
        parts.append(f"allocated drift {r['memory']['relative_change']:+.3%}")
    if "timing" in r:
        parts.append(
            f"recovering step {r['timing']['recovering_step_ms']:.0f} ms "
            f"({r['timing']['ratio_vs_steady']:.1f}x a steady step)"
        )
    if "parameters" in r:
        parts.append(f"params max rel err {r['parameters']['max_rel_error']:.1e}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu/oom.py: no CUDA device visible (torch.cuda.is_available() is False); "
            "this check needs a real GPU and cannot pass without one",
            file=sys.stderr,
        )
        return 1
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings(
        "ignore", message=".*TF32.*"
    )  # torch >= 2.9 prefers fp32_precision; the flags still work

    properties = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "section": "oom",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": properties.name,
        "device_total_bytes": device_total(),
        "precision": TRAINER_QUIET["precision"],
        "tf32": False,
        "cudnn_deterministic": True,
        "models": {},
    }
    started = time.perf_counter()
    with exact_fp32():
        for name in args.models:
            print(f"oom: {name} ...", flush=True)
            try:
                results["models"][name] = check_workload(WORKLOADS[name])
            except Exception as err:  # keep going: the other workload's figures are still worth having
                traceback.print_exc()
                results["models"][name] = {"passed": False, "error": f"{type(err).__name__}: {err}"}
            print(_summary_line(name, results["models"][name]), flush=True)
    results["passed"] = all(r["passed"] for r in results["models"].values())
    results["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "oom.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"oom: {'PASS' if results['passed'] else 'FAIL'} ({results['wall_s']:.0f} s); wrote {path}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
