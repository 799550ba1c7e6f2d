"""DataStallMonitor and the rules under it: classification, advice, autotune (CPU, wall clock)."""

from __future__ import annotations

import logging
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import DataStallMonitor, GPUOptDataModule, GPUOptWarning
from lightning_gpuopt.data import (
    Advice,
    LoaderSettings,
    StallMeasurement,
    autotune_num_workers,
    data_wait_fraction,
    is_data_stalled,
    stall_advice,
    stall_message,
)
from tests.helpers import TRAINER_QUIET, MetricsLogger

# ---------------------------------------------------------------------------- the pure rules


@pytest.mark.parametrize(
    ("wait", "compute", "fraction", "stalled"),
    [
        (0.0, 0.0, 0.0, False),
        (1.0, 9.0, 0.1, False),
        (1.1, 8.9, 0.11, True),
        (3.0, 1.0, 0.75, True),
        (-1.0, 1.0, 0.0, False),
    ],
    ids=["nothing", "at-threshold", "above", "mostly-waiting", "clock-jitter"],
)
def test_classification(wait, compute, fraction, stalled):
    assert data_wait_fraction(wait, compute) == pytest.approx(fraction)
    assert is_data_stalled(wait, compute, threshold=0.1) is stalled
    assert StallMeasurement(10, wait, compute).stalled(0.1) is stalled


def _settings(**overrides) -> LoaderSettings:
    base = {
        "num_workers": 0,
        "pin_memory": False,
        "persistent_workers": True,
        "prefetch_factor": None,
        "cpus": 16,
        "local_devices": 2,
        "on_cuda": True,
        "device_prefetch": True,
        "owner": "GPUOptDataModule",
    }
    return LoaderSettings(**{**base, **overrides})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, [("num_workers", 0, 7), ("pin_memory", False, True)]),
        ({"num_workers": 2, "prefetch_factor": 2, "pin_memory": True}, [("num_workers", 2, 4)]),
        ({"num_workers": 5, "prefetch_factor": 2, "pin_memory": True}, [("num_workers", 5, 7)]),
        (
            {"num_workers": 3, "prefetch_factor": 2, "persistent_workers": False, "pin_memory": True},
            [("num_workers", 3, 6), ("persistent_workers", False, True)],
        ),
        (
            {"num_workers": 7, "prefetch_factor": 2, "pin_memory": True, "device_prefetch": False},
            [("device_prefetch", False, True), ("prefetch_factor", 2, 4), ("data pipeline", None, None)],
        ),
        (
            {"num_workers": 1, "prefetch_factor": 8, "pin_memory": True, "cpus": 2, "local_devices": 1},
            [("data pipeline", None, None)],
        ),
        ({"on_cuda": False, "device_prefetch": None}, [("num_workers", 0, 7)]),
        ({"is_dataloader": False}, [("training data", None, None)]),
    ],
    ids=[
        "no-workers",
        "double",
        "up-to-the-limit",
        "restarting-workers",
        "cpu-bound",
        "two-cpus",
        "cpu-training",
        "not-a-loader",
    ],
)
def test_advice_names_the_knob_and_the_value(overrides, expected):
    advice = stall_advice(_settings(**overrides))
    got = [
        (a.knob, a.current, a.suggested) if isinstance(a.suggested, (bool, int)) else (a.knob, None, None)
        for a in advice
    ]
    assert got == expected


def test_message_carries_the_figures_and_the_numbered_advice():
    m = StallMeasurement(steps=50, wait_s=1.0, compute_s=1.5)
    text = stall_message(
        m, 0.1, [Advice("num_workers", 0, 7, "why"), Advice("pin_memory", False, True, "fast")], "epoch 2"
    )
    assert (
        "waited for data 40% of the time over the last 50 steps, epoch 2 (threshold 10%; 20.0 ms waiting vs 30.0 ms"
        in text
    )
    assert "1) `num_workers=7` (now 0): why. 2) `pin_memory=True` (now False): fast." in text


@pytest.mark.parametrize(
    ("trials", "max_workers", "expected"),
    [
        ([(0, 0.070, 0.5)], 7, (1, False)),  # stalled: start using workers
        ([(0, 0.070, 0.5), (1, 0.040, 0.3)], 7, (2, False)),  # it paid: double
        ([(0, 0.070, 0.5), (1, 0.040, 0.3), (2, 0.025, 0.02)], 7, (2, True)),  # no longer stalled: keep
        ([(2, 0.040, 0.3), (4, 0.039, 0.29)], 7, (2, True)),  # a raise that did not pay: back, settled
        ([(4, 0.040, 0.3), (7, 0.030, 0.2)], 7, (7, True)),  # at the limit and still stalled
        ([(4, 0.040, 0.3)], 5, (5, False)),  # doubling is capped at max_workers
    ],
    ids=["start", "double", "healthy", "no-gain", "limit", "capped"],
)
def test_autotune_steps(trials, max_workers, expected):
    step = autotune_num_workers(trials, threshold=0.1, max_workers=max_workers)
    assert (step.num_workers, step.converged) == expected
    assert step.reason


def test_autotune_needs_a_measurement():
    with pytest.raises(ValueError, match="at least one"):
        autotune_num_workers([], threshold=0.1, max_workers=4)


# ---------------------------------------------------------------------------- the callback on real fits

COMPUTE_S = (
    0.05  # a training step "computes" this long (sleeps: the classification, not CPU speed, is tested)
)


class Sleepy(Dataset):
    """``length`` samples; each takes ``delay`` seconds to load."""

    def __init__(self, length: int = 24, delay: float = 0.0) -> None:
        self.length, self.delay = length, delay
        self.x = torch.randn(length, 4)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.x[i].sum(0, keepdim=True)


class SteadyModel(pl.LightningModule):
    def __init__(self, val_delay: float = 0.0, compute: float = COMPUTE_S) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.val_delay = val_delay
        self.compute = compute

    def training_step(self, batch, batch_idx):
        time.sleep(self.compute)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        time.sleep(self.val_delay)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SleepyData(GPUOptDataModule):
    def __init__(self, delay: float = 0.0, length: int = 24, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay, self.length = delay, length

    def train_dataset(self):
        return Sleepy(self.length, self.delay)


SLOW = 0.02  # 4 samples per batch: 80 ms of loading per 50 ms step without workers
#: The step of the fast-data cases: long beside the loop's own overhead, which grows on a busy machine.
FAST_DATA_COMPUTE_S = 0.15


def _fit(monitor, data, epochs: int = 1, model=None, **trainer_kwargs):
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[monitor], **{**TRAINER_QUIET, **trainer_kwargs})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        if isinstance(data, GPUOptDataModule):
            trainer.fit(model or SteadyModel(), datamodule=data)
        else:
            trainer.fit(model or SteadyModel(), train_dataloaders=data)
    return trainer


def test_slow_dataset_is_classified_stalled_with_concrete_advice():
    monitor, logger = DataStallMonitor(window=4), MetricsLogger()
    with pytest.warns(
        GPUOptWarning, match=r"waited for data \d+% .* 1\) `num_workers=1` \(now 0\)"
    ) as record:
        _fit(monitor, SleepyData(delay=SLOW, batch_size=4, num_workers=0), logger=logger, log_every_n_steps=2)
    assert len([w for w in record if issubclass(w.category, GPUOptWarning)]) == 1  # once
    epoch = monitor.history[0]
    assert epoch.steps == 5 and epoch.num_workers == 0 and epoch.stalled(monitor.threshold)
    logged = [
        (step, m["gpuopt/data_wait_fraction"]) for step, m in logger.rows if "gpuopt/data_wait_fraction" in m
    ]
    assert [step for step, _ in logged] == [1, 3, 5]  # where Lightning logs: every log_every_n_steps
    assert all(isinstance(v, float) and v > monitor.threshold for _, v in logged)
    assert monitor.wait_fraction == logged[-1][1]


def test_fast_dataset_is_not_stalled_and_stays_silent():
    monitor = DataStallMonitor(window=4)
    # A step of 0.15 s: the loop's own few ms between steps, longer on a busy machine, stay far below 10 %.
    data = SleepyData(delay=0.0, batch_size=4, num_workers=0)
    _fit(monitor, data, epochs=2, model=SteadyModel(compute=FAST_DATA_COMPUTE_S))  # a warning would fail
    assert [m.steps for m in monitor.history] == [5, 5]
    assert not any(m.stalled(monitor.threshold) for m in monitor.history)
    assert monitor.wait_fraction < monitor.threshold


def test_validation_time_is_not_counted_as_waiting():
    class WithVal(SleepyData):
        def val_dataset(self):
            return Sleepy(4)

    monitor = DataStallMonitor(window=4)
    _fit(
        monitor,
        WithVal(batch_size=4, num_workers=0),
        epochs=2,
        model=SteadyModel(val_delay=0.05),
        limit_val_batches=1,
    )
    assert not any(m.stalled(monitor.threshold) for m in monitor.history)


def test_threshold_and_window_are_honoured():
    data = SleepyData(delay=SLOW, batch_size=4, num_workers=0)
    high = DataStallMonitor(threshold=0.95, window=4)
    _fit(high, data)  # stalled by the default threshold, not by this one: no warning
    assert high.history[0].stalled(0.1) and not high.history[0].stalled(0.95)
    long_window = DataStallMonitor(window=6)
    _fit(long_window, data)  # 5 measured steps never fill a window of 6: no judgement, no warning
    assert long_window.history[0].stalled(0.1)


def test_autotune_raises_workers_between_epochs_while_it_pays():
    monitor = DataStallMonitor(window=4, autotune=True, max_workers=4)
    dm = SleepyData(delay=SLOW, batch_size=4, num_workers=0)
    _fit(monitor, dm, epochs=4)
    workers = [m.num_workers for m in monitor.history]
    # Doubling while stalled and paying: 0, 1, 2, then 2 again or 4 (2 workers feed a step just in time).
    assert workers in ([0, 1, 2, 2], [0, 1, 2, 4]), workers  # the loader was rebuilt with each new count
    assert monitor.history[0].stalled(monitor.threshold) and monitor.history[1].stalled(monitor.threshold)
    assert monitor.history[1].step_s < monitor.history[0].step_s  # the first worker paid
    state = monitor.state_dict()
    assert state["converged"] and dm.num_workers == state["num_workers"] in (2, 4)
    assert [t[0] for t in state["trials"]] == workers[: len(state["trials"])]


def test_autotune_stops_at_max_workers_then_advises_and_resume_restores_its_choice(caplog):
    monitor = DataStallMonitor(window=4, autotune=True, max_workers=1)
    # Settled at the limit and still stalled: the one warning now gives the advice beyond num_workers.
    with pytest.warns(GPUOptWarning, match=r"1\) `prefetch_factor=4` \(now 2\).*cheaper samples") as record:
        _fit(monitor, SleepyData(delay=SLOW, batch_size=4, num_workers=0), epochs=3)
    (warning,) = [str(w.message) for w in record if issubclass(w.category, GPUOptWarning)]
    assert "num_workers=" not in warning.split("Try:")[1]  # autotune owns that knob
    assert [m.num_workers for m in monitor.history] == [0, 1, 1]
    state = monitor.state_dict()
    assert state["num_workers"] == 1 and state["converged"]
    resumed = DataStallMonitor(window=4, autotune=True, max_workers=1)
    resumed.load_state_dict(state)
    dm = SleepyData(delay=0.0, batch_size=4, num_workers=0)
    with caplog.at_level(logging.INFO):
        _fit(resumed, dm, model=SteadyModel(compute=FAST_DATA_COMPUTE_S))  # fast data: silent
    assert dm.num_workers == 1 and resumed.history[0].num_workers == 1
    assert "num_workers=1 restored from the checkpoint" in caplog.text


def test_autotune_with_plain_dataloaders_measures_and_advises_only():
    monitor = DataStallMonitor(window=4, autotune=True)
    loader = DataLoader(Sleepy(24, SLOW), batch_size=4)
    with pytest.warns(GPUOptWarning) as record:
        _fit(monitor, loader)
    messages = [str(w.message) for w in record if issubclass(w.category, GPUOptWarning)]
    assert "cannot rebuild, so it measures and advises only" in messages[0]
    assert "`num_workers=1` (now 0)" in messages[1]  # the advice names the plain DataLoader's knob
    assert [m.num_workers for m in monitor.history] == [0] and monitor.state_dict()["trials"] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 0}, r"`threshold` must be in \(0, 1\), got 0"),
        ({"threshold": 1.5}, r"`threshold` must be in \(0, 1\), got 1.5"),
        ({"window": 0}, r"`window` must be a positive int, got 0"),
        ({"autotune": "yes"}, r"`autotune` must be True or False, got 'yes'"),
        ({"max_workers": 0}, r"`max_workers` must be a positive int or None, got 0"),
    ],
    ids=["threshold-zero", "threshold-high", "window", "autotune", "max-workers"],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataStallMonitor(**kwargs)
