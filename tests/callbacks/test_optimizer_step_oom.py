"""Out of memory inside the optimizer step: retried once when nothing was written yet, else a clear error.

Where a too-big model most often dies is Adam creating its state at step 0. Smaller micro-batches cannot
help there; the engine's optimizer-step hook can retry the step once after freeing memory, but only when
no parameter, gradient or optimizer-state tensor was written yet.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.microbatch import OptimizerStepOOMError
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import TRAINER_QUIET, assert_same_training, parameters_of

KiB = 1024


class ParamHeavy(pl.LightningModule):
    """Parameters dominate memory (a 256x256 layer after a tiny one): Adam's state is the big allocation.

    The tiny layer comes first, so that plain Adam writes its parameters before it reaches the big one.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=False)


class StepPressure(pl.Callback):
    """Before the optimizer step at ``step``: set the limit to what is allocated plus ``room``, and optionally
    leave ``garbage`` bytes in a reference cycle that only a garbage collection frees."""

    def __init__(self, step: int, room: int, garbage: int = 0) -> None:
        self.step, self.room, self.garbage = step, room, garbage
        self.param_bytes = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != self.step:
            return
        self.param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        probe = get_probe()
        probe.limit_bytes = probe.allocated_bytes + self.room(self.param_bytes)
        if self.garbage:
            cycle: list = [torch.empty(self.garbage(self.param_bytes) // 4)]
            cycle.append(cycle)  # freed by gc.collect() only


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)


def _fit(callbacks: list, steps: int = 3) -> tuple[ParamHeavy, pl.Trainer, SimulatedMemory, dict]:
    model = ParamHeavy()
    theta0 = parameters_of(model)
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, **TRAINER_QUIET)
    mem = SimulatedMemory()
    try:
        with mem:
            trainer.fit(model, _data())
    finally:
        model.theta0 = theta0
    return model, trainer, mem, theta0


def test_an_oom_while_adam_creates_its_state_is_retried_once_and_trains_as_without_it():
    reference, _, _, theta0 = _fit([OOMRecovery(verbose=False)])
    # Room for Adam's two moments (2x the parameters) and its temporaries, but not for the moments and the
    # garbage left before the step.
    pressure = StepPressure(0, room=lambda pb: 4 * pb + 64 * KiB, garbage=lambda pb: 3 * pb)
    model, trainer, mem, _ = _fit([OOMRecovery(verbose=False), pressure])
    assert mem.num_ooms == 1
    retried = [d.message for d in decisions(trainer) if "optimizer step" in d.message]
    assert len(retried) == 1 and "retried once after freeing memory, and it ran" in retried[0], retried
    assert trainer.global_step == 3
    assert_same_training(theta0, parameters_of(model), parameters_of(reference), floor=0.0, elementwise=True)


def test_an_oom_while_adam_creates_its_state_that_persists_ends_with_the_optimizer_named():
    pressure = StepPressure(0, room=lambda pb: pb)  # one moment fits, two do not
    model = ParamHeavy()
    theta0 = parameters_of(model)
    trainer = pl.Trainer(max_steps=3, callbacks=[OOMRecovery(verbose=False), pressure], **TRAINER_QUIET)
    with pytest.raises(OptimizerStepOOMError) as info, SimulatedMemory() as mem:
        trainer.fit(model, _data())
    message = str(info.value)
    assert mem.num_ooms == 2  # the step and its one retry
    assert "Adam.step" in message and "before it wrote anything" in message and "retried once" in message
    assert "optimizer state" in message and "FSDP2Strategy" in message and "8-bit" in message
    assert all(torch.equal(p, theta0[n]) for n, p in parameters_of(model).items())  # nothing was applied


def test_an_oom_after_the_step_began_writing_is_not_retried():
    # Step 1: the state exists; the tiny layer's update fits, the 256x256 layer's temporaries do not.
    pressure = StepPressure(1, room=lambda pb: 8 * KiB)
    trainer = pl.Trainer(max_steps=3, callbacks=[OOMRecovery(verbose=False), pressure], **TRAINER_QUIET)
    model = ParamHeavy()
    with pytest.raises(OptimizerStepOOMError, match="could not be retried") as info, SimulatedMemory() as mem:
        trainer.fit(model, _data())
    assert mem.num_ooms == 1  # no retry
    assert "Adam.step at step 1" in str(info.value) or "(Adam.step) at step 1" in str(info.value)
    optimizer = trainer.optimizers[0]
    first = model.net[0].weight
    assert optimizer.state[first]["step"].item() == 2  # the tiny layer was written in the failed step


def test_without_oom_recovery_an_oom_in_the_step_propagates_unchanged():
    pressure = StepPressure(0, room=lambda pb: pb)
    trainer = pl.Trainer(max_steps=1, callbacks=[pressure], **TRAINER_QUIET)
    with pytest.raises(torch.OutOfMemoryError) as info, SimulatedMemory():
        trainer.fit(ParamHeavy(), _data())
    assert not isinstance(info.value, OptimizerStepOOMError)
