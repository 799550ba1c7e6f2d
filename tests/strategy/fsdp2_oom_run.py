"""One 2-process FSDP2 fit on CPU (gloo), run as a script: Lightning's launcher starts rank 1 by re-running it.

    PYTHONPATH=. python tests/strategy/fsdp2_oom_run.py OUT_DIR RULE CALLBACK [UNITS]

Six training steps of 128 samples per rank, one validation (3 batches of 64 per rank) after step 4.
RULE: ``none``; ``forward`` (from step 2 on, rank 1's full batch cannot finish its forward),
``backward`` (its forward fits, its backward does not), ``tiny`` (not even one sample fits), or
``validation`` (rank 1's validation batches do not fit; training has no limit). CALLBACK: ``1`` adds
OOMRecovery. UNITS: ``linear`` (default: each Linear its own unit) or ``whole`` (the three layers one
root unit: gradients build up through the backward before FSDP reduce-scatters them). Every rank writes ``OUT_DIR/rank{r}.pt``: full parameters, k history, failures, how
often it was stopped by the other rank's OOM, its per-sample validation losses, the error if any.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import FSDP2Strategy, OOMRecovery
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.microbatch import MicroBatchEngine
from tests.callbacks.oom_models import Waves
from tests.helpers import RankRecorder, run_script

LIMITED_RANK, LIMIT_AFTER = 1, 2


class Deep(pl.LightningModule):
    """Three layers, each its own FSDP2 unit (all-gathers and reduce-scatters between the activations); a wide
    hidden layer, so that activations, not parameters, fill the memory."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(8, 4096), nn.Tanh(), nn.Linear(4096, 16), nn.Tanh(), nn.Linear(16, 1)
            )
        self.marks: list[tuple[int, int, int]] = []
        self.val_losses: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        probe = get_probe()
        start = probe.allocated
        probe.reset_peak()
        _, x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.marks.append((start, probe.allocated - start, probe.peak))
        return loss

    def validation_step(self, batch, batch_idx):
        ids, x, y = batch
        loss = F.mse_loss(self.net(x), y, reduction="none").squeeze(1)
        self.val_losses.extend(zip(ids.tolist(), loss.tolist()))
        return loss.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class RankMemory(RankRecorder):
    """Rank r trains under its own SimulatedMemory; rank 1 gets the RULE's limit."""

    lingering_ranks = (LIMITED_RANK,)

    def __init__(self, out_dir: str, rule: str) -> None:
        super().__init__(out_dir)
        self.rule = rule

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.rule in ("none", "validation") or trainer.global_rank != LIMITED_RANK:
            return
        if trainer.global_step != LIMIT_AFTER:
            return
        start, kept, peak = pl_module.marks[-1]  # the last full-batch step, measured on this rank
        self.mem.limit_bytes = {
            "forward": start + int(0.6 * (peak - start)),
            "backward": peak + int(0.25 * kept),
            "tiny": self.mem.allocated_bytes + 24 * 1024,  # less than the smallest unit's gathered parameters
        }[self.rule]

    def on_validation_start(self, trainer, pl_module):
        if self.rule == "validation" and trainer.global_rank == LIMITED_RANK:
            self.mem.limit_bytes = (
                self.mem.allocated_bytes + 2**20
            )  # the largest unit gathered, and a few samples

    def on_validation_end(self, trainer, pl_module):
        if self.rule == "validation":
            self.mem.limit_bytes = None

    def result(self, trainer, pl_module, error):
        engine = MicroBatchEngine.get(trainer)
        oom = next((c for c in trainer.callbacks if isinstance(c, OOMRecovery)), None)
        params = {}
        if error is None:  # gathering is a collective: only when every rank got here
            params = {n: p.full_tensor().detach().clone() for n, p in pl_module.named_parameters()}
        return {
            "params": params,
            "history": [(c.step, c.k_before, c.k_after, c.source, c.stage) for c in engine.history]
            if engine
            else [],
            "failures": len(oom.failures) if oom else 0,
            "peer_stops": getattr(engine.exchange, "peer_stops", 0) if engine else 0,
            "steps": trainer.global_step,
            "val_losses": sorted(pl_module.val_losses),
        }


def main() -> None:
    out_dir, rule, callback = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    units = sys.argv[4] if len(sys.argv) > 4 else "linear"
    pl.seed_everything(0, verbose=False)
    steps = 6
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(shard_modules=["Linear"] if units == "linear" else None),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        precision="32-true",
        callbacks=[RankMemory(out_dir, rule), *([OOMRecovery()] if callback else [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=3,
        val_check_interval=4,
        num_sanity_val_steps=0,
    )
    train = DataLoader(Waves(length=128 * 2 * steps), batch_size=128, shuffle=False)
    val = DataLoader(Waves(length=64 * 2 * 3), batch_size=64, shuffle=False)
    trainer.fit(Deep(), train, val)


if __name__ == "__main__":
    run_script(main)
