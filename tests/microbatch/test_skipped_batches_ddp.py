"""``None`` from ``training_step`` under DDP: Lightning's own error, on every rank, and no rank left waiting.

Two CPU processes over gloo, split in two micro-batches; only rank 1's step returns ``None``, at its second
batch. The ranks' vote carries the skip, so rank 0 (whose step returned a loss) stops at the same batch with
the same error instead of waiting in the next collective.
"""

from __future__ import annotations

import json
import time

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from tests.helpers import TRAINER_QUIET
from tests.microbatch.stochastic_models import Points, SkipsEveryThird

LIGHTNINGS_ERROR = "Skipping the `training_step` by returning None in distributed training is not supported."


class RankOneSkips(SkipsEveryThird):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, 0)
        return None if self.global_rank == 1 and batch_idx == 1 else loss


class RankError(pl.Callback):
    """Writes what each rank raised to ``rank{r}.json`` (a spawned rank's exception skips ``on_exception``)."""

    def __init__(self, out_dir) -> None:
        self.out_dir = out_dir

    def setup(self, trainer, pl_module, stage):
        run = trainer.fit_loop.run

        def run_and_record():
            try:
                return run()
            except BaseException as error:
                record = {"type": type(error).__module__ + "." + type(error).__name__, "message": str(error)}
                record["step"] = trainer.global_step
                (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
                time.sleep(3)  # the launcher ends the other rank once one failed: let it write its own
                raise

        trainer.fit_loop.run = run_and_record


@pytest.mark.slow
def test_none_under_ddp_gets_lightnings_own_error_on_every_rank(tmp_path):
    oom = OOMRecovery(verbose=False)
    oom.load_state_dict({"k": 2})
    pl.seed_everything(0, verbose=False)
    quiet = {**TRAINER_QUIET, "devices": 2}
    callbacks = [oom, RankError(tmp_path)]
    trainer = pl.Trainer(
        strategy=DDPStrategy(start_method="spawn"), max_steps=4, callbacks=callbacks, **quiet
    )
    with pytest.raises(Exception, match=LIGHTNINGS_ERROR):
        trainer.fit(RankOneSkips(), DataLoader(Points(), batch_size=8, shuffle=False))
    for rank in (0, 1):
        raised = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert raised == {"type": "builtins.RuntimeError", "message": raised["message"], "step": 1}, rank
        assert raised["message"].startswith(LIGHTNINGS_ERROR) and "\n" not in raised["message"]
