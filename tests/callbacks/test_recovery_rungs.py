"""The recovery ladder is data: a rung written outside the pack, added through the public API only.

The rung here frees a cache the model keeps (as a model with a KV or feature cache might): worth trying
only when even the smallest micro-batch does not fit. The engine asks it after more micro-batches, turns
it on, retries the batch, saves that it is on, and turns it on again when the run resumes.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_gpuopt import MicroBatchOOMError, OOMRecovery, Rung
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import PlainWide, Waves, fit
from tests.helpers import TRAINER_QUIET, assert_same_training, parameters_of

MiB = 2**20
CACHE = 32 * MiB


class CachingWide(PlainWide):
    """PlainWide that builds a cache in its first forward and keeps it (as a KV or feature cache would be)."""

    def __init__(self, cache_bytes: int = CACHE) -> None:
        super().__init__("adam")
        self.cache_bytes = cache_bytes
        self.cache: torch.Tensor | None = None

    def training_step(self, batch, batch_idx):
        if self.cache_bytes and self.cache is None:
            self.cache = torch.ones(self.cache_bytes // 4)
        return super().training_step(batch, batch_idx)


class DropCache(Rung):
    """Frees the model's cache; remembers how often it was turned on and why."""

    name = "drop the cache"

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        self.loaded: dict | None = None
        self.undone = 0

    def apply(self, trainer, reason):
        module = trainer.lightning_module
        if not module.cache_bytes:
            return False  # nothing left to drop
        module.cache = None
        module.cache_bytes = 0
        self.reasons.append(reason)
        return True

    def undo(self, trainer):
        self.undone += 1

    def state_dict(self):
        return {"times": len(self.reasons)}

    def load_state_dict(self, state):
        self.loaded = dict(state)


def _limit() -> int:
    """Room for the full batch without the cache; never for the cache."""
    run = fit(CachingWide(cache_bytes=0), [OOMRecovery(verbose=False)], steps=2)
    return run.memory.peak_bytes + CACHE // 2


def test_a_rung_added_through_the_public_api_recovers_when_micro_batches_cannot_and_survives_a_resume(
    tmp_path,
):
    limit = _limit()
    reference = fit(CachingWide(cache_bytes=0), [OOMRecovery(verbose=False)], steps=4)
    rung = DropCache()
    model = CachingWide()
    theta0 = parameters_of(model)
    run = fit(model, [OOMRecovery(verbose=False, rungs=[rung])], limit=limit, steps=4)

    assert run.trainer.global_step == 4
    assert len(rung.reasons) == 1 and "the micro-batches cannot get smaller" in rung.reasons[0], rung.reasons
    assert rung.undone == 1  # turned off when the fit ended
    said = [d for d in decisions(run.trainer) if d.kind == "rung"]
    assert len(said) == 1 and "drop the cache on" in said[0].message
    # The batch that ran out of memory was retried, not lost: the same training as without the cache.
    assert_same_training(
        theta0, parameters_of(model), parameters_of(reference.model), floor=0.0, elementwise=True
    )

    path = tmp_path / "rung.ckpt"
    run.trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["callbacks"]["MicroBatchEngine"]
    assert state["rungs"] == ["drop the cache"] and state["rung_state"] == {"drop the cache": {"times": 1}}

    resumed_rung = DropCache()
    resumed = CachingWide()
    trainer = pl.Trainer(
        max_steps=5,
        callbacks=[OOMRecovery(verbose=False, rungs=[resumed_rung])],
        precision="64-true",
        **TRAINER_QUIET,
    )

    with SimulatedMemory(limit):
        trainer.fit(resumed, DataLoader(Waves(), batch_size=128), ckpt_path=path)
    assert resumed_rung.reasons == ["restored from checkpoint"] and resumed_rung.loaded == {"times": 1}
    assert resumed.cache is None and trainer.global_step == 5


def test_rungs_must_be_named_rung_objects():
    class Nameless(Rung):
        def apply(self, trainer, reason):
            return True

    with pytest.raises(TypeError, match=r"named `lightning_gpuopt\.Rung`"):
        OOMRecovery(rungs=[Nameless()])
    with pytest.raises(TypeError, match=r"named `lightning_gpuopt\.Rung`"):
        OOMRecovery(rungs=["drop the cache"])
    with pytest.raises(ValueError, match="its own `name`"):
        OOMRecovery(rungs=[DropCache(), DropCache()])


class Useless(Rung):
    """A rung that finds nothing to change."""

    name = "useless"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def apply(self, trainer, reason):
        self.calls += 1
        return False


def test_a_rung_that_changes_nothing_is_tried_once_and_the_run_ends_with_the_breakdown():
    rung = Useless()
    with pytest.raises(MicroBatchOOMError, match="no smaller micro-batch can fit"):
        fit(CachingWide(), [OOMRecovery(verbose=False, rungs=[rung])], limit=_limit(), steps=2)
    assert rung.calls == 1
