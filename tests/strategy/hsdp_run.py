"""One HSDP fit on 2 "nodes" x 2 CPU processes (gloo), run as a script, once per node.

    NODE_RANK=n MASTER_ADDR=127.0.0.1 MASTER_PORT=P PYTHONPATH=. python tests/strategy/hsdp_run.py OUT_DIR MODE

The test starts this script twice (``NODE_RANK`` 0 and 1); Lightning's launcher starts each node's local
rank 1 by running it again. ``FSDP2Strategy(hsdp=True)`` shards :class:`Deep` (three Linear units) over
the ranks of a node and replicates it across the nodes; one epoch is 4 steps of 128 samples per rank.

MODE ``oom``: one epoch with OOMRecovery; rank 3 (node 1, local rank 1) runs out of memory in three
places: in step 1's forward (a limit set from step 0's peak), in step 2's backward (a limit above step
1's peak), and in step 3 between the reduce-scatter of the first unit's gradients and the replicas'
all-reduce that follows it (torch allocates nothing there, so the test wraps FSDP's reduce-scatter to
allocate once after it returns, under no room at all: a transient OOM). Then ``OUT_DIR/hsdp.ckpt`` is
saved (a distributed checkpoint). MODE ``resume``: a second epoch from that checkpoint, no limit.

Every rank writes ``OUT_DIR/{MODE}-rank{r}.pt``: full parameters, the engine's k history and its k
after each step, failures, how often another rank's OOM stopped it at a vote (by the end of each step),
the error if any.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_gpuopt import FSDP2Strategy, OOMRecovery
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.microbatch.exchange import fsdp2_roots
from tests.callbacks.oom_models import Waves
from tests.helpers import RankRecorder, run_script
from tests.strategy.fsdp2_oom_run import Deep

LIMITED_RANK = 3
STEPS_PER_EPOCH, BATCH, WORLD = 4, 128, 4


class _OOMAfterReduceScatter:
    """FSDP's reduce-scatter, then (once, when armed) an allocation that finds no room left."""

    def __init__(self, inner, owner: RankMemory) -> None:
        self.inner, self.owner = inner, owner

    def allocate(self, *args, **kwargs):
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.owner.armed:
            self.owner.armed = False
            mem = self.owner.mem
            mem.limit_bytes = mem.allocated_bytes
            try:
                torch.empty(1024)  # stands for any buffer a rank would need after the reduce-scatter
            finally:
                mem.limit_bytes = None
        return out


class RankMemory(RankRecorder):
    """Each rank trains under its own SimulatedMemory; rank 3 runs out of memory as the module docs say."""

    lingering_ranks = (LIMITED_RANK,)

    def __init__(self, out_dir: str, mode: str) -> None:
        super().__init__(out_dir)
        self.mode = mode
        self.file = f"{mode}-rank{{rank}}.pt"
        self.armed = False
        self.peer_stops: dict[int, int] = {}
        self.k: dict[int, int] = {}

    def on_train_start(self, trainer, pl_module):
        if (
            trainer.global_rank == LIMITED_RANK
        ):  # the engine's votes go around this wrapper when it installs them
            for root in fsdp2_roots(trainer.strategy.model):
                for sub in root.modules():
                    state = sub._get_fsdp_state() if hasattr(sub, "_get_fsdp_state") else None
                    for group in getattr(state, "_fsdp_param_groups", None) or []:
                        if not isinstance(group._reduce_scatter_comm, _OOMAfterReduceScatter):
                            group._reduce_scatter_comm = _OOMAfterReduceScatter(
                                group._reduce_scatter_comm, self
                            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = MicroBatchEngine.get(trainer)
        self.peer_stops[trainer.global_step - 1] = engine.exchange.peer_stops
        self.k[trainer.global_step - 1] = engine.k
        if self.mode != "oom" or trainer.global_rank != LIMITED_RANK:
            return
        start, kept, peak = pl_module.marks[-1]  # the last micro-batch of the step that just ran
        if trainer.global_step == 1:  # step 1's forward cannot finish
            self.mem.limit_bytes = start + int(0.6 * (peak - start))
        elif trainer.global_step == 2:  # step 2's forward fits, its backward does not
            self.mem.limit_bytes = peak + int(0.25 * kept)
        elif trainer.global_step == 3:  # step 3: between the first reduce-scatter and its all-reduce
            self.mem.limit_bytes = None
            self.armed = True

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
            "k": dict(self.k),
            "failures": len(oom.failures) if oom else 0,
            "peer_stops": dict(self.peer_stops),
            "steps": trainer.global_step,
            "mesh": str(trainer.strategy.shard_mesh),
        }


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(shard_modules=["Linear"], hsdp=True),
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_epochs=2 if mode == "resume" else 1,
        precision="32-true",
        callbacks=[RankMemory(out_dir, mode), OOMRecovery()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(Waves(length=BATCH * WORLD * STEPS_PER_EPOCH), batch_size=BATCH, shuffle=False)
    checkpoint = os.path.join(out_dir, "hsdp.ckpt")
    trainer.fit(Deep(), train, ckpt_path=checkpoint if mode == "resume" else None)
    if mode == "oom":
        trainer.save_checkpoint(checkpoint)


if __name__ == "__main__":
    run_script(main)
