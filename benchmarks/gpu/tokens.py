"""GPU check section ``tokens``: batches by tokens on the device (issue 36).

``benchmarks/token_batching.py``'s data, model and timing at GPU sizes (32,000 sequences, lengths log-normal
around 80 tokens, clipped to 16..512; its causal transformer at 4 layers, width 512, 8 heads, vocabulary 8192;
AdamW, bf16-mixed), inside the section's 16 GiB cap:

- ``auto``: one epoch of ``GPUOptDataModule(max_tokens="auto")`` with ``MemoryAwareBatchSize()`` under a 12 GiB
  limit: the budget it chose; the predicted (the search's own memory model) vs measured peak of the costliest
  batch that ran; that peak against the budget (``target_fraction`` x the limit; target 85-100 %, no step above
  it); no OOM; the epoch's padding share (target <= 10 %).
- ``speed``: real tokens/s of random batches of 64 against token batches at the same worst-case batch
  (``max_tokens`` = 64 x the longest sample; target >= 2.5x) and at the auto budget, each arm's steps timed in
  blocks of 5 interleaved with the others' in this process, as many as the slice holds (3 s kept back).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import token_batching as tb
import torch
from common import Classifier, Data, StepPeaks, figure
from torch import nn
from torch.utils.data import Dataset

from gpu import device
from lightning_gpuopt import MemoryAwareBatchSize
from lightning_gpuopt.data import TokenBatchSampler
from lightning_gpuopt.memory import format_bytes, get_probe, is_oom_error

PEAK_BAND = (0.85, 1.0)
MAX_PADDING = 0.10
#: The speed arms stop timing (after a round of blocks, every arm as many steps) with this little of the slice left.
RESERVE_S = 3.0


class Sequences(Dataset):
    """The samples, with the ``lengths`` GPUOptDataModule reads for ``max_tokens``."""

    def __init__(self, data: list[torch.Tensor]) -> None:
        self.data, self.lengths = data, [len(s) for s in data]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class Padded(Data):
    """Batches padded to their longest sample: ``(ids, labels)``, labels -100 on the padding."""

    def collate_fn(self) -> Any:
        return tb.batch


class Shapes(pl.Callback):
    """Each training batch's ``(rows, longest)`` and its real tokens."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.real: list[int] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        ids, labels = batch
        self.shapes.append((int(ids.shape[0]), int(ids.shape[1])))
        self.real.append(int((labels != -100).sum()) + len(ids))


def _slice_nearly_over() -> bool:
    left = device.remaining()
    return left is not None and left < RESERVE_S


def _model(sizes: dict[str, Any]) -> nn.Module:
    return tb.CausalLM(sizes["vocab"], sizes["width"], sizes["heads"], sizes["layers"])


def auto_epoch(sizes: dict[str, Any], data: list[torch.Tensor]) -> dict[str, Any]:
    """One epoch at the budget ``MemoryAwareBatchSize`` chooses for ``max_tokens="auto"``, every step's peak."""
    here = device.current()
    here.set_limit(sizes["limit_bytes"])
    limit = get_probe().total  # what target_fraction is a share of
    finder = MemoryAwareBatchSize(target_fraction=sizes["target_fraction"], verbose=False)
    peaks, shapes = StepPeaks(), Shapes()
    workers = 2 if here.kind == "cuda" else 0  # none in the dry run (each fit would start its own processes)
    datamodule = Padded(Sequences(data), max_tokens="auto", num_workers=workers)
    trainer = device.trainer(-1, [finder, peaks, shapes], max_epochs=1, precision=sizes["precision"])
    oom = None
    try:
        trainer.fit(Classifier(lambda: _model(sizes), "adamw", lr=1e-3), datamodule=datamodule)
    except Exception as err:
        if not is_oom_error(err):
            raise
        oom = str(err).splitlines()[0][:300]
    finally:
        here.set_limit(None)
    batches, run = trainer.num_training_batches, finder.token_search
    del trainer
    result: dict[str, Any] = {"max_tokens": finder.max_tokens, "oom": oom, "steps": len(peaks.peaks)}
    result["limit_bytes"] = limit
    result.update(batches_per_epoch=batches, search=None if run is None else run.line())
    if run is None or run.max_tokens is None or not peaks.peaks:
        return {**result, "fits": False}
    predicted = [run.held_bytes + run.model.added(*shape) for shape in shapes.shapes]
    costliest = max(range(len(predicted)), key=predicted.__getitem__)  # by the search's own memory model
    highest = max(range(len(peaks.peaks)), key=peaks.peaks.__getitem__)
    computed = sum(rows * longest for rows, longest in shapes.shapes)
    result.update(
        budget_bytes=run.budget_bytes,
        search_seconds=run.elapsed,
        planned_costliest=run.costliest,
        measured_shapes=[(m.size, m.length, m.added_bytes) for m in run.shapes],
        costliest={"shape": shapes.shapes[costliest], "predicted": predicted[costliest]},
        highest={"shape": shapes.shapes[highest], "peak": peaks.peaks[highest]},
        padding=1 - sum(shapes.real) / computed,
    )
    result["costliest"]["measured"] = measured = peaks.peaks[costliest]
    result["peak_error"] = predicted[costliest] / measured - 1
    result["peak_of_budget"] = peaks.peaks[highest] / run.budget_bytes
    result["fits"] = oom is None and len(peaks.peaks) == batches
    return result


def speed(sizes: dict[str, Any], data: list[torch.Tensor], auto: int | None) -> dict[str, Any]:
    """Real tokens/s of fixed batches, of token batches at their worst case, and at the auto budget: interleaved."""
    lengths, fixed = [len(s) for s in data], sizes["fixed"]
    same = fixed * max(lengths)  # the fixed arm's costliest batch: ``fixed`` samples padded to the longest
    plans = {f"batch_size={fixed}": tb.fixed_batches(len(lengths), fixed)}
    for tokens in dict.fromkeys(t for t in (same, auto) if t is not None):
        plans[f"max_tokens={tokens}"] = TokenBatchSampler(lengths, tokens, seed=1).epoch_batches(0)
    tallies = tb.interleaved(
        plans,
        data,
        sizes["steps"],
        lambda: _model(sizes),
        device=device.current().accelerator,
        precision=sizes["precision"],
        warmup=sizes["warmup"],
        stop=_slice_nearly_over,
    )
    base = tallies[f"batch_size={fixed}"].rate
    arms = {
        name: {
            "batches_per_epoch": len(plans[name]),
            "steps": t.steps,
            "padding_timed": t.padding,
            "padding_epoch": tb.padding(plans[name], lengths),
            "real_tokens_per_s": t.rate,
            "vs_fixed": t.rate / base,
            "seconds": t.seconds,
        }
        for name, t in tallies.items()
    }
    return {
        "same_worst_case": f"max_tokens={same}",
        "auto": None if auto is None else f"max_tokens={auto}",
        "arms": arms,
    }


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    """The check's ``tokens`` section."""
    data = tb.samples(tb.lengths(sizes["samples"]), sizes["vocab"])
    device.check()
    auto = auto_epoch(sizes, data)
    if "costliest" in auto:
        peak, budget = format_bytes(auto["costliest"]["measured"]), format_bytes(auto["budget_bytes"])
        line = (
            f"  auto: max_tokens={auto['max_tokens']}, {auto['steps']} of {auto['batches_per_epoch']} steps"
        )
        print(f"{line}, the costliest batch's peak {peak} of a {budget} budget", flush=True)
    device.check()
    fast = speed(sizes, data, auto["max_tokens"])
    for name, arm in fast["arms"].items():
        rate, ratio, padding = arm["real_tokens_per_s"], arm["vs_fixed"], arm["padding_timed"]
        print(f"  {name}: {rate:,.0f} real tok/s ({ratio:.2f}x), padding {padding:.1%}", flush=True)
    return {"figures": _figures(sizes, auto, fast), "details": {"auto": auto, "speed": fast}}


def _figures(sizes: dict[str, Any], auto: dict[str, Any], fast: dict[str, Any]) -> list[dict[str, Any]]:
    figures = [
        figure("max_tokens='auto': the budget MemoryAwareBatchSize chose", auto["max_tokens"], "tokens")
    ]
    ran = f"{auto['steps']} of {auto['batches_per_epoch']} steps" + (
        f"; {auto['oom']}" if auto["oom"] else ""
    )
    figures.append(figure("auto: one epoch trains without OOM", ran, "", "no OOM", auto["fits"]))
    if "costliest" in auto:
        c, (low, high) = auto["costliest"], PEAK_BAND
        shape = " x ".join(map(str, c["shape"]))
        value = f"{format_bytes(c['predicted'])} / {format_bytes(c['measured'])} ({100 * auto['peak_error']:+.1f} %)"
        figures.append(figure(f"auto: predicted / measured peak of the costliest batch ({shape})", value))
        share = c["measured"] / auto["budget_bytes"]
        met = low <= share <= high and auto["peak_of_budget"] <= high
        what = (
            f"auto: the costliest batch's peak / the budget ({sizes['target_fraction']:g} x "
            f"{format_bytes(auto['limit_bytes'])}); "
            f"the highest step's: {100 * auto['peak_of_budget']:.1f} %"
        )
        figures.append(figure(what, 100 * share, "%", f"{100 * low:.0f}-{100 * high:.0f} %", met))
        met = auto["padding"] <= MAX_PADDING
        what = "auto: padding share of the epoch"
        figures.append(figure(what, 100 * auto["padding"], "%", f"<= {100 * MAX_PADDING:.0f} %", met))
    fixed, same, arms = f"batch_size={sizes['fixed']}", fast["same_worst_case"], fast["arms"]
    ratio, steps = arms[same]["vs_fixed"], arms[same]["steps"]
    what = f"real tokens/s, {same} / {fixed} (the same worst-case batch; {steps} steps each, interleaved)"
    figures.append(figure(what, ratio, "x", f">= {tb.TARGET}x", ratio >= tb.TARGET))
    if fast["auto"] not in (None, same):
        figures.append(
            figure(f"real tokens/s, {fast['auto']} (auto) / {fixed}", arms[fast["auto"]]["vs_fixed"], "x")
        )
    return figures
