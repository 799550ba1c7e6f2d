"""OOMRecovery adapting over a run: growing back, splitting before an OOM on thrashing, checkpointing as a fallback."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from lightning_gpuopt import MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import PlainWide, StepLog, StepPeaks, WideRegressor, fit, step_marks


class LimitSchedule(pl.Callback):
    """Sets the SimulatedMemory limit to ``limits[step]`` at the start of the batch of each listed step."""

    def __init__(self, limits: dict[int, int | None]) -> None:
        self.limits = limits

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_gpuopt.memory import get_probe

        if trainer.global_step in self.limits:
            get_probe().limit_bytes = self.limits[trainer.global_step]


def _forward_limit() -> int:
    run = fit(WideRegressor("adam"), [OOMRecovery()], steps=3)
    start, _, forward_peak = step_marks(run.model)
    return start + int(0.7 * (forward_peak - start))  # the full batch cannot finish its forward


def _changes(cb: OOMRecovery, run) -> list[tuple[int, int, int, str]]:
    return [(c.step, c.k_before, c.k_after, c.source) for c in cb.history]


class History(pl.Callback):
    """Keeps the engine's k changes (the engine is released at teardown)."""

    def __init__(self) -> None:
        self.changes: list[tuple[int, int, int, str]] = []

    def on_train_end(self, trainer, pl_module):
        engine = MicroBatchEngine.get(trainer)
        self.changes = [(c.step, c.k_before, c.k_after, c.source) for c in engine.history]


def test_micro_batch_grows_back_when_memory_returns_and_the_result_is_unchanged():
    limit = _forward_limit()
    ref = fit(PlainWide("adam"), [], steps=16)
    cb, history, log = OOMRecovery(grow_back_after=3), History(), StepLog()
    run = fit(PlainWide("adam"), [LimitSchedule({3: limit, 6: None}), cb, history, log], steps=16)
    ooms = [c for c in history.changes if c[3] == "oom"]
    assert ooms and {c[0] for c in ooms} == {3}  # one or more retries of batch 3, nothing after
    k_up = ooms[-1][2]
    # Three clean steps (3, 4, 5) under the low limit predict no room; memory is back at step 6, whose
    # peak predicts room for the whole batch: proposed after step 6, agreed at step 7's vote.
    assert history.changes[len(ooms) :] == [(7, k_up, 1, "grow back")]
    assert len(cb.failures) == len([f for f in cb.failures if f.step == 3])  # no OOM after the limit went
    for got, want in zip(run.params(), ref.params()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_grow_back_does_not_loop_into_oom_when_memory_stays_short():
    limit = _forward_limit()
    cb, history = OOMRecovery(grow_back_after=2), History()
    fit(PlainWide("adam"), [LimitSchedule({3: limit}), cb, history], steps=14)
    assert [c[3] for c in history.changes] == ["oom"] * len(history.changes)  # never grown into the limit
    assert {f.step for f in cb.failures} == {3}


def test_grow_back_can_be_turned_off():
    limit = _forward_limit()
    cb, history = OOMRecovery(grow_back=False), History()
    fit(PlainWide("adam"), [LimitSchedule({3: limit, 5: None}), cb, history], steps=14)
    assert {c[3] for c in history.changes} == {"oom"} and cb.k > 1


def test_a_grown_micro_batch_that_fails_again_doubles_the_wait():
    limit = _forward_limit()
    cb, history = OOMRecovery(grow_back_after=2), History()
    fit(PlainWide("adam"), [LimitSchedule({3: limit, 5: None, 8: limit}), cb, history], steps=16)
    sources = [c[3] for i, c in enumerate(history.changes) if i == 0 or c[3] != history.changes[i - 1][3]]
    assert sources == ["oom", "grow back", "oom"], history.changes  # grown at step 6, failed again at 8
    assert cb.state_dict()["grow_back_wait"] == 4


class ThrashingMemory(SimulatedMemory):
    """SimulatedMemory whose allocator "retries" rise every step from ``start`` on, as a thrashing CUDA cache does."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start, self.steps = start, 0

    @property
    def alloc_retries(self) -> int:
        return max(0, self.steps - self.start)


class CountSteps(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_gpuopt.memory import get_probe

        get_probe().steps += 1


def test_allocator_thrashing_splits_before_an_oom_and_keeps_the_result():
    ref = fit(PlainWide("adam"), [], steps=10)
    cb, history = OOMRecovery(grow_back_after=100), History()
    pl.seed_everything(0, verbose=False)
    model = PlainWide("adam")
    trainer = pl.Trainer(
        max_steps=10,
        precision="64-true",
        callbacks=[cb, history, CountSteps()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    from torch.utils.data import DataLoader

    from tests.callbacks.oom_models import Waves

    with ThrashingMemory(start=3):
        trainer.fit(model, DataLoader(Waves(), batch_size=128, shuffle=False))
    # Retries rose after steps 4 and 5 (two steps in a row): proposed then, agreed at the next vote.
    assert history.changes[0] == (6, 1, 2, "thrash") and not cb.failures
    for got, want in zip(model.parameters(), ref.params()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------- activation checkpointing


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Deep(pl.LightningModule):
    """Eight residual blocks over sequences: a step's memory is mostly the activations each block keeps."""

    def __init__(self, width: int = 64, depth: int = 8) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
            self.head = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch  # x: (batch, tokens, width)
        return F.mse_loss(self.head(self.blocks(x)).mean(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Vectors(Dataset):
    """Sequences of 256 tokens of width 64, one target each."""

    def __init__(self, length: int = 64, tokens: int = 256, width: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(length, tokens, width, generator=g), torch.randn(length, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _deep_peak(checkpointing: bool) -> int:
    """The steady-state step peak at one sample per micro-batch, with or without checkpointing."""
    cb = OOMRecovery(checkpoint_modules=["Block"])
    cb.load_state_dict({"k": 16, "checkpointing": checkpointing})
    peaks = StepPeaks()
    fit(Deep(), [cb, peaks], steps=3, batch_size=16, precision="32-true", dataset=Vectors())
    assert cb.checkpointing is checkpointing
    return peaks.peaks[-1]


def test_checkpointing_is_the_fallback_when_one_sample_does_not_fit(caplog):
    without, with_ckpt = _deep_peak(False), _deep_peak(True)
    assert with_ckpt < without
    limit = (without + with_ckpt) // 2  # one sample fits only with checkpointing
    with pytest.raises(
        MicroBatchOOMError, match=r"OOMRecovery\(checkpoint_modules=\[\.\.\.\]\)` can recompute"
    ):
        fit(
            Deep(),
            [OOMRecovery()],
            limit=limit,
            steps=3,
            batch_size=16,
            precision="32-true",
            dataset=Vectors(),
        )
    cb = OOMRecovery(checkpoint_modules=["Block"])
    with caplog.at_level(logging.INFO):
        run = fit(Deep(), [cb], limit=limit, steps=4, batch_size=16, precision="32-true", dataset=Vectors())
    assert run.trainer.global_step == 4 and cb.checkpointing
    assert "activation checkpointing on for 8 module(s) (Block)" in caplog.text
    assert not any("forward" in vars(block) for block in run.model.blocks)  # removed at teardown
    (holder,) = [
        c for c in run.trainer.callbacks if c.state_key == "MicroBatchEngine"
    ]  # saved once, by the engine
    assert holder.state_dict()["rungs"] == ["activation checkpointing"]


def test_checkpoint_modules_must_name_a_submodule():
    with pytest.raises(
        ValueError,
        match=r"names \['Transformer'\], but Deep has no such submodule; its module types are: Sequential, Block",
    ):
        fit(
            Deep(),
            [OOMRecovery(checkpoint_modules=["Transformer"])],
            steps=1,
            batch_size=16,
            dataset=Vectors(),
        )
