"""Two ranks out of memory at the same step, each needing another split, for test_oom_recovery_ddp.py.

    PYTHONPATH=. python tests/callbacks/ddp_two_recoveries_run.py OUT_DIR FRACTION_0 FRACTION_1

DDP on 2 CPU processes (gloo), 64-true, Adam, batches of 128 per rank. Every rank trains under its own
SimulatedMemory; after two unlimited steps, rank r's limit becomes FRACTION_r × the peak of its own full-batch
step, so that both run out of memory at step 2 and each alone would recover at another k (rank 0 at 2, rank 1 at
4 with the fractions the test passes). Each rank writes OUT_DIR/rank{r}.pt: its parameters, the k its OOM handler
proposed after each failure, the engine's agreed changes of k, the (batch_idx, global_step) of each batch and the
sample ids of each batch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.oom_policy import Recovery
from tests.callbacks.oom_models import Waves, WideRegressor
from tests.helpers import RankRecorder, run_script

LIMIT_AFTER = 2  # batches 0 and 1 run without a limit on every rank
STEPS = 6
BATCH = 128


class RecordingRecovery(OOMRecovery):
    """OOMRecovery that records what it decides after each failure: (step, failed k, proposed k)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.proposals: list[tuple[int, int, int | None]] = []

    def decide_oom(self, failure, smallest_failed, splittable):
        recovery = super().decide_oom(failure, smallest_failed, splittable)
        k = recovery.k if isinstance(recovery, Recovery) else recovery
        self.proposals.append((failure.step, failure.k, k))
        return recovery


class TwoLimits(RankRecorder):
    """Rank r's limit becomes ``fractions[r]`` × its own largest step peak at step ``LIMIT_AFTER``."""

    lingering_ranks = (0, 1)

    def __init__(self, out_dir: str, fractions: tuple[float, float]) -> None:
        super().__init__(out_dir)
        self.fractions = fractions
        self.peaks: list[int] = []
        self.batches: list[tuple[int, int]] = []
        self.ids: list[list[int]] = []  # the samples of each batch (Lightning's distributed sampler shuffles)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mem.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((batch_idx, trainer.global_step))
        self.ids.append(batch[0].tolist())
        if self.mem.limit_bytes is None:
            self.peaks.append(self.mem.peak)
            if trainer.global_step == LIMIT_AFTER:
                self.mem.limit_bytes = int(self.fractions[trainer.global_rank] * max(self.peaks))

    def result(self, trainer, pl_module, error):
        engine = MicroBatchEngine.get(trainer)
        return {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "history": [(c.step, c.k_before, c.k_after, c.source) for c in engine.history] if engine else [],
            "proposals": next(c for c in trainer.callbacks if isinstance(c, RecordingRecovery)).proposals,
            "batches": self.batches,
            "steps": trainer.global_step,
            "ids": self.ids,
            "pid": os.getpid(),
        }


def main(out: Path, fractions: tuple[float, float]) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        precision="64-true",
        callbacks=[TwoLimits(str(out), fractions), RecordingRecovery(verbose=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(Waves(length=BATCH * 2 * STEPS), batch_size=BATCH, shuffle=False)
    trainer.fit(WideRegressor("adam"), data)


if __name__ == "__main__":
    run_script(lambda: main(Path(sys.argv[1]), (float(sys.argv[2]), float(sys.argv[3]))))
