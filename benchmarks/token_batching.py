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
exit 1 when the target is missed.
"""

from __future__ import annotations

import sys
import time

import common
import torch
from common import arguments, environment, print_table, write_json
from torch import nn

from lightning_gpuopt.data import TokenBatchSampler

VOCAB, WIDTH, HEADS, LAYERS = 256, 64, 4, 2
FIXED = 64
TARGET = 2.5
BLOCK = 5


def lengths(n: int = 2000, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=generator) * 0.6 + 4.38).exp().round().clamp(16, 512).long().tolist()


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(512, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        x = self.embed(ids) + self.position(torch.arange(n))
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def batch(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = s
        labels[row, : len(s) - 1] = s[1:]
    return ids, labels


def arms(sizes: list[int]) -> dict[str, list[list[int]]]:
    order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(1)).tolist()
    out = {f"batch_size={FIXED}": [order[i : i + FIXED] for i in range(0, len(order), FIXED)]}
    for budget in (FIXED * 512, FIXED * 256):
        out[f"max_tokens={budget}"] = TokenBatchSampler(sizes, budget, seed=1).epoch_batches(0)
    return out


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
    data = [
        torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)
    ]
    plans = arms(sizes)
    models = {}
    for name in plans:
        torch.manual_seed(0)
        model = CausalLM()
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    seconds = dict.fromkeys(plans, 0.0)
    real = dict.fromkeys(plans, 0)
    computed = dict.fromkeys(plans, 0)
    done = dict.fromkeys(plans, 0)
    while min(done.values()) < steps:
        for name, plan in plans.items():
            model, optimizer = models[name]
            for _ in range(min(BLOCK, steps - done[name])):
                ids, labels = batch([data[i] for i in plan[done[name] % len(plan)]])
                start = time.perf_counter()
                loss = nn.functional.cross_entropy(
                    model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100
                )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                seconds[name] += time.perf_counter() - start
                real[name] += int((labels != -100).sum()) + len(ids)  # every real token, the last of each too
                computed[name] += ids.numel()
                done[name] += 1
    fixed = next(iter(plans))
    rows = [["arm", "batches/epoch", "padding", "real tok/s", "vs fixed"]]
    result = {"environment": environment(threads=args.threads), "steps": steps, "arms": {}}
    for name in plans:
        rate = real[name] / seconds[name]
        speedup = rate / (real[fixed] / seconds[fixed])
        padding = 1 - real[name] / computed[name]
        rows.append([name, len(plans[name]), f"{padding:.1%}", f"{rate:,.0f}", f"{speedup:.2f}x"])
        result["arms"][name] = {
            "batches_per_epoch": len(plans[name]),
            "padding": padding,
            "real_tokens_per_s": rate,
            "speedup": speedup,
            "seconds": seconds[name],
        }
    print_table(rows)
    same_budget = result["arms"][f"max_tokens={FIXED * 512}"]["speedup"]
    met = same_budget >= TARGET
    result["target"] = {"speedup_at_the_same_budget": same_budget, "at_least": TARGET, "met": met}
    print(
        f"\nreal tokens/s at the same worst-case budget: {same_budget:.2f}x the fixed batches (target >= {TARGET}x)"
    )
    write_json(args.out, "token_batching.json", result, started)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
