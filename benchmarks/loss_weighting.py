"""Loss weighting: the one-time cost of ``loss_reduction="auto"``'s check, in ms and in % of one step.

    python benchmarks/loss_weighting.py [--quick] [--device cuda]  # about a minute on 2 shared CPU cores

A Hugging Face GPT-2 (right-padded batches, ``labels=-100`` on the padding) and a BERT masked LM, run by
``OOMRecovery()`` at k = 2 from the start: the check's own time against the median later step (CPU time on a
CPU, synchronised wall time on CUDA). Writes ``loss_weighting.json``; details in docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import statistics
import sys

import common
import lightning.pytorch as pl
import torch
from common import StepClock, arguments, patched, write_json
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.microbatch import loss_weighting as lw


class Padded(Dataset):
    def __init__(self, n: int, length: int, vocab: int, masked: bool) -> None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, vocab, (n, length), generator=g)
        lengths = torch.randint(length // 4, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        self.ids = ids * self.mask
        if masked:
            chosen = (torch.rand(n, length, generator=g) < 0.15) & (self.mask == 1)
            chosen[:, 0] = True
            self.labels = self.ids.masked_fill(~chosen, -100)
        else:
            self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Module(pl.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _model(kind: str, width: int, layers: int, vocab: int, length: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2-causal-lm":
        config = dict(vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers, n_head=4)
        return tf.GPT2LMHeadModel(tf.GPT2Config(**config))
    config = dict(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=4)
    config.update(intermediate_size=4 * width, max_position_embeddings=length)
    return tf.BertForMaskedLM(tf.BertConfig(**config))


def measure(kind: str, device: str, quick: bool) -> dict:
    width, layers, vocab, length, batch = (64, 2, 500, 32, 16) if quick else (128, 4, 2000, 64, 32)
    steps = 3 if quick else 8
    sync = torch.cuda.synchronize if device == "cuda" else None
    check_times: list[float] = []
    decide = lw.LossWeighting._decide

    def now() -> float:  # CPU time on a CPU (shared cores), the synchronised wall clock on CUDA
        return StepClock(sync).now()[0 if sync else 1]

    def timed(self, *args, **kwargs):
        start = now()
        try:
            return decide(self, *args, **kwargs)
        finally:
            check_times.append(now() - start)

    oom, timer = OOMRecovery(verbose=False), StepClock(sync)
    oom.load_state_dict({"k": 2})
    data = Padded(batch * steps, length, vocab, masked=kind != "gpt2-causal-lm")
    with patched((lw.LossWeighting, "_decide", timed)):
        trainer = common.trainer(steps, [oom, timer], device)
        trainer.fit(Module(_model(kind, width, layers, vocab, length)), DataLoader(data, batch_size=batch))
    step, check = statistics.median(timer.durations(0 if sync else 1)[1:]), check_times[0]
    result = dict(workload=kind, batch=batch, k=2, weighting=oom.loss_weighting.decided.description)
    result.update(check_ms=1e3 * check, step_ms=1e3 * step)
    return {**result, "check_percent_of_step": 100 * check / step}


def main(argv: list[str] | None = None) -> int:
    quick = "smoke run (CI)"
    parser = arguments(__doc__, "loss_weighting.json", out="build/benchmarks", quick=quick, device="cpu")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.device == "cpu":
        torch.set_num_threads(1)
    rows = [measure(kind, args.device, args.quick) for kind in ("gpt2-causal-lm", "bert-masked-lm")]
    table = [["workload", "weighting", "check ms", "step ms", "% of step"]]
    for r in rows:
        figures = (f"{r['check_ms']:.1f}", f"{r['step_ms']:.1f}", f"{r['check_percent_of_step']:.1f}%")
        table.append([r["workload"], r["weighting"], *figures])
    common.print_table(table)
    meta = {"torch": torch.__version__, "device": args.device, "quick": args.quick}
    write_json(args.out, "loss_weighting.json", {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
