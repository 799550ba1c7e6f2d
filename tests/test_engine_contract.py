"""The engine as a contract: callbacks read it through public reads only, and it keeps its state itself."""

from __future__ import annotations

import re

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.microbatch import MicroBatchEngine
from tests.helpers import REPO, TRAINER_QUIET

PACKAGE = REPO / "lightning_gpuopt"
# Another component reached through a local name, then one of its private attributes.
_PRIVATE_READ = re.compile(r"\b(engine|_engine|monitor|holder|switch|finder|recovery)\._[a-z]\w*")


def test_no_component_reads_another_components_private_attributes():
    offenders = []
    for path in [*PACKAGE.glob("callbacks/*.py"), PACKAGE / "cli.py", *PACKAGE.glob("strategy/*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _PRIVATE_READ.search(line) and "self._engine = " not in line:
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


class _Seen(pl.Callback):
    def __init__(self) -> None:
        self.reads: list[tuple[int, int, bool, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        engine = MicroBatchEngine.get(trainer)
        self.reads.append(
            (
                engine.effective_k(batch),
                engine.micro_batch_size(batch),
                engine.installed("train"),
                engine.installed("test"),
            )
        )


def test_public_reads_tell_the_split_of_a_batch():
    seen = _Seen()
    recovery = OOMRecovery(verbose=False)
    trainer = pl.Trainer(max_steps=2, callbacks=[recovery, seen], **TRAINER_QUIET)

    class Split(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                MicroBatchEngine.get(trainer).propose(2, "test", "split the second batch")

    trainer.callbacks.insert(0, Split())
    trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=4))
    assert seen.reads == [(1, 4, True, False), (2, 2, True, False)]
    assert recovery.k == 2
