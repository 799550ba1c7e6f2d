"""The loss-weighting check out of memory on one rank under DDP, 2 CPU processes (gloo), for
test_loss_weighting_memory.py.

    PYTHONPATH=. python tests/microbatch/ddp_weighting_oom_run.py OUT_DIR LIMITED_RANK LIMIT_BYTES

Each rank trains test_loss_weighting_memory's DiagnosedLM under its own SimulatedMemory; LIMITED_RANK's limit
lets a training step on one sample run, not the check on two. Each rank writes its weighting, the lines it
warned and its parameters to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_gpuopt import GPUOptWarning, OOMRecovery
from lightning_gpuopt.decisions import decisions
from tests.helpers import TRAINER_QUIET, RankRecorder, run_script
from tests.microbatch.test_loss_weighting_memory import FEW, DiagnosedLM, LongTokens


class WeightingRecorder(RankRecorder):
    lingering_ranks = (0, 1)

    def __init__(self, out_dir: str, limited_rank: int, limit: int) -> None:
        super().__init__(out_dir)
        self.limited_rank, self.limit = limited_rank, limit
        self.lines: list[str] = []
        self._caught = warnings.catch_warnings(record=True)

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self.lines = self._caught.__enter__()
        warnings.simplefilter("always", GPUOptWarning)
        if trainer.global_rank == self.limited_rank:
            self.mem.limit_bytes = self.limit

    def result(self, trainer, pl_module, error):
        self._caught.__exit__(None, None, None)
        oom = next(c for c in trainer.callbacks if isinstance(c, OOMRecovery))
        weighting = [d.data for d in decisions(trainer) if d.kind == "loss weighting"]
        return {
            "weighting": weighting,
            "k": oom.k,
            "lines": [str(w.message) for w in self.lines if issubclass(w.category, GPUOptWarning)],
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "steps": trainer.global_step,
        }


def main(out: Path, limited_rank: int, limit: int) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy="ddp",
        max_steps=2,
        precision="64-true",
        callbacks=[OOMRecovery(verbose=False), WeightingRecorder(str(out), limited_rank, limit)],
        **{**TRAINER_QUIET, "devices": 2},
    )
    trainer.fit(DiagnosedLM(), DataLoader(LongTokens(), batch_size=FEW, shuffle=False))


if __name__ == "__main__":
    run_script(lambda: main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
