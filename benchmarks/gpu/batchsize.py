"""GPU check section ``batchsize``: MemoryAwareBatchSize against real memory under a per-process fraction.

For a causal transformer LM (512 tokens, AdamW) from a ``GPUOptDataModule``, under a limit 60 % of the way
between the steady peaks at two batch sizes: ``mode="max"`` (the size found, its predicted and measured
peak), the true maximum by bisection over real runs (held to multiples of ``multiple_of``), and
``mode="micro"`` at twice the true maximum. Checks: predicted vs measured peak within 5 % (both modes); the
size found within 90-100 % of the largest answerable size that fits; no OOM after a search.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import Classifier, Data, StepPeaks, figure
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from gpu import device
from lightning_gpuopt import MemoryAwareBatchSize
from lightning_gpuopt.memory import is_oom_error

PEAK_TOLERANCE = 0.05
BAND = (0.9, 1.0)
STEPS = 3  # per run: the first creates the optimizer state, the others are steady
LIMIT_POSITION = 0.6
IN_BAND = "found within 90-100 % of the largest answerable size"


class CausalLM(nn.Module):
    def __init__(self, vocab: int = 16384, d_model: int = 512, layers: int = 8, seq: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.pos, mask=self.mask, is_causal=True))


def _tokens(n: int, vocab: int = 16384, seq: int = 512) -> Dataset:
    tokens = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens, torch.roll(tokens, -1, dims=1))


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    data: Callable[[int], Dataset]
    samples: int
    #: Batch sizes of the calibration runs (the limit lies between their peaks).
    low: int
    high: int


_LM = "causal transformer LM: 8 layers, d_model 512, 512 tokens, vocab 16384, AdamW"
WORKLOADS = {"lm": Workload("lm", _LM, CausalLM, _tokens, 2048, 8, 48)}
#: The dry run's stand-in (CPU under SimulatedMemory): the same code paths, tiny sizes.
_DRY_LM = "dry run: causal transformer LM 2 layers, d_model 32, 32 tokens, vocab 256, AdamW"
_dry_lm = lambda: CausalLM(vocab=256, d_model=32, layers=2, seq=32)  # noqa: E731
DRY_WORKLOADS = {"lm": Workload("lm", _DRY_LM, _dry_lm, lambda n: _tokens(n, vocab=256, seq=32), 512, 4, 24)}


def run(workload: Workload, dataset: Dataset, batch_size: int, callbacks: list, limit: int | None) -> dict:
    """Train ``STEPS`` steps; returns the steady peak, or the OOM when it ran out of memory."""
    device.current().set_limit(limit)
    # DataLoader workers on CUDA; none in the dry run (each fit would start its own processes).
    workers = 2 if device.current().kind == "cuda" else 0
    recorder, data = StepPeaks(), Data(dataset, batch_size=batch_size, num_workers=workers, drop_last=True)
    trainer = device.trainer(STEPS, [*callbacks, recorder])
    failed = None
    try:
        trainer.fit(Classifier(workload.build, "adamw"), datamodule=data)
    except Exception as err:
        if not is_oom_error(err):
            raise
        failed = str(err).splitlines()[0][:300]
    del trainer
    device.current().set_limit(None)
    ok = failed is None and len(recorder.peaks) == STEPS
    steady = max(recorder.peaks[1:]) if ok else None
    return {"batch_size": data.batch_size, "fits": ok, "steady_peak": steady, "oom": failed}


def check_workload(workload: Workload, multiple_of: int) -> dict[str, Any]:
    dataset = workload.data(workload.samples)
    low, high = (run(workload, dataset, n, [], None)["steady_peak"] for n in (workload.low, workload.high))
    limit = int(low + LIMIT_POSITION * (high - low))
    result: dict[str, Any] = {"description": workload.description, "limit_bytes": limit}
    result.update(multiple_of=multiple_of, calibration={workload.low: low, workload.high: high})
    finder = MemoryAwareBatchSize(mode="max", target_fraction=1.0, multiple_of=multiple_of)
    started = time.perf_counter()
    found = run(workload, dataset, 8, [finder], limit)
    found.update(found=finder.micro_batch_size, trials=finder.trials)
    found["predicted_peak"] = finder.predicted_peak_bytes
    sizes = [m.size for m in finder.result.measurements]
    result["max_mode"] = {**found, "wall_s": time.perf_counter() - started, "trial_sizes": sizes}

    fits, fails, runs = (finder.micro_batch_size if found["fits"] else 0), None, {}
    step = max(1, fits)
    while fails is None:  # double up from the answer until a run does not fit
        size = fits + step
        runs[size] = run(workload, dataset, size, [], limit)["fits"]
        fits, fails, step = (size, None, 2 * step) if runs[size] else (fits, size, step)
    while fails - fits > 1:
        mid = (fits + fails) // 2
        runs[mid] = run(workload, dataset, mid, [], limit)["fits"]
        fits, fails = (mid, fails) if runs[mid] else (fits, mid)
    answerable = fits - fits % multiple_of if fits >= multiple_of else fits
    result.update(true_max=fits, answerable_max=answerable)
    result["bisection_runs"] = {str(k): runs[k] for k in sorted(runs)}

    micro = MemoryAwareBatchSize(target_fraction=1.0, multiple_of=multiple_of)
    micro_run = run(workload, dataset, 2 * fits, [micro], limit)
    ran = math.ceil(2 * fits / micro.k)
    micro_run.update(found=micro.micro_batch_size, k=micro.k, micro_batch_run=ran, trials=micro.trials)
    model = micro.result.model if micro.result else None
    peak = model and model.peak(ran)
    predicted = dict(predicted_peak_at_found=micro.predicted_peak_bytes, predicted_peak=peak)
    result["micro_mode"] = {**micro_run, **predicted}
    checks = {}
    for mode in ("max_mode", "micro_mode"):
        r = result[mode]
        error = abs(r["predicted_peak"] - r["steady_peak"]) / r["steady_peak"] if r["fits"] else None
        r["peak_error"], within = error, error is not None and error <= 0.05
        checks[f"{mode}: trains without OOM after the search"] = r["fits"]
        checks[f"{mode}: predicted peak within {PEAK_TOLERANCE:.0%} of measured"] = within
    result["found_fraction"] = fraction = finder.micro_batch_size / answerable if answerable else 0.0
    checks[f"max_mode: {IN_BAND}"] = BAND[0] <= fraction <= BAND[1]
    checks["micro_mode: k > 1 (the batch had to be split)"] = micro.k > 1
    return {**result, "checks": checks, "passed": all(checks.values())}


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The check's ``batchsize`` section."""
    workloads = WORKLOADS if device.current().kind == "cuda" else DRY_WORKLOADS
    figures, details = [], {}
    for name in sizes["models"]:
        device.check()
        details[name] = r = check_workload(workloads[name], sizes["multiple_of"])
        what = f"the largest multiple of {r['multiple_of']} that fits (true maximum {r['true_max']})"
        found, met = f"{r['max_mode']['found']} / {r['answerable_max']}", r["checks"][f"max_mode: {IN_BAND}"]
        what = f"{name}: MemoryAwareBatchSize(mode='max') found / {what}"
        figures.append(figure(what, found, "", "90-100 %", met))
        for mode in ("max_mode", "micro_mode"):
            error, met = r[mode]["peak_error"], r["checks"][f"{mode}: predicted peak within 5% of measured"]
            at = f" (micro-batch of {r[mode]['micro_batch_run']})" if mode == "micro_mode" else ""
            what = f"{name}: {mode.replace('_', ' ')} predicted vs measured peak{at}"
            figures.append(figure(what, None if error is None else 100 * error, "%", "<= 5 %", met))
    return {"figures": figures, "details": details}
