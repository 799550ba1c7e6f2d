"""GPU check sections about speed: ``mfu`` (a GPT-2-124M-shaped model, the default job), ``overhead``
(OOMRecovery at k = 1 against plain Lightning), ``goodput`` (what measuring the noise scale costs) and
``precision`` (PrecisionSwitch's ``auto`` against 32-true, TF32 and bf16-mixed).

Each section is a function of its sizes (a dict from the table in ``check.py``), run on the current
device (``device.py``): a real CUDA device, or the CPU under SimulatedMemory for ``--dry-run``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from common import figure, patched, spread
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from gpu import device
from lightning_gpuopt import (
    GPUOptReport,
    GradientNoiseScale,
    MemoryAwareBatchSize,
    OOMRecovery,
    PrecisionSwitch,
)

MODEL_KEYS = ("layers", "width", "heads", "vocab", "seq", "batch")


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU("tanh"), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln1(x)).split(c, 2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in qkv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    """GPT-2 124M's shape by default: 12 layers, width 768, 12 heads, vocab 50257, 1024 positions, tied head."""

    def __init__(
        self, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50257, seq: int = 1024
    ) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.wte.weight

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.wte(inputs) + self.wpe(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=self.device.type == "cuda")


class Tokens(Dataset):
    """``length`` random sequences of ``seq + 1`` tokens (made on access from the index: no memory held)."""

    def __init__(self, length: int, seq: int, vocab: int) -> None:
        self.length, self.seq, self.vocab = length, seq, vocab

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor]:
        generator = torch.Generator().manual_seed(i % 16)
        return (torch.randint(0, self.vocab, (self.seq + 1,), generator=generator),)


def gpt(sizes: dict[str, Any]) -> GPT:
    return GPT(sizes["layers"], sizes["width"], sizes["heads"], sizes["vocab"], sizes["seq"])


def gpt_fit(sizes: dict, steps: int, callbacks: list, batches: int = 0, **trainer: Any) -> pl.Trainer:
    """One seeded fit of the GPT of ``sizes`` over ``batches`` (default ``steps``) batches of its tokens."""
    device.check()
    pl.seed_everything(0, verbose=False)
    fitted = device.trainer(steps, callbacks, **trainer)
    tokens = Tokens(sizes["batch"] * (batches or steps), sizes["seq"], sizes["vocab"])
    fitted.fit(gpt(sizes), DataLoader(tokens, batch_size=sizes["batch"]))
    return fitted


class StepTimer(pl.Callback):
    """Wall time of the steps after ``warmup``, the device synchronised only at both ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.started, self.ended, self.timed = warmup, None, None, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        done = trainer.global_step
        if done >= self.warmup:
            device.current().synchronize()  # cheap next to a step; keeps the ends exact
            if done == self.warmup:
                self.started = time.perf_counter()
            else:
                self.ended, self.timed = time.perf_counter(), done - self.warmup

    @property
    def seconds_per_step(self) -> float | None:
        return (self.ended - self.started) / self.timed if self.timed else None


class StepEvents(pl.Callback):
    """A mark at the end of every batch: a CUDA event (no synchronisation per step), or the wall clock on a CPU."""

    def __init__(self) -> None:
        self.marks: list[Any] = []

    def on_train_batch_end(self, *args: Any) -> None:
        if device.current().kind == "cuda":
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def periods(self, warmup: int) -> list[float]:
        """Seconds from one batch's end to the next's, from batch ``warmup`` on (everything the loop runs)."""
        marks = self.marks[max(0, warmup - 1) :]
        if device.current().kind != "cuda":
            return [b - a for a, b in itertools.pairwise(marks)]
        device.current().synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]


def interleaved_pairs(
    names: tuple[str, str], timed_fit: Callable[[str], float], repeats: int, min_repeats: int
) -> dict[str, list[float]]:
    """``timed_fit(name)`` for both names, in alternating order, pair after pair: at most ``repeats`` pairs, and
    past ``min_repeats`` only while the section's slice has room for another. Returns each name's figures."""
    per_fit: dict[str, list[float]] = {name: [] for name in names}
    longest = 0.0
    for r in range(repeats):
        left = device.remaining()
        if r >= min_repeats and left is not None and left < 1.5 * longest:
            break
        started = time.perf_counter()
        for name in names if r % 2 == 0 else names[::-1]:
            per_fit[name].append(timed_fit(name))
        longest = max(longest, time.perf_counter() - started)
    return per_fit


def paired_fits(
    sizes: dict[str, Any], names: tuple[str, str], callbacks: Callable[[str], list], average=statistics.median
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Interleaved pairs of GPT fits, ``callbacks(name)`` in each, a fit's figure the ``average`` of its step
    periods after ``sizes["warmup"]``: each name's figures, and what the second costs over the first in % per
    pair (its :func:`spread`)."""

    def timed_fit(name: str) -> float:
        events = StepEvents()
        gpt_fit(sizes, sizes["steps"], [*callbacks(name), events], precision=sizes["precision"])
        return average(events.periods(sizes["warmup"]))

    per_fit = interleaved_pairs(names, timed_fit, sizes["repeats"], sizes["min_repeats"])
    return per_fit, spread([100 * (a / b - 1) for a, b in zip(per_fit[names[1]], per_fit[names[0]])])


def mfu_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """MFU and tokens/s of the GPT-2-shaped model (bf16-mixed), measured by GPUOptReport; the default job's samples/s."""
    on_cuda = device.current().kind == "cuda"
    steps, warmup = sizes["steps"], sizes["warmup"]
    peak_flops = None if on_cuda else sizes["nominal_peak_flops"]
    report = GPUOptReport(plot=False, table=False, peak_flops=peak_flops, dirpath=sizes["out"])
    timer = StepTimer(warmup)
    gpt_fit(sizes, steps, [report, timer], precision="bf16-mixed")
    run, per_step = report.report["run"], timer.seconds_per_step
    flops, peak = run["flops_per_batch"], run["peak_flops"]
    mfu = flops / per_step / peak if flops and per_step and peak else None
    shape = "GPT ({layers} layers, width {width}, seq {seq}, batch {batch})".format(**sizes)
    target = f">= {sizes['mfu_target']:.0%}" if on_cuda else "reported (CPU: nominal peak)"
    met = (mfu is not None and mfu >= sizes["mfu_target"]) if on_cuda else None
    tokens = sizes["batch"] * sizes["seq"] / per_step if per_step else None
    figures = [figure(f"{shape}, bf16-mixed: tokens/s", tokens, "tokens/s")]
    figures.append(figure(f"{shape}, bf16-mixed: MFU", mfu, "", target, met))
    mfus = [s["mfu"] for s in report.report["steps"] if s["mfu"] is not None and s["mfu"] == s["mfu"]]
    details: dict[str, Any] = {"model": {k: sizes[k] for k in MODEL_KEYS}}
    details.update(parameters=sum(p.numel() for p in gpt(sizes).parameters()), flops_per_batch=flops)
    details.update(peak_flops=peak, peak_flops_source=run["peak_flops_source"], mfu_note=run["mfu_note"])
    details.update(seconds_per_step=per_step, report_mfu_median=statistics.median(mfus) if mfus else None)
    device.check()
    from lightning_gpuopt.demos import ImageClassifier, SyntheticImageDataModule

    job = sizes["default_job"]
    job_timer = StepTimer(job["warmup"])
    sizes_ = {"val_size": job["batch"], "image_size": job["image_size"], "batch_size": job["batch"]}
    data = SyntheticImageDataModule(train_size=job["batch"] * job["steps"], **sizes_)
    pl.seed_everything(42, verbose=False)
    callbacks = [PrecisionSwitch(), MemoryAwareBatchSize(), OOMRecovery(verbose=False)]
    callbacks += [GPUOptReport(plot=False, table=False, dirpath=sizes["out"]), job_timer]
    trainer = device.trainer(job["steps"], callbacks, limit_val_batches=0)
    trainer.fit(ImageClassifier(), datamodule=data)
    seconds = job_timer.seconds_per_step
    rate = job["batch"] / seconds if seconds else None
    size = f"{job['image_size']}x{job['image_size']}"
    what = f"default job (ResNet-18, {size}, batch {job['batch']}, the CLI's callbacks): samples/s"
    figures.append(figure(what, rate, "samples/s"))
    details["default_job"] = {"precision": str(trainer.precision), "seconds_per_step": seconds}
    return {"figures": figures, "details": details}


def overhead_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """Steady-state step time with OOMRecovery at k = 1 against plain Lightning: interleaved pairs of fits.

    Each step is timed from CUDA events (one at every batch end, no synchronisation per step); a fit's
    figure is the median of its steady steps, a pair's the ratio of its two fits, and the result the
    median over pairs (robust to a pair disturbed by something else on the machine), with its spread.
    Pairs run while the slice has room for another (at least ``min_repeats``, at most ``repeats``).
    """
    steps, warmup, precision = sizes["steps"], sizes["warmup"], sizes["precision"]
    gpt_fit(sizes, warmup + 1, [], steps, precision=precision)  # untimed: first-use costs
    recovery = lambda name: [OOMRecovery(verbose=False)] if name == "OOMRecovery" else []  # noqa: E731
    per_fit, percent = paired_fits(sizes, ("plain", "OOMRecovery"), recovery)
    clock = "CUDA events" if device.current().kind == "cuda" else "the wall clock"
    name = (
        f"OOMRecovery k=1 overhead vs plain Lightning (median of {percent['n']} interleaved pairs of fits, each the "
        f"median of {steps - warmup} steps timed by {clock}; IQR {percent['q1']:+.1f}..{percent['q3']:+.1f} %, "
        f"min..max {percent['min']:+.1f}..{percent['max']:+.1f} %)"
    )
    met = percent["median"] <= sizes["target_percent"] if device.current().kind == "cuda" else None
    finder = MemoryAwareBatchSize(verbose=False)  # the default search: its time and its trial steps here
    gpt_fit(sizes, 1, [finder], steps, precision=precision)
    search = {"seconds": finder.search_seconds, "trials": finder.trials}
    details = {"batch_size_search": search, "seconds_per_step": {k: spread(v) for k, v in per_fit.items()}}
    details.update(overhead_percent=percent, model={k: sizes[k] for k in MODEL_KEYS})
    what = f"MemoryAwareBatchSize() search wall time, {search['trials']} trial steps"
    figures = [figure(name, percent["median"], "%", f"<= {sizes['target_percent']} %", met)]
    return {"figures": [*figures, figure(what, search["seconds"], "s")], "details": details}


def steady_noise_scale(every: int = 10) -> GradientNoiseScale:
    """A GradientNoiseScale already at its steady cadence (every ``every``-th step), as after its estimate is trusted."""
    return GradientNoiseScale(every=every, min_measurements=1, trust=math.inf)


def goodput_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The noise scale of the GPT-2-shaped model, and GradientNoiseScale's cost beside OOMRecovery at k = 1
    against OOMRecovery alone in its steady state (a measured step every ``every`` steps: the split into 2
    micro-batches and two gradient norms), from interleaved pairs of fits. A fit's figure is the *mean* of its
    steady steps (a median would hide the measured ones)."""
    steps, warmup, every, precision = sizes["steps"], sizes["warmup"], sizes["every"], sizes["precision"]
    noise = GradientNoiseScale()
    gpt_fit(sizes, sizes["estimate_steps"], [OOMRecovery(verbose=False), noise], precision=precision)
    value = noise.ema.value
    noise_scale = lambda name: [steady_noise_scale(every)] if name == "noise scale" else []  # noqa: E731
    callbacks = lambda name: [OOMRecovery(verbose=False), *noise_scale(name)]  # noqa: E731
    per_fit, percent = paired_fits(sizes, ("OOMRecovery", "noise scale"), callbacks, statistics.fmean)
    on_cuda = device.current().kind == "cuda"
    name = (
        f"GradientNoiseScale overhead vs OOMRecovery k=1 (every {every}th step measured; median of {percent['n']} "
        f"interleaved pairs, each the mean of {steps - warmup} steps; IQR {percent['q1']:+.1f}..{percent['q3']:+.1f} %, "
        f"min..max {percent['min']:+.1f}..{percent['max']:+.1f} %)"
    )
    b_simple = (
        f"B_simple of the GPT-2-shaped model after {sizes['estimate_steps']} steps (samples; relative error "
        f"{noise.relative_error:.2f})"
    )
    target, met = f"<= {sizes['target_percent']} %", percent["median"] <= sizes["target_percent"]
    figures = [figure(b_simple, None if value is None else round(value, 1))]
    figures.append(figure(name, percent["median"], "%", target, met if on_cuda else None))
    details = {"noise_scale": value, "measurements": noise.ema.count}
    details.update(seconds_per_step={k: spread(v) for k, v in per_fit.items()}, overhead_percent=percent)
    return {"figures": figures, "details": details}


def tf32(enabled: bool) -> contextlib.AbstractContextManager:
    """TF32 matmuls and convolutions on or off (torch's ``fp32_precision`` API where it exists), restored after."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        return patched(*((o, "fp32_precision", "tf32" if enabled else "ieee") for o in (matmul, cudnn.conv)))
    return patched((matmul, "allow_tf32", enabled), (cudnn, "allow_tf32", enabled))


def precision_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """PrecisionSwitch's ``auto`` choice and its throughput against 32-true, TF32 and bf16-mixed, same batch."""
    on_cuda = device.current().kind == "cuda"
    steps, warmup = sizes["steps"], sizes["warmup"]
    configs = {"32-true": ("32-true", False), "tf32": ("32-true", True), "bf16-mixed": ("bf16-mixed", False)}
    skipped = {}
    if not on_cuda:
        skipped["tf32"] = "TF32 is a mode of CUDA tensor cores; a CPU has none"
        del configs["tf32"]
    rates: dict[str, list[float]] = {name: [] for name in [*configs, "auto"]}
    chosen, order = None, [*configs, "auto"]
    for r in range(sizes["repeats"]):
        for name in order if r % 2 == 0 else order[::-1]:
            timer = StepTimer(warmup)
            if name == "auto":
                chosen = str(gpt_fit(sizes, steps, [PrecisionSwitch(), timer]).precision)
            else:
                with tf32(configs[name][1]):
                    gpt_fit(sizes, steps, [timer], precision=configs[name][0])
            if timer.seconds_per_step:
                rates[name].append(sizes["batch"] / timer.seconds_per_step)
    medians = {name: statistics.median(v) for name, v in rates.items() if v}
    fixed = {name: value for name, value in medians.items() if name != "auto"}
    fastest = max(fixed, key=fixed.get)
    ratio = medians["auto"] / fixed[fastest]
    figures = [figure(f"samples/s in {name}", value, "samples/s") for name, value in fixed.items()]
    figures.append(figure("PrecisionSwitch auto: chosen precision", chosen))
    what = f"PrecisionSwitch auto: samples/s over the fastest ({fastest})"
    met = ratio >= 0.95 if on_cuda else None
    figures.append(figure(what, ratio, "x", ">= 0.95", met))
    details = {"samples_per_s": {k: spread(v) for k, v in rates.items() if v}, "chosen": chosen}
    return {"figures": figures, "details": details, "skipped": skipped}
