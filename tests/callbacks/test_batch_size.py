from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import types

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import BatchSizeFinder, ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import GPUOptDataModule, MemoryAwareBatchSize, MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.microbatch.side_effects import SideEffects
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.batch_models import FAMILIES, batch_peak, fit, peaks_at, true_maxima
from tests.callbacks.oom_models import Waves, WideRegressor, optimizer_step_ids
from tests.callbacks.oom_models import fit as fit_wide
from tests.helpers import TRAINER_QUIET, MetricsLogger

MiB = 2**20


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _never_searched(finder: MemoryAwareBatchSize, **kwargs) -> MemoryAwareBatchSize:
    """A callback holding ``finder``'s answer as if restored from a checkpoint: it applies it, it does not search."""
    twin = MemoryAwareBatchSize(**kwargs)
    twin.load_state_dict(finder.state_dict())
    return twin


# --- acceptance: the largest that fits, close below the true maximum -------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "batch_size", "calibration"),
    [("transformer", 64, (8, 56)), ("superlinear", 128, (32, 120))],
    ids=["transformer", "superlinear"],
)
def test_micro_batch_is_within_90_percent_of_the_true_maximum(family, batch_size, calibration):
    """Three limits: chosen <= true max (bisection of real steps) and >= 90 % of it; <= 4 steps; same parameters
    as a run that applied the answer without searching (at the middle limit)."""
    lo, hi = calibration
    peaks = peaks_at(family, [lo, hi], batch_size)
    limits = [int(peaks[lo] + f * (peaks[hi] - peaks[lo])) for f in (0.15, 0.5, 0.85)]
    chosen = {}
    for i, limit in enumerate(limits):
        finder = MemoryAwareBatchSize(target_fraction=1.0)
        run = fit(
            family, [finder], limit=limit, steps=2, batch_size=batch_size
        )  # trains under the limit: no OOM
        assert run.trainer.global_step == 2
        assert 1 <= finder.trials <= 4, finder.result.measurements
        assert finder.k == math.ceil(batch_size / finder.micro_batch_size) > 1
        chosen[limit] = finder.micro_batch_size
        if i != 1:
            continue  # one reference run per model (time); test_trial_steps_leave_no_trace checks the rest
        twin = _never_searched(finder, target_fraction=1.0)
        reference = fit(family, [twin], limit=limit, steps=2, batch_size=batch_size)
        assert twin.result is None and twin.k == finder.k  # it applied the answer without measuring
        assert _same(run.params(), reference.params())  # the trials left no trace in the training
    truth = true_maxima(family, limits, batch_size)
    for limit in limits:
        assert 0.9 * truth[limit] <= chosen[limit] <= truth[limit], (limit, chosen, truth)


@pytest.mark.slow
@pytest.mark.parametrize("room", [MiB // 4, MiB, 2 * MiB], ids=["tight", "middle", "loose"])
def test_resnet18_batch_size_is_within_90_percent_of_the_true_maximum(room):
    """mode='max' on ResNet-18 at 8x8, where parameters dominate and whole batches are cheapest.

    Three limits above the peak of a 64-sample step (about 33 KiB per sample more: room for about 8,
    30 and 60 more samples); the reference run that never searched only at the middle one (time).
    """
    limit = batch_peak("resnet18", 64) + room
    finder = MemoryAwareBatchSize(mode="max", target_fraction=1.0)
    run = fit("resnet18", [finder], limit=limit, steps=2, batch_size=8, datamodule=True)
    size = finder.micro_batch_size
    assert run.trainer.datamodule.batch_size == size and run.trainer.global_step == 2  # trained at it, no OOM
    assert 1 <= finder.trials <= 4, finder.result.measurements
    # The true maximum, by bisection of real runs between the answer (it trained) and 1/0.9 of it.
    fits, fails = size, math.floor(size / 0.9) + 1
    assert batch_peak("resnet18", fails) > limit, f"{fails} fits: {size} is below 90 % of the maximum"
    while fails - fits > 1:
        mid = (fits + fails) // 2
        fits, fails = (mid, fails) if batch_peak("resnet18", mid) <= limit else (fits, mid)
    assert 0.9 * fits <= size <= fits
    if room != MiB:
        return
    twin = _never_searched(finder, mode="max", target_fraction=1.0)
    reference = fit("resnet18", [twin], limit=limit, steps=2, batch_size=8, datamodule=True)
    assert twin.result is None and reference.trainer.datamodule.batch_size == size
    assert _same(run.params(), reference.params())


def test_resnet18_micro_batches_would_raise_the_peak_so_the_batch_stays_whole():
    """Parameters dominate: splitting keeps gradients through the later micro-batches, so whole is cheapest."""
    whole = batch_peak("resnet18", 32)
    finder = MemoryAwareBatchSize(target_fraction=1.0, min_batch_size=2)
    fit("resnet18", [finder], limit=whole + MiB // 2, steps=1, batch_size=32)
    assert (finder.micro_batch_size, finder.k) == (32, 1)
    assert finder.result.measurements[-1].size == 32  # verified whole, after a micro-batch step did not fit


# --- no trace ------------------------------------------------------------------------------------


class Busy(pl.LightningModule):
    """Everything a trial step could leave a trace in: BatchNorm, dropout, a metric, a counter, logs, a scheduler."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(8, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 1)
            )
        self.mean = torchmetrics.MeanMetric()
        self.steps_seen = 0
        self.ids: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        if self.training:  # the loss-weighting check calls training_step in eval mode, once per run
            self.steps_seen += 1
        self.ids.append(ids.tolist())
        loss = F.mse_loss(self.net(x), y)
        self.mean.update(loss.detach())
        self.log("train_loss", loss)
        self.log("noise", torch.rand(()))  # draws from the RNG
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        }


class Witness(pl.Callback):
    """Placed after MemoryAwareBatchSize: what every other callback sees at each batch start and at the end."""

    def __init__(self) -> None:
        self.at_start: list[tuple] = []
        self.backward_calls = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        optimizer = trainer.optimizers[0]
        self.at_start.append(
            (
                batch_idx,
                trainer.global_step,
                len(optimizer.state),
                [p.detach().clone() for p in pl_module.parameters()],
                [b.detach().clone() for b in pl_module.buffers()],
                torch.get_rng_state().clone(),
                random.getstate(),
                np.random.get_state()[1].copy(),
                dict(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
                pl_module.steps_seen,
                float(pl_module.mean.compute()) if pl_module.mean.update_count else None,
                {key: float(value) for key, value in trainer.callback_metrics.items()},
                [p.grad is None for p in pl_module.parameters()],
            )
        )

    def on_before_backward(self, trainer, pl_module, loss):
        self.backward_calls += 1


@functools.cache
def _busy_limit() -> int:
    """60 % of Busy's full-batch peak: the search must split the batch."""
    trainer = pl.Trainer(max_steps=2, **TRAINER_QUIET)
    with SimulatedMemory() as memory:
        trainer.fit(Busy(), DataLoader(Waves(length=1024), batch_size=128))
    return int(0.6 * memory.peak_bytes)


def _compare_starts(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b):
        for x, y in zip(row_a, row_b):
            if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
                assert _same(x, y)
            elif isinstance(x, torch.Tensor):
                assert torch.equal(x, y)
            elif isinstance(x, np.ndarray):
                assert np.array_equal(x, y)
            else:
                assert x == y


def test_trial_steps_leave_no_trace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    limit = _busy_limit()
    runs = {}
    for name in ("searched", "never searched"):
        witness = Witness()
        if name == "searched":
            finder = MemoryAwareBatchSize(target_fraction=1.0)
        else:
            finder = _never_searched(runs["searched"][1], target_fraction=1.0)
        pl.seed_everything(0, verbose=False)
        model = Busy()
        trainer = pl.Trainer(
            max_steps=5,
            callbacks=[finder, witness],
            default_root_dir=tmp_path / name,
            **{**TRAINER_QUIET, "logger": False},
        )
        with SimulatedMemory(limit_bytes=limit):
            trainer.fit(model, DataLoader(Waves(length=1024), batch_size=128, shuffle=True))
        runs[name] = (model, finder, witness, trainer)
    (model, finder, witness, trainer), (ref_model, ref_finder, ref_witness, ref_trainer) = runs.values()
    assert finder.trials >= 2 and ref_finder.result is None and finder.k == ref_finder.k > 1
    # What the first batch start saw after the search equals what it saw without one, and so on.
    _compare_starts(witness.at_start, ref_witness.at_start)
    assert witness.at_start[0][2] == 0  # the optimizer state the trials created lazily is gone again
    assert model.ids == ref_model.ids  # the data order: trials took no batch from the training iterator
    assert model.steps_seen == ref_model.steps_seen == 5 * finder.k  # plain attributes restored
    assert witness.backward_calls == ref_witness.backward_calls  # no hook of another callback ran in a trial
    assert _same(list(model.parameters()), list(ref_model.parameters()))
    assert _same(list(model.buffers()), list(ref_model.buffers()))
    assert trainer.callback_metrics.keys() == ref_trainer.callback_metrics.keys()
    assert os.listdir(tmp_path) == []  # the working and root folders: no temporary files left behind


# --- options -------------------------------------------------------------------------------------


@functools.cache
def _wide_peak() -> int:
    return fit_wide(WideRegressor("adam"), [], steps=2).memory.peak_bytes


def _wide_limit(fraction: float) -> int:
    """A share of the peak of WideRegressor's full-batch steps (batch 128, 64-true, Adam)."""
    return int(_wide_peak() * fraction)


def test_micro_mode_keeps_batch_size_and_optimizer_batch():
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    run = fit_wide(WideRegressor("adam"), [finder], limit=_wide_limit(0.6), steps=3)
    n = finder.micro_batch_size
    assert finder.batch_size == 128 and finder.k == math.ceil(128 / n) > 1
    assert finder.predicted_peak_bytes <= finder.budget_bytes == _wide_limit(0.6)
    assert len(finder.result.measurements) == finder.trials <= 4
    assert (
        max(size for size, *_ in run.model.marks) <= n
    )  # every training_step ran a micro-batch of at most n
    assert optimizer_step_ids(run.model, 1) == [list(range(s * 128, (s + 1) * 128)) for s in range(3)]


def test_whole_batch_that_fits_is_kept_whole():
    finder = MemoryAwareBatchSize()
    fit_wide(WideRegressor("adam"), [finder], limit=64 * MiB, steps=2)
    assert (finder.micro_batch_size, finder.k) == (128, 1)
    assert finder.result.measurements[-1].size == 128  # verified by a real whole-batch step


def test_target_fraction_shrinks_the_budget():
    limit = _wide_limit(1.2)
    sizes = {}
    for fraction in (1.0, 0.5):
        finder = MemoryAwareBatchSize(target_fraction=fraction)
        fit_wide(WideRegressor("adam"), [finder], limit=limit, steps=1)
        assert finder.budget_bytes == int(limit * fraction)
        assert finder.predicted_peak_bytes <= finder.budget_bytes
        sizes[fraction] = finder.micro_batch_size
    assert sizes[0.5] < sizes[1.0]


def test_multiple_of_rounds_the_micro_batch_down():
    limit = _wide_limit(0.6)
    finder = MemoryAwareBatchSize(target_fraction=1.0, multiple_of=16)
    fit_wide(WideRegressor("adam"), [finder], limit=limit, steps=1)
    plain = MemoryAwareBatchSize(target_fraction=1.0)
    fit_wide(WideRegressor("adam"), [plain], limit=limit, steps=1)
    assert finder.micro_batch_size % 16 == 0 and plain.micro_batch_size % 16 != 0
    assert finder.micro_batch_size == plain.micro_batch_size // 16 * 16


def test_max_batch_size_caps_and_min_batch_size_floors():
    capped = MemoryAwareBatchSize(max_batch_size=20)
    fit_wide(WideRegressor("adam"), [capped], limit=64 * MiB, steps=1)
    assert capped.micro_batch_size == 20 and capped.k == math.ceil(128 / 20)
    with pytest.raises(MicroBatchOOMError, match=r"even 100 sample\(s\) per step do not fit"):
        fit_wide(
            WideRegressor("adam"), [MemoryAwareBatchSize(min_batch_size=100)], limit=_wide_limit(0.6), steps=1
        )


def test_nothing_fits_explains_the_measured_memory():
    with pytest.raises(MicroBatchOOMError) as info:
        fit_wide(
            WideRegressor("adam"),
            [MemoryAwareBatchSize(target_fraction=1.0)],
            limit=_wide_limit(0.12),
            steps=1,
        )
    message = str(info.value)
    for part in (
        "even 1 sample(s) per step do not fit",
        "Measured steps:",
        "parameters",
        "gradients",
        "optimizer state",
        "Next steps:",
    ):
        assert part in message, message


class BatchSizeData(GPUOptDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__(batch_size=batch_size, num_workers=0)
        self.data = Waves(length=2048)

    def train_dataset(self):
        return self.data


def test_max_mode_resumed_on_other_ranks_keeps_the_datamodules_batch(tmp_path, caplog):
    """A max-mode search on 2 ranks (its checkpoint says so), resumed on 1: the datamodule keeps the optimizer batch
    (2 x the searched size) and MemoryAwareBatchSize does not put its per-rank size back."""
    finder = MemoryAwareBatchSize(mode="max")
    first = pl.Trainer(
        max_steps=2,
        precision="64-true",
        callbacks=[finder, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        **{**TRAINER_QUIET, "enable_checkpointing": True},
    )
    with SimulatedMemory(limit_bytes=_wide_limit(1.0)):
        first.fit(WideRegressor("sgd"), datamodule=BatchSizeData(batch_size=16))
    size = finder.batch_size
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    checkpoint["callbacks"][finder.state_key]["world_size"] = 2  # as if written by 2 ranks
    checkpoint["BatchSizeData"]["train_loader"]["world_size"] = 2
    torch.save(checkpoint, tmp_path / "two_ranks.ckpt")
    resumed, data = MemoryAwareBatchSize(mode="max"), BatchSizeData(batch_size=16)
    trainer = pl.Trainer(max_steps=3, precision="64-true", callbacks=[resumed], **TRAINER_QUIET)
    with caplog.at_level(logging.INFO), SimulatedMemory(limit_bytes=_wide_limit(1.0)):
        trainer.fit(WideRegressor("sgd"), datamodule=data, ckpt_path=str(tmp_path / "two_ranks.ckpt"))
    assert data.batch_size == resumed.batch_size == 2 * size
    assert f"batch_size {size} -> {2 * size} per rank, keeping the optimizer batch" in caplog.text
    assert f"batch_size {2 * size} per rank as the data set it, not the searched size" in caplog.text


@pytest.mark.parametrize(
    ("rule", "factor"),
    [(None, None), ("linear", lambda r: r), ("sqrt", math.sqrt)],
    ids=["no-lr-scaling", "linear", "sqrt"],
)
def test_max_mode_raises_batch_size_and_says_so(rule, factor, caplog):
    finder = MemoryAwareBatchSize(mode="max", lr_scaling=rule)
    model = WideRegressor("sgd", scheduler=True)
    trainer = pl.Trainer(max_steps=2, precision="64-true", callbacks=[finder], **TRAINER_QUIET)
    data = BatchSizeData(batch_size=16)
    with caplog.at_level(logging.INFO), SimulatedMemory(limit_bytes=_wide_limit(1.0)):
        trainer.fit(model, datamodule=data)
    size = finder.micro_batch_size
    assert data.batch_size == finder.batch_size == size > 16
    assert [samples for samples, *_ in model.marks] == [size, size]  # the loaders were built at the new size
    assert f"batch_size 16 -> {size}: the optimizer batch changes 16 -> {size}" in caplog.text
    lr = trainer.optimizers[0].param_groups[0]["initial_lr"]
    assert lr == pytest.approx(0.05 * (factor(size / 16) if factor else 1.0))


def test_max_mode_needs_a_batch_size_attribute():
    with pytest.raises(RuntimeError, match=r"mode='max'\) sets `batch_size`, but neither"):
        fit_wide(WideRegressor("adam"), [MemoryAwareBatchSize(mode="max")], limit=64 * MiB, steps=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "auto"}, ValueError, r"`mode` must be one of \('micro', 'max'\), got 'auto'"),
        ({"target_fraction": 0}, ValueError, r"`target_fraction` must be in \(0, 1\], got 0"),
        ({"target_fraction": 1.5}, ValueError, r"`target_fraction` must be in \(0, 1\], got 1.5"),
        ({"target_fraction": True}, ValueError, r"`target_fraction` must be in \(0, 1\], got True"),
        ({"multiple_of": 0}, ValueError, r"`multiple_of` must be a positive int or None, got 0"),
        ({"min_batch_size": 2.5}, ValueError, r"`min_batch_size` must be a positive int, got 2.5"),
        ({"max_batch_size": -1}, ValueError, r"`max_batch_size` must be a positive int or None, got -1"),
        (
            {"min_batch_size": 8, "max_batch_size": 4},
            ValueError,
            r"`max_batch_size` must be >= `min_batch_size` \(8\), got 4",
        ),
        (
            {"mode": "max", "lr_scaling": "cubic"},
            ValueError,
            r"`lr_scaling` must be one of \(None, 'linear', 'sqrt'\), got 'cubic'",
        ),
        ({"lr_scaling": "linear"}, ValueError, r"`lr_scaling` applies to mode='max' only"),
    ],
    ids=[
        "mode",
        "fraction-0",
        "fraction-1.5",
        "fraction-bool",
        "multiple_of",
        "min",
        "max",
        "min>max",
        "lr",
        "lr-micro",
    ],
)
def test_bad_arguments_fail_in_init(kwargs, error, message):
    with pytest.raises(error, match=message):
        MemoryAwareBatchSize(**kwargs)


# --- refused setups -----------------------------------------------------------------------------


class Manual(WideRegressor):
    def __init__(self):
        super().__init__("sgd")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.optimizers().step()


class ClosureOptimizer(WideRegressor):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("make_model", "extra", "message"),
    [
        (Manual, [], r"needs automatic optimization.*Choose the batch size yourself"),
    ],
    ids=["manual-optimization"],
)
def test_unsupported_setups_are_refused_with_the_alternative(make_model, extra, message):
    with pytest.raises(RuntimeError, match=message):
        fit_wide(make_model(), [MemoryAwareBatchSize(), *extra], limit=64 * MiB, steps=1)


def test_batch_size_finder_in_the_same_trainer_is_refused():
    trainer = pl.Trainer(max_steps=1, callbacks=[MemoryAwareBatchSize(), BatchSizeFinder()], **TRAINER_QUIET)
    with pytest.raises(RuntimeError, match=r"cannot run beside Lightning's BatchSizeFinder"):
        trainer.fit(WideRegressor("sgd"), datamodule=BatchSizeData())


def test_setups_the_engine_cannot_run_are_refused_by_it():
    with pytest.raises(
        RuntimeError, match=r"MemoryAwareBatchSize: Micro-batching cannot run closure optimizers"
    ):
        fit_wide(ClosureOptimizer("sgd"), [MemoryAwareBatchSize()], limit=64 * MiB, steps=1)


def test_sharded_strategies_are_refused():
    from lightning.pytorch.strategies import FSDPStrategy

    trainer = types.SimpleNamespace(strategy=FSDPStrategy(), callbacks=[])
    with pytest.raises(
        RuntimeError,
        match=r"measures single-device, DDP and FSDP2 training, got FSDPStrategy \(.*use FSDP2Strategy",
    ):
        MemoryAwareBatchSize().setup(trainer, WideRegressor(), "fit")


def test_sync_batchnorm_under_several_processes_is_refused():
    module = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    trainer = types.SimpleNamespace(world_size=2)
    with pytest.raises(
        RuntimeError, match=r"cannot measure a model with SyncBatchNorm.*sync_batchnorm=False"
    ):
        MemoryAwareBatchSize().on_fit_start(trainer, module)


def test_on_cpu_without_simulated_memory_there_is_nothing_to_measure(caplog):
    finder = MemoryAwareBatchSize()
    with caplog.at_level(logging.INFO):
        trainer = pl.Trainer(max_steps=2, callbacks=[finder], **TRAINER_QUIET)
        trainer.fit(WideRegressor("sgd"), DataLoader(Waves(length=256), batch_size=32))
    assert "there is no device memory to measure" in caplog.text
    assert finder.micro_batch_size is None and finder.k == 1 and MicroBatchEngine.get(trainer) is None


# --- state, resume, re-measuring -----------------------------------------------------------------


def test_resume_does_not_search_again(tmp_path):
    limit = _wide_limit(0.6)
    finder = MemoryAwareBatchSize()
    fit_wide(
        WideRegressor("adam"),
        [finder, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        limit=limit,
        steps=2,
        enable_checkpointing=True,
    )
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"][finder.state_key]
    assert saved["micro_batch_size"] == finder.micro_batch_size and saved["trials"] == finder.trials
    resumed = MemoryAwareBatchSize()
    trainer = pl.Trainer(max_steps=4, precision="64-true", callbacks=[resumed], **TRAINER_QUIET)
    with SimulatedMemory(limit):
        trainer.fit(
            WideRegressor("adam"), DataLoader(Waves(), batch_size=128), ckpt_path=str(tmp_path / "last.ckpt")
        )
    assert resumed.result is None  # nothing measured in this fit
    assert (resumed.micro_batch_size, resumed.k) == (finder.micro_batch_size, finder.k)
    assert trainer.global_step == 4


class SwitchPrecision(pl.Callback):
    """Swaps the precision plugin at a batch start, as a precision-switching callback would."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            trainer.strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")


def test_a_precision_switch_is_measured_again(caplog):
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    limit = _wide_limit(0.6)
    with caplog.at_level(logging.INFO):
        # Runs before MemoryAwareBatchSize at step 2: the switch is seen at the same batch start.
        fit_wide(
            WideRegressor("adam"), [SwitchPrecision(2), finder], limit=limit, steps=4, precision="32-true"
        )
    lines = [line for line in caplog.text.splitlines() if "MemoryAwareBatchSize (" in line]
    assert len(lines) == 2 and "(fit start)" in lines[0] and "(precision switch)" in lines[1]
    assert finder.state_dict()["precision"] == "MixedPrecision:bf16-mixed"


def test_remeasure_on_request(caplog):
    finder = MemoryAwareBatchSize(target_fraction=1.0)

    class Ask(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                finder.remeasure()

    with caplog.at_level(logging.INFO):
        fit_wide(WideRegressor("adam"), [Ask(), finder], limit=_wide_limit(0.6), steps=3)
    lines = [line for line in caplog.text.splitlines() if "MemoryAwareBatchSize (" in line]
    assert len(lines) == 2 and "(requested)" in lines[1]


def test_one_log_line_with_the_numbers_and_logger_metrics(caplog):
    recording = MetricsLogger()
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    with caplog.at_level(logging.INFO):
        fit_wide(WideRegressor("adam"), [finder], limit=_wide_limit(0.6), steps=2, logger=recording)
    lines = [line for line in caplog.text.splitlines() if "MemoryAwareBatchSize" in line]
    assert len(lines) == 1
    n = finder.micro_batch_size
    assert f"the largest micro-batch that fits is {n} sample(s)" in lines[0]
    assert (
        f"batches of 128 run as {finder.k} micro-batch(es) of at most {math.ceil(128 / finder.k)} (k 1 -> {finder.k})"
        in lines[0]
    )
    assert "optimizer batch 128 kept" in lines[0]
    logged = [m for _, m in recording.rows if "gpuopt/search_trials" in m]
    assert logged[0]["gpuopt/predicted_peak_bytes"] == finder.predicted_peak_bytes
    assert logged[0]["gpuopt/search_trials"] == finder.trials


def test_verbose_false_is_silent(caplog):
    with caplog.at_level(logging.INFO):
        fit_wide(
            WideRegressor("adam"), [MemoryAwareBatchSize(verbose=False)], limit=_wide_limit(0.6), steps=1
        )
    assert "MemoryAwareBatchSize" not in caplog.text


# --- beside OOMRecovery, and alone ---------------------------------------------------------------


@pytest.mark.parametrize("order", ["finder-first", "recovery-first"])
def test_beside_oom_recovery_in_either_order(order):
    finder, recovery = MemoryAwareBatchSize(target_fraction=1.0), OOMRecovery()
    callbacks = [finder, recovery] if order == "finder-first" else [recovery, finder]
    run = fit_wide(WideRegressor("adam"), callbacks, limit=_wide_limit(0.6), steps=3)
    assert recovery.failures == []  # the measured answer leaves nothing to recover from
    assert recovery.k == finder.k > 1
    reference = fit_wide(
        WideRegressor("adam"), [_never_searched(finder, target_fraction=1.0)], limit=_wide_limit(0.6), steps=3
    )
    assert _same(run.params(), reference.params())


def test_an_unsplittable_batch_is_measured_whole():
    finder, recovery = MemoryAwareBatchSize(), OOMRecovery(unsplittable=True)
    fit_wide(WideRegressor("adam"), [finder, recovery], limit=64 * MiB, steps=1)
    assert [m.size for m in finder.result.measurements] == [128] and finder.k == 1
    with pytest.raises(MicroBatchOOMError, match=r"even 128 sample\(s\) per step do not fit"):
        fit_wide(
            WideRegressor("adam"),
            [MemoryAwareBatchSize(), OOMRecovery(unsplittable=True)],
            limit=_wide_limit(0.6),
            steps=1,
        )


def test_accumulation_is_kept_and_measured_with_the_window_gradients():
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    alone = MemoryAwareBatchSize(target_fraction=1.0)
    limit = _wide_limit(0.6)
    fit_wide(WideRegressor("adam"), [alone], limit=limit, steps=1)
    run = fit_wide(WideRegressor("adam"), [finder], limit=limit, steps=2, accumulate=2)
    assert run.trainer.accumulate_grad_batches == 2 and run.trainer.global_step == 2
    assert finder.micro_batch_size <= alone.micro_batch_size  # the engine keeps the window's gradients apart


def test_engine_counts_its_own_copies():
    model = Busy()
    trainer = pl.Trainer(max_steps=1, callbacks=[MemoryAwareBatchSize()], **TRAINER_QUIET)
    with SimulatedMemory(64 * MiB):
        trainer.fit(model, DataLoader(Waves(length=256), batch_size=32))
    engine = MicroBatchEngine(trainer)
    assert engine.snapshot_bytes() == 0  # not installed
    norm = sum(b.numel() * b.element_size() for b in model.net[1].buffers())
    metric = sum(
        getattr(model.mean, n).numel() * getattr(model.mean, n).element_size() for n in model.mean._defaults
    )
    assert SideEffects(model).nbytes() == norm + metric  # what an installed engine copies before each batch


# --- DDP -----------------------------------------------------------------------------------------


class PerRankLimit(pl.Callback):
    """Each rank enters its own SimulatedMemory with its own limit; writes what MemoryAwareBatchSize found."""

    def __init__(self, out_dir: str, limits: list[int]) -> None:
        self.out_dir = out_dir
        self.limits = limits

    def setup(self, trainer, pl_module, stage):
        self.memory = SimulatedMemory(limit_bytes=self.limits[trainer.global_rank])
        self.memory.__enter__()

    def teardown(self, trainer, pl_module, stage):
        finder = next(cb for cb in trainer.callbacks if isinstance(cb, MemoryAwareBatchSize))
        result = {
            "rank": trainer.global_rank,
            "local": finder.result.size,
            "agreed": finder.micro_batch_size,
            "k": finder.k,
            "steps": trainer.global_step,
            "ooms": self.memory.num_ooms,
        }
        self.memory.__exit__(None, None, None)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(result, f)


@pytest.mark.slow
def test_ddp_ranks_use_the_smallest_answer(tmp_path):
    limits = [_wide_limit(0.5), _wide_limit(0.8)]
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    trainer = pl.Trainer(
        max_steps=2,
        precision="64-true",
        callbacks=[PerRankLimit(str(tmp_path), limits), finder],
        **{**TRAINER_QUIET, "strategy": "ddp_spawn", "devices": 2},
    )
    trainer.fit(WideRegressor("adam"), DataLoader(Waves(length=1024), batch_size=128))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["local"] < ranks[1]["local"], ranks  # rank 0 has less memory
    assert ranks[0]["agreed"] == ranks[1]["agreed"] == ranks[0]["local"], ranks
    assert ranks[0]["k"] == ranks[1]["k"] > 1 and ranks[0]["steps"] == ranks[1]["steps"] == 2, ranks


@pytest.mark.parametrize(
    "module",
    [
        "lightning_gpuopt.callbacks.batch_size",
        "lightning_gpuopt.batch_size.peak_model",
        "lightning_gpuopt.batch_size.search",
    ],
)
def test_docstring_examples_run(module):
    import doctest
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert tried > 0 and failures == 0


# --- a training_step that skips batches (returns None) ------------------------------------------------


class _SkipsFirst(FAMILIES["superlinear"]):
    """Returns ``None`` (Lightning's skip) for the first ``skips`` batches, or always."""

    skips = 2

    def training_step(self, batch, batch_idx):
        return None if batch_idx < self.skips else super().training_step(batch, batch_idx)


def test_a_step_that_skips_the_first_batches_is_measured_at_the_first_batch_it_trains_on(monkeypatch, caplog):
    limit = peaks_at("superlinear", [32], 64)[32]
    monkeypatch.setitem(FAMILIES, "superlinear", _SkipsFirst)
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    with caplog.at_level(logging.INFO):
        run = fit("superlinear", [finder], limit=limit, steps=4, batch_size=64)
    assert run.trainer.global_step == 4 and finder.micro_batch_size is not None and finder.k > 1
    (line,) = [r.getMessage() for r in caplog.records if "MemoryAwareBatchSize" in r.getMessage()]
    assert "2 batch(es) later: training_step skipped the earlier ones" in line


def test_a_step_that_never_returns_a_loss_stops_after_16_batches_in_one_line(monkeypatch):
    monkeypatch.setattr(_SkipsFirst, "skips", 10**9)
    monkeypatch.setitem(FAMILIES, "superlinear", _SkipsFirst)
    with pytest.raises(
        RuntimeError, match=r"returned no loss for a trial step .* 16 training batches in a row"
    ):
        fit("superlinear", [MemoryAwareBatchSize()], limit=2**40, steps=40, batch_size=16)
