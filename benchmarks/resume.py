"""What exact resume costs: checkpoint and resume time as multiples of one training step, and step overhead.

    python benchmarks/resume.py [--hidden 1024] [--steps 30] [--out benchmarks/results]

An MLP (4 layers of ``--hidden``, AdamW) over a GPUOptDataModule with ExactResume: one step's time,
``save_checkpoint`` (median of 5), the extra time of ``fit(ckpt_path=...)`` to its first batch, and the step
overheads of the resumable loader and of ExactResume. Details in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import common
import lightning.pytorch as pl
import torch
from common import Data, StepClock, clocked, markdown_header, markdown_row, positive_int, write_json
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_gpuopt import ExactResume


class MLP(pl.LightningModule):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        layers = [nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.1)]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(args, root: Path, steps: int, resumable: bool, exact: bool, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    callbacks = [clock, ExactResume()] if exact else [clock]
    trainer = common.trainer(steps, callbacks, args.device, default_root_dir=root)
    g, n = torch.Generator().manual_seed(0), args.batch_size * (steps + 5)
    dataset = TensorDataset(torch.randn(n, args.dim, generator=g), torch.randn(n, 1, generator=g))
    data = Data(dataset, batch_size=args.batch_size, num_workers=0, resumable=resumable)
    t0 = time.perf_counter()
    trainer.fit(MLP(args.dim, args.hidden), data, ckpt_path=ckpt_path)
    step_times = clock.periods()[1:]
    return trainer, statistics.median(step_times) if step_times else None, clock.starts[0][0] - t0


def main() -> None:
    parser = common.arguments(__doc__, "resume.json", device="cpu")
    for name, default in (("--hidden", 1024), ("--dim", 256), ("--batch-size", 64), ("--steps", 30)):
        parser.add_argument(name, type=positive_int, default=default)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    _, plain_step, _ = _fit(args, root / "plain", args.steps, resumable=False, exact=False)
    _, resumable_step, _ = _fit(args, root / "resumable", args.steps, resumable=True, exact=False)
    trainer, exact_step, fresh_first = _fit(args, root / "exact", args.steps, resumable=True, exact=True)
    path = root / "exact" / "step.ckpt"
    save = statistics.median(clocked(trainer.save_checkpoint, path)[0] for _ in range(5))
    _, _, resumed_first = _fit(args, root / "exact", args.steps + 3, True, True, ckpt_path=path)
    resume = max(0.0, resumed_first - fresh_first)
    params = sum(p.numel() for p in MLP(args.dim, args.hidden).parameters())
    result = {"device": args.device, "parameters": params, "checkpoint_bytes": path.stat().st_size}
    result.update(step_s=plain_step, checkpoint_s=save, resume_s=resume, checkpoint_steps=save / plain_step)
    result.update(resume_steps=resume / plain_step, resumable_loader_overhead=resumable_step / plain_step - 1)
    result["exact_resume_overhead"] = exact_step / plain_step - 1
    markdown_header(f"{params / 1e6:.1f} M parameters, AdamW, {args.device}|value")
    markdown_row("checkpoint file", f"{result['checkpoint_bytes'] / 2**20:.1f} MiB")
    markdown_row(f"one training step (batch {args.batch_size})", f"{plain_step * 1e3:.1f} ms")
    checkpoint = f"{save * 1e3:.1f} ms = {result['checkpoint_steps']:.1f} steps"
    markdown_row("checkpoint (`save_checkpoint`)", checkpoint)
    steps = result["resume_steps"]
    markdown_row("resume (extra time to the first step)", f"{resume * 1e3:.1f} ms = {steps:.1f} steps")
    markdown_row("step time, resumable loader vs plain", f"{result['resumable_loader_overhead']:+.1%}")
    markdown_row("step time, + ExactResume", f"{result['exact_resume_overhead']:+.1%}")
    write_json(args.out, "resume.json", result)


if __name__ == "__main__":
    main()
