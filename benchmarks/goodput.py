"""Goodput: AdaptiveBatchSize against a fixed small and a fixed large batch, to a fixed validation loss; and what
measuring the noise scale costs.

    python benchmarks/goodput.py [--quick]  # about 2 minutes on 2 shared CPU cores; --quick: a smoke run

Two tiny CPU tasks with built-in synthetic data (nothing downloaded): a next-token language model on sequences
from a fixed random Markov chain (its loss floor is the chain's entropy), and an image classifier on 8x8 Gaussian
class prototypes with noise. Each trains with Adam to a fixed validation-loss target under three settings from one
run: the fixed small batch (16), a fixed large batch (256, learning rate x sqrt(16)) and ``AdaptiveBatchSize()``
from the small batch at its defaults. Figures: optimizer steps, samples and wall time to the target (the
validation loss read every 10 optimizer steps, not timed). Goal (issue 29): >= 25 % fewer steps than the small
batch, samples <= 1.1x the small batch's, wall time no worse than the better fixed batch.

The overhead is GradientNoiseScale in its steady state (a split step every 100th) beside OOMRecovery at k = 1
against OOMRecovery alone: interleaved pairs of fits, each fit's figure the mean of its steady steps. Writes
``goodput.json`` to ``--out``.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import common
import lightning.pytorch as pl
import torch
from common import Classifier, StepClock, arguments, environment, print_table, quiet, spread, write_json
from gpu.speed import interleaved_pairs
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import AdaptiveBatchSize, GradientNoiseScale, OOMRecovery

SMALL, LARGE, LR, EVAL_EVERY = 16, 256, 3e-3, 10


def markov_tokens(
    n: int, seq: int = 16, vocab: int = 64, seed: int = 0
) -> tuple[tuple[Tensor, Tensor], float]:
    """``n`` sequences of a fixed random Markov chain as (tokens, next tokens), and the chain's entropy rate (the
    loss floor, nats)."""
    g = torch.Generator().manual_seed(123)
    logits = torch.randn(vocab, vocab, generator=g) * 2.0
    probs = logits.softmax(-1)
    entropy = float(-(probs * probs.log()).sum(-1).mean())
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, seq, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq):
        x[:, t] = torch.multinomial(probs[x[:, t - 1]], 1, generator=g).squeeze(1)
    return (x[:, :-1], x[:, 1:]), entropy


def prototypes(n: int, dim: int = 64, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    centers = torch.randn(classes, dim, generator=g)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return centers[y] + 2.2 * torch.randn(n, dim, generator=g), y


#: Each task's network (the shared Classifier trains it with Adam): a next-token MLP on embeddings, a 2-layer MLP.
NETS = {
    "lm": lambda: nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64)),
    "image": lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)),
}


class StopAtTarget(pl.Callback):
    """Reads the validation loss every ``EVAL_EVERY`` optimizer steps (time not counted) and stops at the target."""

    def __init__(self, val, target: float) -> None:
        self.val, self.target = val, target
        self.reached_step = self.samples = None
        self.seconds, self.final = 0.0, None
        self._last, self._seen, self._t0 = -1, 0, None

    def on_train_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._seen += len(batch[0])
        step = trainer.global_step
        if step == self._last or step % EVAL_EVERY:
            return
        self._last = step
        paused = time.perf_counter()
        with torch.no_grad():
            loss = float(pl_module.training_step(self.val, 0))
        self.final, self.seconds = loss, self.seconds + paused - self._t0
        if loss <= self.target:
            self.reached_step, self.samples = step, self._seen
            trainer.should_stop = True
        self._t0 = time.perf_counter()


def train(task: str, setting: str, max_steps: int) -> dict:
    pl.seed_everything(0, verbose=False)
    if task == "lm":
        (pairs, entropy), val = markov_tokens(40_000), markov_tokens(2_000, seed=1)[0]
        data, target = TensorDataset(*pairs), entropy + 0.09
    else:
        data, val, target = TensorDataset(*prototypes(60_000)), prototypes(4_000, seed=1), 0.30
    model = Classifier(NETS[task], "adam", LR)
    batch = LARGE if setting == "large" else SMALL
    if setting == "large":
        model.lr = LR * math.sqrt(LARGE / SMALL)
    stop = StopAtTarget(val, target)
    grow = AdaptiveBatchSize(max_batch=LARGE) if setting == "adaptive" else None
    callbacks = [grow, stop] if grow else [stop]
    trainer = common.trainer(max_steps, callbacks, max_epochs=-1)
    shuffle = torch.Generator().manual_seed(0)
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=True, generator=shuffle))
    reached = stop.reached_step is not None
    result = dict(task=task, setting=setting, target=target, reached=reached)
    result["steps"] = stop.reached_step if reached else trainer.global_step
    result["samples"] = stop.samples if stop.samples is not None else stop._seen
    result.update(seconds=stop.seconds, final_loss=stop.final)
    return {**result, "changes": grow.changes if grow else []}


def overhead(task: str, steps: int, pairs: int) -> dict:
    """GradientNoiseScale (steady: every 100th step split) + OOMRecovery against OOMRecovery alone, interleaved pairs."""

    def fit(with_noise: bool) -> float:
        pl.seed_everything(0, verbose=False)
        model = Classifier(NETS[task], "adam", LR)
        data = TensorDataset(*(markov_tokens(steps * 64)[0] if task == "lm" else prototypes(steps * 64)))
        clock = StepClock()
        noise = [GradientNoiseScale(min_measurements=1, trust=math.inf)] if with_noise else []
        callbacks = [OOMRecovery(verbose=False), *noise, clock]
        trainer = common.trainer(steps, callbacks)
        trainer.fit(model, DataLoader(data, batch_size=64))
        return statistics.fmean(clock.periods()[110:])  # steady: after the first split (step 100)

    per_fit = interleaved_pairs((False, True), fit, pairs, pairs)
    return spread([100 * (noise / alone - 1) for alone, noise in zip(per_fit[False], per_fit[True])])


def main() -> None:
    parser = arguments(__doc__, "goodput.json", quick="tiny runs: checks the script, not the goals")
    args = parser.parse_args()
    quiet(every_warning=True)
    torch.set_num_threads(1)
    max_steps = 200 if args.quick else 6000
    runs = [train(task, s, max_steps) for task in ("lm", "image") for s in ("small", "large", "adaptive")]
    header = "task|setting|reached|steps|samples|wall s|steps/small|samples/small|wall/best fixed|changes"
    rows, summary = [header.split("|")], {}
    for task in ("lm", "image"):
        by = {r["setting"]: r for r in runs if r["task"] == task}
        small, best = by["small"], min(by["small"]["seconds"], by["large"]["seconds"])
        for r in by.values():
            ratios = (r["steps"] / small["steps"], r["samples"] / small["samples"], r["seconds"] / best)
            changes = " ".join(f"{c[1]}->{c[2]}@{c[0]}" for c in r["changes"])
            cells = (task, r["setting"], r["reached"], r["steps"], r["samples"], f"{r['seconds']:.1f}")
            rows.append([*cells, *(f"{x:.2f}" for x in ratios), changes])
        a = by["adaptive"]
        summary[task] = {
            "steps_ratio": a["steps"] / small["steps"],
            "samples_ratio": a["samples"] / small["samples"],
            "wall_ratio_vs_best_fixed": a["seconds"] / best,
            "goal_steps_met": a["steps"] <= 0.75 * small["steps"],
            "goal_samples_met": a["samples"] <= 1.1 * small["samples"],
            "goal_wall_met": a["seconds"] <= best,
        }
    print_table(rows)
    pairs = 2 if args.quick else 5
    cost = {task: overhead(task, 120 if args.quick else 1210, pairs) for task in ("lm", "image")}
    for task, s in cost.items():
        print(
            f"overhead {task}: GradientNoiseScale (steady: every 100th step split) vs OOMRecovery k=1: median {s['median']:+.2f} % "
            f"(IQR {s['q1']:+.2f}..{s['q3']:+.2f}, min..max {s['min']:+.2f}..{s['max']:+.2f}, {s['n']} pairs)"
        )
    result = {"environment": environment(), "runs": runs, "summary": summary, "overhead_percent": cost}
    write_json(args.out, "goodput.json", result)


if __name__ == "__main__":
    sys.exit(main())
