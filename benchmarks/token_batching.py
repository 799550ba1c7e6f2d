"""Batches by tokens against fixed batches of samples: padding and real tokens per second (issue 36).

    python benchmarks/token_batching.py [--steps 20] [--quick] [--threads 1] [--out DIR]

The data: 2,000 sequences, lengths log-normal around 80 tokens, clipped to 16..512, vocabulary 256, batches
``(ids, labels)`` padded to the batch's longest sample, labels -100 on the padding. The model: a 2-layer causal
transformer (d = 64, 4 heads), the loss a mean over real tokens, AdamW. Arms: random batches of 64 samples
(``GPUOptDataModule(batch_size=64)``'s order), and ``TokenBatchSampler`` batches at ``max_tokens`` = 64 x 512
(the fixed arm's costliest batch: the same worst-case memory) and at half that. Each arm trains ``--steps``
steps, timed in blocks of 5 interleaved with the other arms' (one process, ``--threads`` threads). ``padding``:
the share of the computed tokens that are padding; ``real tok/s``: real tokens over the timed steps' wall time.
Target: real tokens/s at least 2.5x the fixed arm's at the same worst-case budget. Writes ``token_batching.json``;
exit 1 when the target is missed. The GPU check's ``tokens`` section (``benchmarks/gpu/tokens.py``) runs the same
pieces on the device.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import common
import torch
from common import arguments, environment, print_table, write_json
from torch import Tensor, nn

from lightning_gpuopt.data import TokenBatchSampler

VOCAB, WIDTH, HEADS, LAYERS = 256, 64, 4, 2
LONGEST = 512
FIXED = 64
TARGET = 2.5
BLOCK = 5


def lengths(n: int = 2000, seed: int = 0) -> list[int]:
    """``n`` lengths, log-normal around 80 tokens, clipped to 16..512."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=generator) * 0.6 + 4.38).exp().round().clamp(16, LONGEST).long().tolist()


def samples(sizes: Sequence[int], vocab: int = VOCAB) -> list[Tensor]:
    """Sample ``i``: ``sizes[i]`` tokens drawn from ``1..vocab - 1`` with seed ``i`` (0 is the padding)."""
    return [
        torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)
    ]


class CausalLM(nn.Module):
    def __init__(
        self, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS, layers: int = LAYERS
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(LONGEST, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        x = self.embed(ids) + self.position(torch.arange(n, device=ids.device))
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def batch(samples: list[Tensor]) -> tuple[Tensor, Tensor]:
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = s
        labels[row, : len(s) - 1] = s[1:]
    return ids, labels


def fixed_batches(n: int, size: int = FIXED) -> list[list[int]]:
    """Random batches of ``size`` samples (the order ``GPUOptDataModule(batch_size=size)`` would draw)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    return [order[i : i + size] for i in range(0, n, size)]


def arms(sizes: list[int]) -> dict[str, list[list[int]]]:
    out = {f"batch_size={FIXED}": fixed_batches(len(sizes))}
    for budget in (FIXED * LONGEST, FIXED * LONGEST // 2):
        out[f"max_tokens={budget}"] = TokenBatchSampler(sizes, budget, seed=1).epoch_batches(0)
    return out


def padding(plan: list[list[int]], sizes: Sequence[int]) -> float:
    """The share of the padded tokens of all of ``plan``'s batches that are padding."""
    computed = sum(len(b) * max(sizes[i] for i in b) for b in plan)
    return 1 - sum(sizes[i] for b in plan for i in b) / computed


@dataclass
class Tally:
    """One arm's timed steps: their seconds, the real tokens (every one, the last of each sample too) and the
    padded tokens they computed."""

    steps: int = 0
    seconds: float = 0.0
    real: int = 0
    computed: int = 0

    @property
    def rate(self) -> float:
        return self.real / self.seconds

    @property
    def padding(self) -> float:
        return 1 - self.real / self.computed


def interleaved(
    plans: dict[str, list[list[int]]],
    data: Sequence[Tensor],
    steps: int,
    build: Callable[[], nn.Module] = CausalLM,
    *,
    device: torch.device | str = "cpu",
    precision: str = "32-true",
    warmup: int = 0,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Tally]:
    """Train one model per arm (``build()`` under seed 0, AdamW) on its batches of ``data``, ``steps`` timed steps
    each, in blocks of :data:`BLOCK` interleaved with the other arms'.

    Args:
        device: where the models train (on CUDA each timed step is synchronised at both ends).
        precision: ``"32-true"``, or ``"bf16-mixed"`` (the forward and loss under bf16 autocast).
        warmup: untimed steps per arm first, on its costliest batch (first-use costs, the allocator's pool).
        stop: asked after each round of blocks (every arm as many steps): ``True`` ends the timing there.
    """
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    models = {}
    for name in plans:
        torch.manual_seed(0)
        model = build().to(device)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(name: str, ids: Tensor, labels: Tensor) -> None:
        model, optimizer = models[name]
        cast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else None
        with cast or contextlib.nullcontext():
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for name, plan in plans.items() if warmup else ():
        costliest = max(plan, key=lambda b: len(b) * max(len(data[i]) for i in b))
        for _ in range(warmup):
            step(name, *(t.to(device) for t in batch([data[i] for i in costliest])))
    tallies = {name: Tally() for name in plans}
    while min(t.steps for t in tallies.values()) < steps:
        for name, plan in plans.items():
            tally = tallies[name]
            for _ in range(min(BLOCK, steps - tally.steps)):
                ids, labels = batch([data[i] for i in plan[tally.steps % len(plan)]])
                real, computed = int((labels != -100).sum()) + len(ids), ids.numel()
                ids, labels = ids.to(device), labels.to(device)
                sync()
                start = time.perf_counter()
                step(name, ids, labels)
                sync()
                tally.seconds += time.perf_counter() - start
                tally.real, tally.computed = tally.real + real, tally.computed + computed
                tally.steps += 1
        if stop is not None and stop():
            break
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "token_batching.json", quick="5 steps per arm", threads=1)
    parser.add_argument(
        "--steps", type=common.positive_int, default=20, help="timed steps per arm (default 20)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    steps = BLOCK if args.quick else args.steps
    sizes = lengths()
    plans = arms(sizes)
    tallies = interleaved(plans, samples(sizes), steps)
    fixed = tallies[f"batch_size={FIXED}"]
    rows = [["arm", "batches/epoch", "padding", "real tok/s", "vs fixed"]]
    result = {"environment": environment(threads=args.threads), "steps": steps, "arms": {}}
    for name, tally in tallies.items():
        speedup = tally.rate / fixed.rate
        rows.append([name, len(plans[name]), f"{tally.padding:.1%}", f"{tally.rate:,.0f}", f"{speedup:.2f}x"])
        result["arms"][name] = {
            "batches_per_epoch": len(plans[name]),
            "padding": tally.padding,
            "real_tokens_per_s": tally.rate,
            "speedup": speedup,
            "seconds": tally.seconds,
        }
    print_table(rows)
    same_budget = result["arms"][f"max_tokens={FIXED * LONGEST}"]["speedup"]
    met = same_budget >= TARGET
    result["target"] = {"speedup_at_the_same_budget": same_budget, "at_least": TARGET, "met": met}
    print(
        f"\nreal tokens/s at the same worst-case budget: {same_budget:.2f}x the fixed batches (target >= {TARGET}x)"
    )
    write_json(args.out, "token_batching.json", result, started)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
