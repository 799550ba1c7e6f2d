"""MemoryAwareBatchSize(mode="max") against Lightning's BatchSizeFinder(mode="binsearch") and HF Accelerate's
``find_executable_batch_size`` on CPU, one limit per model.

    python benchmarks/batch_size_search.py [--repeats 3] [--quick] [--models squeezenet] [--threads 1] [--out DIR]

Models: torchvision SqueezeNet 1.1 on 3x32x32 images and Lightning's demo Transformer (2+2 layers, 32 wide,
16 tokens), SGD momentum; the SimulatedMemory limit is 60 % of the steady peak at a batch of 256. From
``batch_size=8``: ``default`` is ``MemoryAwareBatchSize(mode="max", target_fraction=1.0)``, ``binsearch``
Lightning's defaults. ``accelerate``: Accelerate's loop from 256, its own x0.9 on each out-of-memory error, around
a fresh module and Trainer per try (Accelerate's idiom: the model is built inside the decorated function) that
trains the 8 steps. The methods run interleaved (the order rotates each repeat, the default first in the
first) in one process: times are medians, ``first s`` a method's first call (cold caches). ``search s``: the
search alone (accelerate: everything before the first step at the size found); ``to step s``: from the call that
builds the module and the Trainer to the end of the first training step at the size found (issue 36's time).
The size found (the smallest over repeats) is set against the true maximum (computed once, untimed): the largest
size at which 3 real steps train under the limit, by bisection, in the loop each answer trains in (ours: held
to the size by ``min_batch_size=max_batch_size=n``, its whole batch zeroing gradients before the forward;
binsearch and accelerate: plain Lightning's). ``survives``: 8 real steps then train. Targets: the default
within 90-100 % of the true maximum, binsearch's search time / the default's >= 3, accelerate's time to the
step / the default's > 1, and the default's search past its first trial step at most one training step at the
size found (``steps past 1st``, issue 36's measure). Writes ``batch_size_search.json``; exit 1 when a target is
missed.
"""

from __future__ import annotations

import gc
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import common
import lightning.pytorch as pl
import lightning.pytorch.tuner.batch_size_scaling as bss
import torch
import torchvision
from common import Classifier, Data, StepPeaks, clocked, labelled, patched, print_table, quiet, write_json
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from lightning_gpuopt import MemoryAwareBatchSize
from lightning_gpuopt.batch_size.trial import TrialSteps
from lightning_gpuopt.testing import SimulatedMemory

try:
    from accelerate.utils import find_executable_batch_size
except ImportError as err:  # the `bench` extra
    raise SystemExit(
        "benchmarks/batch_size_search.py compares with HF Accelerate's find_executable_batch_size: "
        "pip install -e '.[bench]'"
    ) from err

SPEEDUP_TARGET = 3.0  # binsearch's search time over the default's
BEYOND_FIRST_TARGET = 1.0  # issue 36: the search past its first trial step, in steps at the size found
BAND = (0.9, 1.0)
START_BATCH_SIZE = 8
TRAIN_STEPS = 8
LIMIT_AT, LIMIT_SHARE = 256, 0.6  # the limit: this share of the steady peak at this batch size
ACCELERATE_START = 256  # find_executable_batch_size(starting_batch_size=...); x0.9 after each OOM
METHODS = ("default", "binsearch", "accelerate")  # MemoryAwareBatchSize, BatchSizeFinder, Accelerate's loop
# BatchSizeFinder saves and restores the model through a `.scale_batch_size_*.ckpt` in the root directory: a
# scratch folder, never the caller's working directory.
ROOT = tempfile.mkdtemp("-bss")


class Counted(Classifier):
    """The shared classifier, counting its ``training_step`` calls (a finder's trial steps are counted from them)."""

    calls = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        Counted.calls += 1
        return super().training_step(batch, batch_idx)


class DemoLM(nn.Module):
    """Lightning's demo Transformer on tokens; its decoder reads the targets (the tokens shifted by one)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Transformer(vocab_size=256, ninp=32, nhead=2, nhid=64, nlayers=2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # log-probabilities: cross-entropy is their NLL
        return self.net(tokens, torch.roll(tokens, 1, dims=1))


def _tokens(n: int, g: torch.Generator) -> Dataset:
    tokens = torch.randint(0, 256, (n, 16), generator=g)
    return TensorDataset(tokens, torch.roll(tokens, 1, dims=1))


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    data: Callable[[int, torch.Generator], Dataset]


WORKLOADS = [
    Workload("squeezenet", "torchvision squeezenet1_1(num_classes=10), 3x32x32 images, SGD momentum",
             lambda: torchvision.models.squeezenet1_1(num_classes=10), lambda n, g: TensorDataset(*labelled(n, 3, 32, 32, generator=g))),
    Workload("transformer", "lightning.pytorch.demos.Transformer(vocab 256, ninp 32, 2 heads, nhid 64, 2+2 layers), "
             "16 tokens, SGD momentum", DemoLM, _tokens),
]  # fmt: skip


class Timed:
    """A batch-size search, timed (``search_s``); from its end on, ``peaks`` records the fit's own steps and
    ``trial_steps`` holds the training steps the search ran."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.peaks, self.search_s, self.trial_steps = StepPeaks(recording=False), 0.0, 0
        self._calls_at_start = Counted.calls

    def timed(self, search: Callable[..., None], *args: Any) -> None:
        self.search_s = clocked(search, *args)[0]
        if not self.peaks.recording:  # the search is over: every training_step so far was a trial
            self.trial_steps, self.peaks.recording = Counted.calls - self._calls_at_start, True


class TimedFinder(Timed, BatchSizeFinder):
    """Lightning's finder, its search timed (``scale_batch_size``); the fit's own steps follow it."""

    def scale_batch_size(self, *args: Any) -> None:
        self.timed(super().scale_batch_size, *args)


class TimedOurs(Timed, MemoryAwareBatchSize):
    """Ours, its search timed (the fit-start search); the fit's own steps follow it."""

    def on_fit_start(self, *args: Any) -> None:
        self.timed(super().on_fit_start, *args)


def _fit(
    workload: Workload, dataset: Dataset, batch_size: int, steps: int, callbacks: list, limit: int | None
):
    pl.seed_everything(0, verbose=False)
    data = Data(dataset, batch_size=batch_size, num_workers=0, drop_last=True)  # every step a whole batch
    trainer = common.trainer(steps, callbacks, precision="32-true", default_root_dir=ROOT)
    with SimulatedMemory(limit):
        trainer.fit(Counted(workload.build, "sgd"), datamodule=data)
    return data


class TruePeaks:
    """Steady-state peak at a batch size (the second step of an unlimited fit), and the true maxima under ``limit``."""

    def __init__(self, workload: Workload, dataset: Dataset) -> None:
        self.workload, self.dataset, self.limit = workload, dataset, None
        self.peaks: dict[int, int] = {}
        self.fits: dict[tuple[int, bool], bool] = {}

    def __call__(self, batch_size: int) -> int:
        if batch_size not in self.peaks:
            recorder = StepPeaks()
            _fit(self.workload, self.dataset, batch_size, 2, [recorder], None)
            self.peaks[batch_size] = recorder.peaks[-1]
        return self.peaks[batch_size]

    def trains(self, n: int, pack: bool) -> bool:
        """Whether 3 real training steps at ``n`` run under the limit; ``pack``: in the pack's loop."""
        if (n, pack) not in self.fits:
            held = dict(min_batch_size=n, max_batch_size=n, verbose=False)
            callbacks = [MemoryAwareBatchSize("max", 1.0, **held)] * pack
            try:
                _fit(self.workload, self.dataset, n, 3, callbacks, self.limit)
                self.fits[n, pack] = True
            except torch.OutOfMemoryError:
                self.fits[n, pack] = False
        return self.fits[n, pack]

    def largest(self, low: int, high: int, pack: bool) -> int:
        """Bisection: the largest batch size that trains (``low`` does, ``high`` does not)."""
        assert self.trains(low, pack) and not self.trains(high, pack), "the true maximum is out of range"
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.trains(mid, pack) else (low, mid)
        return low


def _run(method: str, workload: Workload, dataset: Dataset, limit: int) -> dict[str, Any]:
    ours = method == "default"
    kwargs = {"mode": "max", "target_fraction": 1.0, "verbose": False}
    finder = TimedOurs(**kwargs) if ours else TimedFinder(mode="binsearch")
    trials: list[tuple[int, str]] = []
    original, measure, trial_s, clock = bss._try_loop_run, TrialSteps.measure, [], common.StepClock()

    def timed_trial(*args: Any, **kwargs: Any) -> Any:
        took, _, out = clocked(measure, *args, **kwargs)
        trial_s.append(took)
        return out

    def counting(trainer: pl.Trainer, params: dict[str, Any]) -> None:
        size = trainer.datamodule.batch_size
        try:
            original(trainer, params)
        except RuntimeError:
            trials.append((size, "OOM"))
            raise
        trials.append((size, "ok"))

    started = time.perf_counter()
    try:
        with patched((bss, "_try_loop_run", counting), (TrialSteps, "measure", timed_trial)):
            data = _fit(
                workload, dataset, START_BATCH_SIZE, TRAIN_STEPS, [finder, finder.peaks, clock], limit
            )
        error = None
    except Exception as err:  # an OOM in the real steps after the search: the found size does not survive
        data, error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    result = {"found": finder.micro_batch_size if ours else finder.optimal_batch_size}
    result.update(trained_at=data.batch_size if data is not None else None, error=error)
    result["survives"] = error is None and len(finder.peaks.peaks) == TRAIN_STEPS
    # BatchSizeFinder's trials run the fit loop without callbacks: training_step calls count them
    result["trial_steps"] = finder.trials if ours else finder.trial_steps
    sizes = [m.size for m in finder.result.measurements] if ours and finder.result else [s for s, _ in trials]
    result.update(trial_sizes=sizes, trial_ooms=sum(1 for _, status in trials if status == "OOM"))
    # Issue 36's measure: the search past its first trial step, in training steps at the size found (the fit's
    # own steps after the first).
    step_s = statistics.median(clock.durations()[1:]) if ours and result["survives"] else None
    beyond = (finder.search_s - trial_s[0]) / step_s if step_s and trial_s else None
    result.update(step_s=step_s, first_trial_s=trial_s[0] if trial_s else None, beyond_first_steps=beyond)
    # The search's trials run no callbacks: the clock's first step is the first at the size found.
    to_step = clock.ends[0][0] - started if clock.ends else None
    return {
        **result,
        "search_s": finder.search_s,
        "to_step_s": to_step,
        "fit_s": time.perf_counter() - started,
    }


def _run_accelerate(workload: Workload, dataset: Dataset, limit: int) -> dict[str, Any]:
    """Accelerate's loop: each try builds the module, the data and the Trainer and trains; an OOM retries at x0.9."""
    tries: list[tuple[int, str]] = []
    clocks: list[common.StepClock] = []
    calls_at_start, calls_before = Counted.calls, [0]

    @find_executable_batch_size(starting_batch_size=ACCELERATE_START)
    def train(batch_size: int) -> int:
        clocks.append(common.StepClock())
        calls_before[0], began = Counted.calls, time.perf_counter()
        try:
            _fit(workload, dataset, batch_size, TRAIN_STEPS, [clocks[-1]], limit)
        except torch.OutOfMemoryError as err:
            message = str(err)
        else:
            tries.append((batch_size, "ok", clocks[-1].starts[0][0] - began))  # its setup, to its first step
            return batch_size
        tries.append((batch_size, "OOM", time.perf_counter() - began))
        # Accelerate retries on a RuntimeError whose message holds " out of memory." (CUDA's "CUDA out of memory.
        # Tried to allocate ..."); SimulatedMemory's reads "CUDA out of memory (simulated).", which it does not
        # match. Reworded as CUDA's own, raised outside the except block (the traceback would pin the step's tensors).
        raise RuntimeError(f"CUDA out of memory. {message}")

    started = time.perf_counter()
    found = train()
    clock = clocks[-1]
    result = {"found": found, "trained_at": found, "error": None, "survives": len(clock.ends) == TRAIN_STEPS}
    result.update(trial_steps=calls_before[0] - calls_at_start, trial_sizes=[s for s, _, _ in tries[:-1]])
    result.update(trial_ooms=sum(1 for _, status, _ in tries if status == "OOM"), tries_s=tries)
    step_s = statistics.median(clock.durations()[1:])
    result.update(step_s=step_s, first_trial_s=tries[0][2], beyond_first_steps=None)
    # Everything before the first step at the size found is the search: the failed tries, the last one's setup.
    search_s, to_step = clock.starts[0][0] - started, clock.ends[0][0] - started
    return {**result, "search_s": search_s, "to_step_s": to_step, "fit_s": time.perf_counter() - started}


def _summary(repeats: list[dict[str, Any]], true_max: int) -> dict[str, Any]:
    """One method's repeats: the smallest size found (of ``true_max``), the median search time, the first call's."""
    worst = min(repeats, key=lambda r: r["found"] or 0)
    times = [r["search_s"] for r in repeats]
    fraction = worst["found"] / true_max if worst["found"] else None
    summary = {**worst, "fraction": fraction, "survives": all(r["survives"] for r in repeats)}
    beyond = [r["beyond_first_steps"] for r in repeats if r["beyond_first_steps"] is not None]
    summary["beyond_first_steps"] = statistics.median(beyond) if beyond else None
    to_step = [r["to_step_s"] for r in repeats if r["to_step_s"] is not None]
    summary.update(to_step_s=statistics.median(to_step) if to_step else None, repeats_to_step_s=to_step)
    return {**summary, "true_max": true_max, "search_s": statistics.median(times), "first_s": times[0], "repeats_s": times}  # fmt: skip


def report(results: dict[str, Any]) -> None:
    rows = [
        ("model", "limit", "true max", "method", "found", "of max", "survives", "trial steps", "search s", "first s", "to step s", "steps past 1st")
    ]  # fmt: skip
    for name, entry in results["models"].items():
        for case in entry["limits"]:
            for method, run in case["runs"].items():
                fraction = f"{run['fraction']:.1%}" if run["fraction"] is not None else "-"
                limit = f"{case['limit_bytes'] / 2**20:.1f} MiB"
                survives = "yes" if run["survives"] else "NO"
                cells = (name, limit, run["true_max"], method, run["found"], fraction, survives)
                beyond = "-" if run["beyond_first_steps"] is None else f"{run['beyond_first_steps']:.2f}"
                to_step = "-" if run["to_step_s"] is None else f"{run['to_step_s']:.2f}"
                times = (f"{run['search_s']:.2f}", f"{run['first_s']:.2f}", to_step, beyond)
                rows.append((*cells, run["trial_steps"], *times))
    print_table(rows)
    print()
    rows = [("model", "binsearch search s / default", "accelerate to step s / default")]
    rows += [
        (
            name,
            f"{e['speedups']['binsearch_over_default']:.2f}x",
            f"{e['speedups']['accelerate_over_default']:.2f}x",
        )
        for name, e in results["models"].items()
    ]
    print_table(rows)
    for t in results["targets"]:
        print(
            f"target: {t['metric']}: {t['value']} (threshold {t['threshold']}) -> {'met' if t['met'] else 'NOT met'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = common.arguments(
        __doc__, "batch_size_search.json", quick="one repeat", repeats=(3, 1), threads=1
    )
    names = [w.name for w in WORKLOADS]
    parser.add_argument("--models", nargs="+", choices=names, default=names)
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats or 3
    torch.set_num_threads(args.threads)  # 2 threads on 2 cores shared with other jobs: waits swing 10x
    quiet(logging.ERROR, every_warning=True)
    started = time.perf_counter()
    setup = {
        "repeats": repeats,
        "threads": args.threads,
        "start_batch_size": START_BATCH_SIZE,
        "accelerate_start_batch_size": ACCELERATE_START,
        "train_steps_after_search": TRAIN_STEPS,
    }
    results: dict[str, Any] = {"benchmark": "batch_size_search", **common.environment(**setup), "models": {}}
    for workload in (w for w in WORKLOADS if w.name in args.models):
        # Host data, made before any SimulatedMemory.
        dataset = workload.data(4096, torch.Generator().manual_seed(0))
        truth = TruePeaks(workload, dataset)
        limit = truth.limit = int(LIMIT_SHARE * truth(LIMIT_AT))
        plain, true_max = (truth.largest(START_BATCH_SIZE, LIMIT_AT, pack) for pack in (False, True))
        print(
            f"{workload.name}: limit {limit / 2**20:.1f} MiB, true maximum {true_max} (plain {plain})",
            flush=True,
        )
        done: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        for r in range(repeats):
            for method in METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]:
                gc.collect()  # untimed: the previous method's garbage is not collected in this one's time
                if method == "accelerate":
                    run = _run_accelerate(workload, dataset, limit)
                else:
                    run = _run(method, workload, dataset, limit)
                done[method].append(run)
                print(f"  {method}: {run['found']}, search {run['search_s']:.2f} s, to step {run['to_step_s'] or 0:.2f} s", flush=True)  # fmt: skip
        runs = {m: _summary(done[m], true_max if m == "default" else plain) for m in METHODS}
        speedups = {"binsearch_over_default": runs["binsearch"]["search_s"] / runs["default"]["search_s"]}
        if runs["default"]["to_step_s"]:  # the default's answer trained: its time to that step is known
            speedups["accelerate_over_default"] = (
                runs["accelerate"]["to_step_s"] / runs["default"]["to_step_s"]
            )
        else:
            speedups["accelerate_over_default"] = 0.0
        case = {
            "fraction": LIMIT_SHARE,
            "limit_bytes": limit,
            "true_max": true_max,
            "plain_max": plain,
            "runs": runs,
        }
        entry = {"description": workload.description, "limits": [case], "speedups": speedups}
        entry["true_peaks"] = {str(k): v for k, v in sorted(truth.peaks.items())}
        results["models"][workload.name] = entry

    entries = results["models"].values()
    ours = [e["limits"][0]["runs"]["default"] for e in entries]
    fractions = [round(r["fraction"] or 0, 3) for r in ours]
    speedup = min(e["speedups"]["binsearch_over_default"] for e in entries)  # judged unrounded, shown rounded
    over_accelerate = min(e["speedups"]["accelerate_over_default"] for e in entries)
    survive = all(r["survives"] for r in ours)
    beyond = [r["beyond_first_steps"] for r in ours]
    beyond_met = all(b is not None and b <= BEYOND_FIRST_TARGET for b in beyond)
    targets = [
        ("default: found / true maximum, every model", "90-100 %", fractions, all(BAND[0] <= (r["fraction"] or 0) <= BAND[1] for r in ours)),
        ("default: trains 8 steps at the size found, every model", "yes", survive, survive),
        ("binsearch search time / default, every model", f">= {SPEEDUP_TARGET}", round(speedup, 3), speedup >= SPEEDUP_TARGET),
        ("accelerate time to the step at the size found / default, every model", "> 1", round(over_accelerate, 3), over_accelerate > 1),
        ("default: search past its first trial step, in steps at the size found, every model", f"<= {BEYOND_FIRST_TARGET}",
         [None if b is None else round(b, 2) for b in beyond], beyond_met),
    ]  # fmt: skip
    results["targets"] = [dict(zip(("metric", "threshold", "value", "met"), target)) for target in targets]
    print()
    report(results)
    write_json(args.out, "batch_size_search.json", results, started)
    return 0 if all(t["met"] for t in results["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
