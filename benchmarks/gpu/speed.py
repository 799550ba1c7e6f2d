"""GPU check sections about speed: ``mfu`` (GPT-2-124M-shaped model, the default job), ``overhead`` (OOMRecovery
at k = 1 against plain Lightning) and ``precision`` (PrecisionSwitch's ``auto`` against 32-true, TF32, bf16-mixed).

Each section is a function of its sizes (a dict from the table in ``check.py``), run on the current
device (``device.py``): a real CUDA device, or the CPU under SimulatedMemory for ``--dry-run``.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import device
import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import GPUOptReport, MemoryAwareBatchSize, OOMRecovery, PrecisionSwitch

QUIET = {
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


# ----------------------------------------------------------------------------- a GPT-2-shaped model


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
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
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=self.device.type == "cuda")


class Tokens(Dataset):
    """``length`` random sequences of ``seq + 1`` tokens (made on access from the index: no memory held)."""

    def __init__(self, length: int, seq: int, vocab: int) -> None:
        self.length, self.seq, self.vocab = length, seq, vocab

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor]:
        g = torch.Generator().manual_seed(i % 16)
        return (torch.randint(0, self.vocab, (self.seq + 1,), generator=g),)


def _gpt(sizes: dict[str, Any]) -> GPT:
    return GPT(sizes["layers"], sizes["width"], sizes["heads"], sizes["vocab"], sizes["seq"])


def _tokens(sizes: dict[str, Any], steps: int) -> DataLoader:
    return DataLoader(Tokens(sizes["batch"] * steps, sizes["seq"], sizes["vocab"]), batch_size=sizes["batch"])


class StepTimer(pl.Callback):
    """Wall time of the steps after ``warmup``, the device synchronised only at both ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.started, self.ended, self.timed = warmup, None, None, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        done = trainer.global_step
        if done == self.warmup:
            device.current().synchronize()
            self.started = time.perf_counter()
        elif done > self.warmup:
            device.current().synchronize()  # cheap next to a step; keeps the end exact
            self.ended, self.timed = time.perf_counter(), done - self.warmup

    @property
    def seconds_per_step(self) -> float | None:
        if self.started is None or self.ended is None or not self.timed:
            return None
        return (self.ended - self.started) / self.timed


def _fit(
    model: pl.LightningModule, loader: DataLoader, steps: int, callbacks: list, **trainer: Any
) -> pl.Trainer:
    device.check()
    pl.seed_everything(0, verbose=False)
    t = pl.Trainer(
        max_steps=steps,
        accelerator=device.current().accelerator,
        callbacks=[device.Deadline(), *callbacks],
        **{**QUIET, **trainer},
    )
    t.fit(model, loader)
    return t


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def figure(name: str, value: Any, unit: str = "", target: str | None = None, met: bool | None = None) -> dict:
    """One row of gpu_check.md: a figure, its unit, its target (if any) and whether it was met."""
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met}


# ----------------------------------------------------------------------------- section: mfu


def mfu_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """MFU and tokens/s of the GPT-2-shaped model (bf16-mixed), measured by GPUOptReport; the default job's samples/s."""
    on_cuda = device.current().kind == "cuda"
    peak_override = None if on_cuda else sizes["nominal_peak_flops"]
    steps, warmup = sizes["steps"], sizes["warmup"]
    report = GPUOptReport(plot=False, table=False, peak_flops=peak_override, dirpath=sizes["out"])
    timer = StepTimer(warmup)
    _fit(_gpt(sizes), _tokens(sizes, steps), steps, [report, timer], precision="bf16-mixed")
    run = report.report["run"]
    per_step = timer.seconds_per_step
    flops = run["flops_per_batch"]
    peak = run["peak_flops"]
    mfu = flops / per_step / peak if flops and per_step and peak else None
    tokens_per_s = sizes["batch"] * sizes["seq"] / per_step if per_step else None
    shape = f"GPT ({sizes['layers']} layers, width {sizes['width']}, seq {sizes['seq']}, batch {sizes['batch']}), bf16-mixed"
    figures = [
        figure(f"{shape}: tokens/s", tokens_per_s, "tokens/s"),
        figure(
            f"{shape}: MFU",
            mfu,
            "",
            f">= {sizes['mfu_target']:.0%}" if on_cuda else "reported (CPU: nominal peak)",
            (mfu is not None and mfu >= sizes["mfu_target"]) if on_cuda else None,
        ),
    ]
    details: dict[str, Any] = {
        "model": {k: sizes[k] for k in ("layers", "width", "heads", "vocab", "seq", "batch")},
        "parameters": sum(p.numel() for p in _gpt(sizes).parameters()),
        "flops_per_batch": flops,
        "peak_flops": peak,
        "peak_flops_source": run["peak_flops_source"],
        "mfu_note": run["mfu_note"],
        "seconds_per_step": per_step,
        "report_mfu_median": _median([s["mfu"] for s in report.report["steps"]]),
    }
    device.check()
    from lightning_gpuopt.demos import ImageClassifier, SyntheticImageDataModule

    default = sizes["default_job"]
    job_report, job_timer = (
        GPUOptReport(plot=False, table=False, dirpath=sizes["out"]),
        StepTimer(default["warmup"]),
    )
    data = SyntheticImageDataModule(
        train_size=default["batch"] * default["steps"],
        val_size=default["batch"],
        image_size=default["image_size"],
        batch_size=default["batch"],
    )
    pl.seed_everything(42, verbose=False)
    trainer = pl.Trainer(
        max_steps=default["steps"],
        accelerator=device.current().accelerator,
        callbacks=[
            device.Deadline(),
            PrecisionSwitch(),
            MemoryAwareBatchSize(),
            OOMRecovery(verbose=False),
            job_report,
            job_timer,
        ],
        limit_val_batches=0,
        **QUIET,
    )
    trainer.fit(ImageClassifier(), datamodule=data)
    job_rate = default["batch"] / job_timer.seconds_per_step if job_timer.seconds_per_step else None
    figures.append(
        figure(
            f"default job (ResNet-18, {default['image_size']}x{default['image_size']}, batch {default['batch']}, "
            "the CLI's callbacks): samples/s",
            job_rate,
            "samples/s",
        )
    )
    details["default_job"] = {
        "precision": str(trainer.precision),
        "seconds_per_step": job_timer.seconds_per_step,
    }
    return {"figures": figures, "details": details}


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(present) if present else None


# ----------------------------------------------------------------------------- section: overhead


def overhead_section(sizes: dict[str, Any]) -> dict[str, Any]:
    """Steady-state step time with OOMRecovery at k = 1 against plain Lightning, interleaved repeats."""
    steps, warmup, repeats = sizes["steps"], sizes["warmup"], sizes["repeats"]
    times: dict[str, list[float]] = {"plain": [], "OOMRecovery": []}
    for r in range(repeats):
        for name in ("plain", "OOMRecovery") if r % 2 == 0 else ("OOMRecovery", "plain"):
            timer = StepTimer(warmup)
            extra = [OOMRecovery(verbose=False)] if name == "OOMRecovery" else []
            _fit(_gpt(sizes), _tokens(sizes, steps), steps, [*extra, timer], precision=sizes["precision"])
            times[name].append(timer.seconds_per_step)
    ratios = [a / b for a, b in zip(times["OOMRecovery"], times["plain"])]
    spread = _spread([100 * (r - 1) for r in ratios])
    met = spread["median"] <= sizes["target_percent"]
    return {
        "figures": [
            figure(
                f"OOMRecovery k=1 overhead vs plain Lightning (median of {repeats} interleaved repeats, "
                f"min..max {spread['min']:+.1f}..{spread['max']:+.1f} %)",
                spread["median"],
                "%",
                f"<= {sizes['target_percent']} %",
                met if device.current().kind == "cuda" else None,
            )
        ],
        "details": {
            "seconds_per_step": {k: _spread(v) for k, v in times.items()},
            "overhead_percent": spread,
            "model": {k: sizes[k] for k in ("layers", "width", "heads", "vocab", "seq", "batch")},
        },
    }


# ----------------------------------------------------------------------------- section: precision


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 matmuls and convolutions on or off (torch's ``fp32_precision`` API where it exists), restored after."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        saved = (matmul.fp32_precision, cudnn.conv.fp32_precision)
        matmul.fp32_precision = cudnn.conv.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision, cudnn.conv.fp32_precision = saved
    else:
        saved = (matmul.allow_tf32, cudnn.allow_tf32)
        matmul.allow_tf32 = cudnn.allow_tf32 = enabled
        try:
            yield
        finally:
            matmul.allow_tf32, cudnn.allow_tf32 = saved


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
    chosen = None
    order = [*configs, "auto"]
    for r in range(sizes["repeats"]):
        for name in order if r % 2 == 0 else order[::-1]:
            timer = StepTimer(warmup)
            loader = _tokens(sizes, steps)
            if name == "auto":
                switch = PrecisionSwitch()
                trainer = _fit(_gpt(sizes), loader, steps, [switch, timer])
                chosen = str(trainer.precision)
            else:
                precision, tf32_on = configs[name]
                with tf32(tf32_on):
                    _fit(_gpt(sizes), loader, steps, [timer], precision=precision)
            if timer.seconds_per_step:
                rates[name].append(sizes["batch"] / timer.seconds_per_step)
    medians = {name: statistics.median(v) for name, v in rates.items() if v}
    fastest = max((n for n in medians if n != "auto"), key=medians.get)
    ratio = medians["auto"] / medians[fastest]
    figures = [
        figure(f"samples/s in {name}", value, "samples/s")
        for name, value in medians.items()
        if name != "auto"
    ]
    figures.append(figure("PrecisionSwitch auto: chosen precision", chosen))
    figures.append(
        figure(
            f"PrecisionSwitch auto: samples/s over the fastest ({fastest})",
            ratio,
            "x",
            ">= 0.95",
            ratio >= 0.95 if on_cuda else None,
        )
    )
    return {
        "figures": figures,
        "details": {"samples_per_s": {k: _spread(v) for k, v in rates.items() if v}, "chosen": chosen},
        "skipped": skipped,
    }
