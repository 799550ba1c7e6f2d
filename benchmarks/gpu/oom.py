"""GPU check section ``oom``: OOMRecovery against real CUDA out-of-memory errors.

For a ResNet-50 and a causal transformer LM (fp32, TF32 off, deterministic cuDNN): the limit sits halfway
between the steady peaks at k=1 and k=8; a run with ``OOMRecovery()`` is confined to it after a few steps, so
the next step raises a real CUDA OOM and is retried with more micro-batches. Checks: the run completes; the
memory at a later step's start is within 1 % of the failing step's; and DESIGN.md's "same training" measure
``‖Δθ − Δθ_ref‖ / ‖Δθ_ref‖`` against runs at the same k per batch without a limit stays within the case's
floor (twice the spread of two such runs, at least 1e-4). The difference to a run at k = 1 is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torchvision
from common import Batches, Classifier, figure, patched
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from gpu import device
from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.microbatch import MicroBatchEngine

CALIBRATION_K = 8
CALIBRATION_STEPS = 3
WARMUP_STEPS = 3  # batches 0..2 at k=1 without a limit; the limit applies from batch 3
STEPS_AFTER = 2  # batches after the recovering one; the memory check reads the last one
MEMORY_TOLERANCE = 0.01
PARAM_RTOL = 1e-4
#: k changes a step proposes at its end, for the next batch (the others apply to the batch that runs).
NEXT_BATCH_SOURCES = ("grow back", "thrash", "memory")


def tiny_cnn(num_classes: int = 10) -> nn.Module:
    """Two convolutions with BatchNorm: the dry run's stand-in for a ResNet."""
    return nn.Sequential(
        *(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
        *(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()),
        *(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes)),
    )


def cnn(arch: str = "resnet50", num_classes: int = 1000) -> Classifier:
    """A torchvision model (``arch``) or :func:`tiny_cnn`, on uint8 images, SGD with momentum."""
    if arch == "tiny":
        return Classifier(lambda: tiny_cnn(num_classes))
    return Classifier(lambda: torchvision.models.get_model(arch, num_classes=num_classes))


class CausalLM(pl.LightningModule):
    """A small pre-norm causal transformer LM (nn.TransformerEncoder), next-token cross-entropy, AdamW.

    Dropout is off: a retried attempt draws random numbers the reference run does not (the documented
    exception), which would hide the leaks this check looks for.
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
                width, heads, 4 * width, 0.0, batch_first=True, norm_first=True
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
        # Every sequence has the same number of tokens, so the token mean is also a sample mean.
        return F.cross_entropy(self.head(self.norm(hidden)).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def image_batches(batch_size: int, size: int = 224, count: int = 3, num_classes: int = 1000) -> list:
    g, shape = torch.Generator().manual_seed(0), (batch_size, 3, size, size)
    images = lambda: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)  # noqa: E731
    return [(images(), torch.randint(0, num_classes, (batch_size,), generator=g)) for _ in range(count)]


def token_batches(batch_size: int, seq_len: int = 512, vocab: int = 16384, count: int = 3) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g),) for _ in range(count)]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], pl.LightningModule]
    batches: Callable[[], list[tuple[Tensor, ...]]]
    batch_size: int
    #: Why splitting changes the result (reported against the unsplit run); ``None``: it does not.
    split_changes: str | None = None
    #: The attribute holding the network that compile.py's ``submodule`` form compiles.
    submodule: str = "net"


def cnn_workload(image_size: int, batch_size: int, arch: str = "tiny", num_classes: int = 10) -> Workload:
    name = "2-conv CNN with BatchNorm" if arch == "tiny" else f"torchvision {arch}"
    what = f"{name} on 3x{image_size}x{image_size}, {num_classes} classes, SGD momentum"
    batches = lambda: image_batches(batch_size, image_size, num_classes=num_classes)  # noqa: E731
    build = lambda: cnn(arch, num_classes)  # noqa: E731
    return Workload("cnn", what, build, batches, batch_size, "BatchNorm statistics over micro-batches")


def lm_workload(
    width: int, layers: int, heads: int, seq_len: int, vocab: int, batch_size: int, count: int = 3
) -> Workload:
    what = f"causal LM: nn.TransformerEncoder {layers} x {width} wide, {heads} heads, {seq_len} tokens, vocab {vocab}"
    build = lambda: CausalLM(vocab=vocab, width=width, heads=heads, layers=layers, seq_len=seq_len)  # noqa: E731
    batches = lambda: token_batches(batch_size, seq_len, vocab, count)  # noqa: E731
    return Workload("transformer", f"{what}, AdamW", build, batches, batch_size, submodule="encoder")


def workload(name: str, batch_size: int, dry_run: bool = False) -> Workload:
    """The workload ``name`` at ``batch_size`` (check.py's table fits it under the section's cap); ``dry_run``:
    its stand-in on the CPU under SimulatedMemory (the same code paths, tiny sizes, its own batch size)."""
    if name == "resnet50":
        made = cnn_workload(16, 32) if dry_run else cnn_workload(224, batch_size, "resnet50", 1000)
    else:
        made = lm_workload(*((64, 2, 4, 32, 256, 16) if dry_run else (1024, 4, 16, 512, 16384, batch_size)))
    prefix = "dry run: " if dry_run else ""
    return dataclasses.replace(made, name=name, description=prefix + made.description)


def exact_fp32() -> contextlib.AbstractContextManager:
    """fp32 without TF32 and with deterministic cuDNN, so two equal computations agree to rounding."""
    cudnn = torch.backends.cudnn
    flags = [(torch.backends.cuda.matmul, "allow_tf32", False), (cudnn, "allow_tf32", False)]
    return patched(*flags, (cudnn, "deterministic", True), (cudnn, "benchmark", False))


class StepRecord(pl.Callback):
    """Per batch: memory allocated at its start, the step's peak, its wall time, and the k it ran at.

    Before reading the start of the batches in ``collect_at`` it collects garbage, so that the figure
    counts what is referenced, not unreferenced cycles that happen to await the collector.
    """

    def __init__(self, collect_at: tuple[int, ...] = ()) -> None:
        self.collect_at, self._started, self._changes = collect_at, 0.0, 0
        self.starts, self.peaks, self.seconds, self.ks = [], [], [], []  # bytes, bytes, seconds, k per batch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx in self.collect_at:
            gc.collect()
        engine = MicroBatchEngine.get(trainer)
        self._changes = len(engine.history) if engine else 0
        the_device = device.current()
        the_device.synchronize()
        self.starts.append(the_device.allocated())
        the_device.reset_peak()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        device.current().synchronize()
        self.seconds.append(time.perf_counter() - self._started)
        self.peaks.append(device.current().peak())
        engine = MicroBatchEngine.get(trainer)
        changes = engine.history[self._changes :] if engine else []
        ran = changes[-1].k_before if changes and changes[-1].source in NEXT_BATCH_SOURCES else None
        self.ks.append(ran or (engine.k if engine else 1))


class LimitAt(pl.Callback):
    """Confines the process to ``limit_bytes`` from the start of one batch on."""

    def __init__(self, batch_idx: int, limit_bytes: int) -> None:
        self.batch_idx, self.limit_bytes = batch_idx, limit_bytes

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx:
            device.current().set_limit(self.limit_bytes)


class FollowSchedule(pl.Callback):
    """A reference run: batch i runs as ``ks[i]`` micro-batches, with no OOM (proposed as the pack's callbacks do)."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = ks

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        MicroBatchEngine.get(trainer).propose(self.ks[batch_idx], "reference", "the recovered run's k")


def forced(k: int) -> OOMRecovery:
    """OOMRecovery starting at k micro-batches (no OOM needed)."""
    recovery = OOMRecovery(verbose=False)
    if k > 1:
        recovery.load_state_dict({"k": k})
    return recovery


def train(
    workload: Workload, batches: list, steps: int, callbacks: list, precision: str = "32-true", prepare=None
) -> pl.Trainer:
    """One seeded fit of ``steps`` batches (``prepare``: what makes the module that fits, e.g. compiles it)."""
    device.current().set_limit(None)  # also collects what earlier fits left to the garbage collector
    pl.seed_everything(0, verbose=False)
    model = workload.build()
    trainer = device.trainer(steps, callbacks, precision=precision)
    loader = DataLoader(Batches(batches, steps), batch_size=None)
    try:
        trainer.fit(prepare(model) if prepare else model, loader)
    finally:
        model.cpu()
        device.current().set_limit(None)
    return trainer


def fit(workload: Workload, batches: list, steps: int, callbacks: list[pl.Callback]) -> pl.LightningModule:
    """One seeded fit of ``steps`` batches; returns the trained module (on the CPU)."""
    return train(workload, batches, steps, callbacks).lightning_module


def steady_step(workload: Workload, batches: list, k: int, precision: str = "32-true") -> tuple[int, int]:
    """The memory at the start of the last of ``CALIBRATION_STEPS`` unlimited steps at ``k``, and its peak."""
    record = StepRecord(collect_at=(CALIBRATION_STEPS - 1,))
    train(workload, batches, CALIBRATION_STEPS, [record, forced(k)], precision)
    return record.starts[-1], record.peaks[-1]


def calibrate(workload: Workload, batches: list) -> dict[str, Any]:
    """The limit halfway between the steady peaks at k = 1 and k = ``CALIBRATION_K``."""
    peaks = {k: steady_step(workload, batches, k)[1] for k in (1, CALIBRATION_K)}
    limit = (peaks[1] + peaks[CALIBRATION_K]) // 2
    return {
        "peak_k1_bytes": peaks[1],
        f"peak_k{CALIBRATION_K}_bytes": peaks[CALIBRATION_K],
        "limit_bytes": limit,
        "limit_fraction_of_device": limit / device.current().total(),
        "splitting_lowers_peak": peaks[CALIBRATION_K] < 0.97 * peaks[1],
    }


def same_training(got: nn.Module, want: nn.Module, start: dict[str, Tensor]) -> dict[str, Any]:
    """DESIGN.md's measure ``‖Δθ − Δθ_ref‖ / ‖Δθ_ref‖`` over the parameters, and the buffers' largest relative error."""
    parameters = {name for name, _ in want.named_parameters()}
    want_state, diff, moved, worst, buffers, ints = want.state_dict(), 0.0, 0.0, (None, 0.0), 0.0, []
    for key, a in got.state_dict().items():
        b = want_state[key]
        if not a.is_floating_point():
            if not torch.equal(a, b):
                ints.append(key)
            continue
        a, b = a.double(), b.double()
        if key in parameters:
            step, ref_step = (a - b).norm().item() ** 2, (b - start[key].double()).norm().item() ** 2
            diff, moved = diff + step, moved + ref_step
            relative = (step / ref_step) ** 0.5 if ref_step else float(step > 0)
            worst = max(worst, (key, relative), key=lambda item: item[1])
        else:
            buffers = max(buffers, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    result = {"same_training": (diff / moved) ** 0.5 if moved else float(diff > 0)}
    result.update(worst_tensor=worst[0], worst_tensor_error=worst[1], buffers_max_rel_error=buffers)
    return {**result, "mismatched_integer_buffers": ints}


def check_workload(workload: Workload) -> dict[str, Any]:
    started = time.perf_counter()
    batches = workload.batches()
    result: dict[str, Any] = {"description": workload.description, "batch_size": workload.batch_size}
    result["calibration"] = calibration = calibrate(workload, batches)
    if not calibration["splitting_lowers_peak"]:  # no limit can make a split fit where the full batch fails
        result.update(checks={"calibration_found_a_limit": False}, passed=False)
        return result
    limit, limit_at = calibration["limit_bytes"], WARMUP_STEPS
    steps = limit_at + 1 + STEPS_AFTER
    recovery = OOMRecovery()
    record = StepRecord(collect_at=(limit_at, steps - 1))
    run_error = None
    try:  # LimitAt first: its empty_cache is not part of the recovering step's time
        model = fit(workload, batches, steps, [LimitAt(limit_at, limit), record, recovery])
    except Exception as err:  # a failed recovery is a result: report it, run no reference
        run_error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    failures = [dataclasses.asdict(f) for f in recovery.failures]
    result.update(limit_at_batch=limit_at, steps=steps, failures=failures, retries=len(failures))
    result.update(final_k=recovery.k, k_per_batch=record.ks, step_start_allocated_bytes=record.starts)
    result.update(
        step_peak_bytes=record.peaks, step_ms=[1e3 * s for s in record.seconds], run_error=run_error
    )
    checks = {"calibration_found_a_limit": True, "completed": run_error is None and len(record.ks) == steps}
    real = [device.current().is_its_oom(f["message"]) for f in failures]
    checks["real_oom_of_the_device"] = bool(failures) and all(real)
    first = (failures[0]["batch_idx"], failures[0]["k"]) if failures else None
    checks["limit_forced_the_oom_at_its_batch"] = first == (limit_at, 1)
    if checks["completed"]:
        before, later = record.starts[limit_at], record.starts[-1]
        peak_after = max(record.peaks[limit_at:])
        memory = {"allocated_at_failing_step_start": before, "allocated_at_later_step_start": later}
        memory.update(relative_change=(later - before) / before, tolerance=MEMORY_TOLERANCE)
        result["memory"] = {**memory, "peak_after_limit_bytes": peak_after, "limit_bytes": limit}
        checks["memory_returns_to_pre_oom"] = abs(later - before) / before <= MEMORY_TOLERANCE
        checks["peaks_within_limit"] = peak_after <= limit
        steady, after = min(record.seconds[1:limit_at]), min(record.seconds[limit_at + 1 :])
        recovering = record.seconds[limit_at]
        timing = {"steady_step_ms": 1e3 * steady, "recovering_step_ms": 1e3 * recovering}
        timing.update(final_k_step_ms=1e3 * after, ratio_vs_steady=recovering / steady)
        result["timing"] = {**timing, "ratio_vs_final_k_step": recovering / after}
        result["parameters"] = compare_with_references(workload, batches, steps, model, record.ks)
        checks["reference_followed_the_schedule"] = result["parameters"]["reference_followed_the_schedule"]
        checks["parameters_match_reference"] = result["parameters"]["no_trace"]
    result["checks"] = checks
    result["passed"] = all(checks.values())
    result["wall_s"] = time.perf_counter() - started
    return result


def compare_with_references(
    workload: Workload, batches: list, steps: int, model: nn.Module, ks: list
) -> dict:
    """The recovered run against two runs at its k per batch (no limit: the floor is their spread), and one at k=1."""
    start = {k: v.detach().clone() for k, v in workload.build().state_dict().items()}
    recovery, record = forced(1), StepRecord()
    reference = fit(workload, batches, steps, [FollowSchedule(ks), record, recovery])
    comparison = same_training(model, reference, start)
    second = fit(workload, batches, steps, [FollowSchedule(ks), forced(1)])
    spread = same_training(second, reference, start)
    unsplit = same_training(model, fit(workload, batches, steps, [forced(1)]), start)
    floor = max(2 * spread["same_training"], PARAM_RTOL)
    buffer_floor = max(2 * spread["buffers_max_rel_error"], PARAM_RTOL)
    comparison.update(reference_spread=spread["same_training"], floor=floor, buffers_floor=buffer_floor)
    comparison.update(reference_k_per_batch=record.ks, reference_ooms=len(recovery.failures))
    comparison["reference_followed_the_schedule"] = record.ks == ks and not recovery.failures
    comparison.update(vs_unsplit=unsplit["same_training"], vs_unsplit_worst_tensor=unsplit["worst_tensor"])
    comparison["split_changes"] = workload.split_changes
    comparison["no_trace"] = (
        comparison["same_training"] <= floor
        and comparison["buffers_max_rel_error"] <= buffer_floor
        and not comparison["mismatched_integer_buffers"]
    )
    return comparison


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The check's ``oom`` section: each workload's figures for the table, every detail for the JSON."""
    on_cuda = device.current().kind == "cuda"
    figures, details = [], {}
    with exact_fp32():
        for name in sizes["models"]:
            device.check()
            details[name] = r = check_workload(workload(name, sizes["batch"].get(name, 0), not on_cuda))
            checks, params, memory = r["checks"], r.get("parameters", {}), r.get("memory")
            recovered = all(checks.get(c, False) for c in ("completed", "real_oom_of_the_device"))
            met = recovered and checks.get("limit_forced_the_oom_at_its_batch", False)
            retries = f"{r.get('retries')} retries, k {r.get('final_k')}"
            target = "real OOM at its batch, run completes"
            figures.append(figure(f"{name}: OOM retries, final k", retries, "", target, met))
            spread, floor = params.get("reference_spread", float("nan")), params.get("floor", float("nan"))
            no_trace = (
                f"{name}: recovery leaves no trace: same training (‖Δθ−Δθ_ref‖/‖Δθ_ref‖) as a run at the same k per "
                f"batch without OOM (floor: 2 × the spread of two such runs, {spread:.1e}, at least {PARAM_RTOL:.0e})"
            )
            met = checks.get("parameters_match_reference", False)
            figures.append(figure(no_trace, params.get("same_training"), "", f"<= {floor:.1e}", met))
            why = params.get("split_changes") or "rounding of the split sums"
            unsplit = f"{name}: same training vs a run at k = 1 throughout ({why})"
            figures.append(figure(unsplit, params.get("vs_unsplit"), "", "reported"))
            change = None if not memory else 100 * memory["relative_change"]
            met = checks.get("memory_returns_to_pre_oom", False)
            what = f"{name}: memory_allocated after recovery vs pre-OOM"
            figures.append(figure(what, change, "%", "<= +1 %", met))
    return {"figures": figures, "details": details}
