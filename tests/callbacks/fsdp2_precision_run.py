"""One 2-process FSDP2 fit on CPU (gloo) with PrecisionSwitch, run as a script: Lightning's launcher re-runs it for rank 1.

    PYTHONPATH=. python tests/callbacks/fsdp2_precision_run.py OUT_DIR MODE

Eight training steps of 16 samples per rank through three ``Linear`` units. MODE:

- ``policy``: ``PrecisionSwitch(initial="bf16-mixed")`` (FSDP2's ``MixedPrecisionPolicy``); at step 3 rank 1's
  loss is infinite while its gradients stay finite, so only the all-reduced verdict tells rank 0.
- ``switch``: ``PrecisionSwitch(initial="bf16-mixed", fsdp2_policy=False)`` (bfloat16 autocast over float32
  sharded parameters, patience 1); at step 3 rank 1's loss and gradients are NaN while bfloat16 is in force.
- ``reference``: the same fit without PrecisionSwitch and without trouble; a plain callback swaps Lightning's
  precision plugin from ``bf16-mixed`` to ``32-true`` at the start of step 3.

Every rank writes ``OUT_DIR/rank{r}.pt``: the full parameters, the dtypes FSDP handed to its all-gathers and
reduce-scatters, the steps really applied (and whether one had non-finite gradients), the training-step calls,
PrecisionSwitch's state and the decisions recorded.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import FSDP2Strategy, PrecisionSwitch
from lightning_gpuopt.decisions import decisions
from tests.callbacks.oom_models import Waves
from tests.callbacks.precision_models import AppliedSteps

TROUBLE_STEP, TROUBLED_RANK, STEPS, BATCH = 3, 1, 8, 16

#: (collective, input dtype, output dtype) of every all-gather and reduce-scatter FSDP issued on this rank.
COLLECTIVES: list[tuple[str, str, str]] = []


def _record(name: str, fn, input_key: str, output_key: str, positions: tuple[int, int]):
    def recorded(*args, **kwargs):
        out = kwargs.get(output_key, args[positions[0]] if len(args) > positions[0] else None)
        inp = kwargs.get(input_key, args[positions[1]] if len(args) > positions[1] else None)
        COLLECTIVES.append((name, str(inp.dtype).replace("torch.", ""), str(out.dtype).replace("torch.", "")))
        return fn(*args, **kwargs)

    return recorded


def record_collectives() -> None:
    """Wrap torch.distributed's all-gather and reduce-scatter entry points, whichever this torch's FSDP2 calls."""
    for name, (input_key, output_key) in {
        "all_gather_single": ("input_tensor", "output_tensor"),
        "all_gather_into_tensor": ("input_tensor", "output_tensor"),
        "reduce_scatter_single": ("input", "output"),
        "reduce_scatter_tensor": ("input", "output"),
    }.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            kind = "all_gather" if name.startswith("all_gather") else "reduce_scatter"
            setattr(dist, name, _record(kind, fn, input_key, output_key, (0, 1)))


class Sharded(pl.LightningModule):
    """Three Linear layers, each its own FSDP2 unit; trouble on one rank at one step while bfloat16 computes."""

    def __init__(self, trouble: str | None) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 1)
            )
        self.trouble = trouble
        self.calls: list[tuple[int, int, str, str]] = []

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        out = self.net(x)
        step = self.trainer.global_step
        self.calls.append((step, batch_idx, self.trainer.precision, str(out.dtype).replace("torch.", "")))
        loss = F.mse_loss(out.float(), y)
        if (
            self.trouble
            and step == TROUBLE_STEP
            and self.global_rank == TROUBLED_RANK
            and out.dtype == torch.bfloat16
        ):
            if self.trouble == "nan":
                loss = loss * float("nan")
            else:  # an infinite loss with finite gradients: only this rank can see it
                loss = loss + float("inf")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SwapAtTroubleStep(pl.Callback):
    """The reference: Lightning's own plugin swap, bf16-mixed → 32-true at the start of the trouble step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == TROUBLE_STEP and trainer.precision == "bf16-mixed":
            trainer.strategy.precision_plugin = Precision()


class Save(pl.Callback):
    def __init__(self, out_dir: str, applied: AppliedSteps, switch: PrecisionSwitch | None) -> None:
        self.out_dir, self.applied, self.switch = out_dir, applied, switch

    def on_fit_end(self, trainer, pl_module):
        result = {
            "params": {n: p.full_tensor().detach().clone() for n, p in pl_module.named_parameters()},
            "sharded_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "collectives": list(COLLECTIVES),
            "applied": self.applied.steps(),
            "nonfinite_applied": self.applied.nonfinite_applied,
            "calls": list(pl_module.calls),
            "precision": trainer.precision,
            "state": self.switch.state_dict() if self.switch else None,
            "decisions": [
                (
                    d.kind,
                    d.data.get("before", d.data.get("held_step")),
                    d.data.get("after", d.data.get("nonfinite")),
                )
                for d in decisions(trainer)
            ],
        }
        torch.save(result, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    pl.seed_everything(0, verbose=False)
    record_collectives()
    applied = AppliedSteps()
    switch = None
    callbacks: list[pl.Callback] = [applied]
    if mode == "policy":
        switch = PrecisionSwitch(initial="bf16-mixed", verbose=False)
    elif mode == "switch":
        switch = PrecisionSwitch(initial="bf16-mixed", fsdp2_policy=False, patience=1, verbose=False)
    else:
        callbacks.append(SwapAtTroubleStep())
    if switch is not None:
        callbacks.append(switch)
    callbacks.append(Save(out_dir, applied, switch))
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(shard_modules=["Linear"]),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        precision=None,
        plugins=[MixedPrecision("bf16-mixed", "cpu")] if switch is None else [],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trouble = {"policy": "inf", "switch": "nan"}.get(mode)
    trainer.fit(Sharded(trouble), DataLoader(Waves(length=BATCH * 2 * STEPS), batch_size=BATCH))
    if dist.is_initialized():  # leave gloo cleanly (its threads can abort the interpreter's exit otherwise)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
