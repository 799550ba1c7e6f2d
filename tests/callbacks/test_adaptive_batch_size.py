"""AdaptiveBatchSize: growth through accumulation at window boundaries, the learning rate, decisions, resume."""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt import AdaptiveBatchSize, GradientNoiseScale
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.goodput import lr_factor, next_accumulation
from tests.callbacks.goodput_models import DroppedQuadratic, Quadratic, quadratic_loader
from tests.helpers import TRAINER_QUIET, MetricsLogger

WARMUP, TOTAL = 20, 400


def _schedule(step: int) -> float:  # warm-up, then cosine, counted in batches of the user's optimizer batch
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(step - WARMUP, TOTAL) / TOTAL))


class Scheduled(Quadratic):
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Windows(pl.Callback):
    """The accumulation each batch ran under and where the optimizer stepped."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch_idx, trainer.accumulate_grad_batches, trainer.global_step))


def _fit(model, callbacks, **kwargs):
    kwargs = {"max_steps": 390, **kwargs}
    trainer = pl.Trainer(precision="64-true", callbacks=callbacks, **{**TRAINER_QUIET, **kwargs})
    trainer.fit(model, quadratic_loader(4096, batch_size=16, steps=400, seed=1))
    return trainer


def test_grows_at_window_boundaries_with_lr_and_samples_schedule():
    windows = Windows()
    grow = AdaptiveBatchSize(interval=10, max_batch=128)
    model = Scheduled(lr=1e-3)
    logger = MetricsLogger()
    trainer = _fit(
        model,
        [GradientNoiseScale(every=1, split_every=1, min_measurements=5, trust=0.5), grow, windows],
        logger=logger,
        log_every_n_steps=1,
    )
    assert grow.changes, "the batch never grew"
    assert len(grow.changes) >= 2 and all(after == 2 * before for _, before, after, *_ in grow.changes)
    assert grow.changes[0][1] == 16 and grow.optimizer_batch <= 128
    # Each change starts where the epoch's batches done are a multiple of the new accumulation.
    for (idx, acc, _), (_, prev, _) in zip(windows.seen[1:], windows.seen):
        if acc != prev:
            assert idx % acc == 0, (idx, prev, acc)
    # The schedule advanced by samples: one step per 16 samples of optimizer batch.
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == grow.samples // 16
    # The learning rate: warm-up + cosine at the samples' step, times the square root of the growth (Adam).
    expected = 1e-3 * math.sqrt(grow.optimizer_batch / 16) * _schedule(scheduler.last_epoch)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    batch_decisions = [d for d in decisions(trainer) if d.kind == "batch size"]
    assert (
        len(batch_decisions) == len(grow.changes) and "optimizer batch 16 -> 32" in batch_decisions[0].message
    )
    assert trainer.accumulate_grad_batches == 1  # the user's, back after fit
    # The loggers got the batch of each step; the fit ended saying how far it grew and why not further.
    logged = {step: m["gpuopt/optimizer_batch"] for step, m in logger.rows if "gpuopt/optimizer_batch" in m}
    assert sorted(logged) == list(range(trainer.global_step))  # every step, at Lightning's step numbers
    assert logged[trainer.global_step - 1] == 16 * windows.seen[-1][1]
    assert sorted(set(logged.values())) == [16 * 2**i for i in range(len(grow.changes) + 1)]
    assert grow.summary().startswith(
        f"optimizer batch 16 -> {grow.optimizer_batch} in {len(grow.changes)} change(s); not grown further: "
    )


def test_never_below_the_users_batch():
    assert (
        next_accumulation(2, 16, 1.0, target_fraction=0.25, factor=2, min_accumulate=2, max_accumulate=64)
        == 2
    )
    assert (
        next_accumulation(8, 16, 1.0, target_fraction=0.25, factor=2, min_accumulate=2, max_accumulate=64)
        == 4
    )
    windows = Windows()
    grow = AdaptiveBatchSize(interval=5)
    _fit(
        Quadratic(lr=1e-3),
        [GradientNoiseScale(every=1), grow, windows],
        max_steps=60,
        accumulate_grad_batches=2,
    )
    assert min(acc for _, acc, _ in windows.seen) == 2


def test_lr_rules_and_bad_arguments():
    assert (
        lr_factor(4.0, "sqrt") == 2.0
        and lr_factor(4.0, "linear") == 4.0
        and lr_factor(4.0, lambda r: 3.0) == 3.0
    )
    with pytest.raises(ValueError, match="`factor` must be an int >= 2"):
        AdaptiveBatchSize(factor=1)
    with pytest.raises(ValueError, match="`lr_scaling` must be one of"):
        AdaptiveBatchSize(lr_scaling="cube")
    with pytest.raises(ValueError, match="`min_batch` must be <= `max_batch`"):
        AdaptiveBatchSize(min_batch=64, max_batch=32)


def test_resume_continues_the_schedule_exactly(tmp_path):
    """Stopped at an epoch's end with a change decided, resumed: the same parameters as the run straight through."""

    def callbacks():
        return [
            GradientNoiseScale(every=1, split_every=1, min_measurements=5, trust=0.5),
            AdaptiveBatchSize(interval=10, max_batch=128),
        ]

    straight = Scheduled(lr=1e-2)
    _fit(straight, callbacks(), max_steps=-1, max_epochs=2)
    first = Scheduled(lr=1e-2)
    trainer = _fit(first, callbacks(), max_steps=-1, max_epochs=1)
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    resumed = Scheduled(lr=1e-2)
    trainer = pl.Trainer(precision="64-true", callbacks=callbacks(), max_epochs=2, **TRAINER_QUIET)
    trainer.fit(resumed, quadratic_loader(4096, batch_size=16, steps=400, seed=1), ckpt_path=path)
    torch.testing.assert_close(resumed.theta, straight.theta, rtol=1e-12, atol=1e-14)  # splits round alike


def test_resumed_on_another_number_of_ranks_the_optimizer_batch_is_counted_from_this_runs_batches(tmp_path):
    """A checkpoint whose per-step batch was 2 ranks x 16 = 32, resumed on one rank of 16 (keep_per_rank): the
    optimizer batch is counted from this run's batches (16 x accumulate_grad_batches), not the checkpoint's 32."""
    trainer = _fit(
        Scheduled(lr=1e-2), [AdaptiveBatchSize(interval=10, max_batch=128)], max_steps=-1, max_epochs=1
    )
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("AdaptiveBatchSize")]
    assert checkpoint["callbacks"][key]["unit"] == 16
    checkpoint["callbacks"][key]["unit"] = 32
    torch.save(checkpoint, path)
    adaptive = AdaptiveBatchSize(interval=10, max_batch=128)
    trainer = pl.Trainer(precision="64-true", callbacks=[adaptive], max_epochs=2, **TRAINER_QUIET)
    trainer.fit(Scheduled(lr=1e-2), quadratic_loader(4096, batch_size=16, steps=400, seed=1), ckpt_path=path)
    assert adaptive.optimizer_batch == 16 * adaptive.accumulate  # (teardown gives the Trainer its own back)


@pytest.mark.parametrize(
    ("callback", "who"),
    [(AdaptiveBatchSize, "AdaptiveBatchSize"), (GradientNoiseScale, "GradientNoiseScale")],
)
def test_an_unsupported_strategy_is_refused_in_setup_naming_the_callback(callback, who):
    """The refusal comes from the support table (AdaptiveBatchSize has its own row), before anything runs."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    trainer = SimpleNamespace(strategy=FSDPStrategy(), callbacks=[])  # FSDP1 needs a GPU to build a Trainer
    with pytest.raises(
        RuntimeError,
        match=rf"^{who}: micro-batching supports single-device, DDP and FSDP2 .*got FSDPStrategy",
    ):
        callback().setup(trainer, Quadratic(), "fit")


@pytest.mark.parametrize(
    ("case", "b_simple", "steps", "noise_kwargs", "grow_kwargs"),
    [
        ("target", 16, 40, {"min_measurements": 5, "trust": 0.5}, {"interval": 5}),
        ("max_batch", 4096, 40, {"min_measurements": 5, "trust": 0.5}, {"interval": 5, "max_batch": 16}),
        (
            "interval",
            4096,
            30,
            {"min_measurements": 5, "trust": 0.5},
            {"interval": 1000, "target_fraction": 1.0},
        ),
        ("measurements", 4096, 30, {"min_measurements": 100}, {"interval": 5}),
        ("nothing_measured", 4096, 10, {}, {"interval": 5}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_says_why_the_batch_did_not_grow(caplog, case, b_simple, steps, noise_kwargs, grow_kwargs):
    """One line at the end of the fit: the batch it stayed at and the reason, with the figures of its state."""
    noise = GradientNoiseScale(every=1, split_every=1, **noise_kwargs)
    grow = AdaptiveBatchSize(**grow_kwargs)
    model = DroppedQuadratic() if case == "nothing_measured" else Quadratic(lr=1e-3)
    trainer = pl.Trainer(max_steps=steps, precision="64-true", callbacks=[noise, grow], **TRAINER_QUIET)
    trainer.fit(model, quadratic_loader(b_simple, batch_size=16, steps=steps, seed=1))
    assert grow.changes == []
    lines = [m for m in caplog.messages if m.startswith("AdaptiveBatchSize: ")]
    assert len(lines) == 1, caplog.messages
    line = lines[0]
    assert line.startswith("AdaptiveBatchSize: the optimizer batch stayed 16: ")
    bound = noise.lower_bound() or math.nan
    expected = {
        "target": rf"a batch of 32 would pass the target {0.25 * bound:,.0f} \(target_fraction 0.25 x the noise "
        rf"scale's lower bound {bound:,.0f}\)$",
        "max_batch": r"a batch of 32 would pass the largest allowed, 16 \(max_batch\)$",
        "interval": rf"{steps} optimizer steps since the start, fewer than interval=1000 \(the noise scale's lower "
        rf"bound {bound:,.0f} would grow it\)$",
        "measurements": rf"the noise scale has {noise.ema.count} of min_measurements=100 measurements$",
        "nothing_measured": r"no noise scale was measured \(GradientNoiseScale's line says why\)$",
    }[case]
    assert re.search(expected, line), line


def test_on_token_batches_the_batch_grows_in_tokens_towards_the_noise_scale():
    """A token-mean loss over batches of about 136 real tokens (16 samples of 1 to 16), accumulation 2: the noise
    scale is counted in tokens (4,096), so the batch grows towards a quarter of its lower bound in tokens, not in
    samples (counted in samples, 16 a batch, it would grow to 64 batches a step)."""
    from lightning_gpuopt import OOMRecovery
    from tests.callbacks.goodput_models import TokenQuadratic, token_quadratic_loader

    grow = AdaptiveBatchSize(interval=10)
    noise = GradientNoiseScale(every=1, split_every=1, min_measurements=5, trust=0.5)
    trainer = pl.Trainer(
        max_steps=200,
        precision="64-true",
        accumulate_grad_batches=2,
        callbacks=[OOMRecovery(loss_reduction="tokens", verbose=False), noise, grow],
        **TRAINER_QUIET,
    )
    trainer.fit(TokenQuadratic(lr=1e-3), token_quadratic_loader(4096, steps=1200))
    assert noise.unit == "tokens" and grow.changes
    per_batch = grow.changes[-1][2] / grow.changes[-1][3]
    assert 120 <= per_batch <= 150  # about 136 real tokens a batch
    bound = noise.lower_bound()
    assert grow.accumulate * per_batch <= 0.25 * bound * 2  # within a factor of the target, in tokens
    assert grow.accumulate <= 16
    (first, *_) = [d.message for d in decisions(trainer) if d.kind == "batch size"]
    assert " tokens (accumulation 2 -> 4)" in first and "noise scale" in first and " tokens, target" in first
    assert " tokens in " in grow.summary() or " tokens: " in grow.summary()
