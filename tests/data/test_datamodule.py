from __future__ import annotations

import collections
import logging
import pickle
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_gpuopt import GPUOptDataModule
from lightning_gpuopt.data import CudaStreamTransfer, DevicePrefetchLoader, auto_num_workers, available_cpus
from lightning_gpuopt.data import cpus as cpus_mod
from tests.helpers import TRAINER_QUIET, IndexedRegression, RecordingRegressor


class TrainVal(GPUOptDataModule):
    def __init__(self, n_train: int = 50, n_val: int = 20, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n_train, self.n_val = n_train, n_val

    def train_dataset(self):
        return IndexedRegression(self.n_train)

    def val_dataset(self):
        return IndexedRegression(self.n_val, seed=1)


class TrainOnly(GPUOptDataModule):
    def train_dataset(self):
        return IndexedRegression(30)


def _ids(loader: DataLoader) -> list[int]:
    return [int(i) for ids, _, _ in loader for i in ids]


@pytest.mark.parametrize("num_workers", [0, 2], ids=["in-process", "two-workers"])
def test_every_sample_exactly_once_per_epoch_through_fit(num_workers):
    dm = TrainVal(n_train=50, n_val=20, batch_size=8, num_workers=num_workers)
    model = RecordingRegressor()
    pl.Trainer(max_epochs=2, **TRAINER_QUIET).fit(model, dm)
    # 50 samples, batch 8, drop_last=False: 7 batches an epoch, the last one of 2.
    assert [len(b) for b in model.train_ids] == ([8] * 6 + [2]) * 2
    for epoch in range(2):
        seen = [i for b in model.train_ids[epoch * 7 : (epoch + 1) * 7] for i in b]
        assert collections.Counter(seen) == collections.Counter(range(50))
    # Shuffled: the two epochs see different orders.
    assert model.train_ids[:7] != model.train_ids[7:]
    val_seen = [i for b in model.val_ids for i in b]
    assert sorted(val_seen) == sorted(list(range(20)) * 2)  # validated after each epoch, in order
    assert model.val_ids[0] == list(range(8))


def test_batch_size_is_read_each_time_a_loader_is_built():
    dm = TrainVal(batch_size=10, num_workers=0)
    assert len(next(iter(dm.train_dataloader()))[0]) == 10
    dm.batch_size = 25
    assert [len(ids) for ids, _, _ in dm.train_dataloader()] == [25, 25]


def test_dataset_is_built_once_and_reused():
    calls = []

    class Counting(GPUOptDataModule):
        def train_dataset(self):
            calls.append(1)
            return IndexedRegression(10)

    dm = Counting(batch_size=5, num_workers=0)
    dm.train_dataloader()
    dm.train_dataloader()
    assert len(calls) == 1


def test_eval_batch_size_and_order_of_eval_loaders():
    dm = TrainVal(n_val=20, batch_size=4, eval_batch_size=16, num_workers=0)
    loader = dm.val_dataloader()
    assert loader.batch_size == 16
    assert _ids(loader) == list(range(20))  # evaluation is not shuffled


def test_drop_last_and_shuffle_are_honoured():
    dm = TrainVal(n_train=50, batch_size=8, num_workers=0, drop_last=True, shuffle=False)
    ids = _ids(dm.train_dataloader())
    assert ids == list(range(48))


def test_loader_settings_with_workers():
    dm = TrainVal(batch_size=8, num_workers=3, persistent_workers=True, prefetch_factor=5, pin_memory=False)
    loader = dm.train_dataloader()
    assert loader.num_workers == 3 and loader.persistent_workers and loader.prefetch_factor == 5
    assert loader.pin_memory is False


def test_no_val_dataset_means_no_validation_loop_and_no_warning(recwarn):
    model = RecordingRegressor()
    trainer = pl.Trainer(max_epochs=1, **TRAINER_QUIET)
    trainer.fit(model, TrainOnly(batch_size=10, num_workers=0))
    assert model.val_ids == []
    assert len(model.train_ids) == 3
    assert not [w for w in recwarn if "length" in str(w.message).lower() and "zero" in str(w.message).lower()]


def test_user_written_loader_is_kept():
    class OwnVal(TrainOnly):
        def val_dataloader(self):
            return DataLoader(IndexedRegression(6), batch_size=3)

    model = RecordingRegressor()
    pl.Trainer(max_epochs=1, **TRAINER_QUIET).fit(model, OwnVal(batch_size=10, num_workers=0))
    assert model.val_ids == [[0, 1, 2], [3, 4, 5]]


def test_subclass_of_subclass_keeps_stages():
    class More(TrainVal):
        pass

    model = RecordingRegressor()
    pl.Trainer(max_epochs=1, **TRAINER_QUIET).fit(model, More(n_val=5, batch_size=5, num_workers=0))
    assert model.val_ids == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, r"`batch_size` must be a positive int, got 0"),
        ({"batch_size": -4}, r"`batch_size` must be a positive int, got -4"),
        ({"batch_size": 2.5}, r"`batch_size` must be a positive int, got 2.5"),
        ({"batch_size": True}, r"`batch_size` must be a positive int, got True"),
        ({"eval_batch_size": 0}, r"`eval_batch_size` must be a positive int or None, got 0"),
        ({"num_workers": -1}, r"`num_workers` must be 'auto' or an int >= 0, got -1"),
        ({"num_workers": "many"}, r"`num_workers` must be 'auto' or an int >= 0, got 'many'"),
        ({"pin_memory": "yes"}, r"`pin_memory` must be 'auto', True or False, got 'yes'"),
        ({"prefetch_factor": 0}, r"`prefetch_factor` must be a positive int, got 0"),
        ({"device_prefetch": "on"}, r"`device_prefetch` must be 'auto', True or False, got 'on'"),
    ],
    ids=[
        "bs-zero",
        "bs-negative",
        "bs-float",
        "bs-bool",
        "eval-bs",
        "workers-negative",
        "workers-str",
        "pin",
        "prefetch",
        "device-prefetch",
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainVal(**kwargs)


def test_batch_size_set_to_a_bad_value_later_fails_when_the_loader_is_built():
    dm = TrainVal(batch_size=4, num_workers=0)
    dm.batch_size = 0
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive int, got 0"):
        dm.train_dataloader()


def test_missing_train_dataset_names_the_fix():
    class NoTrain(GPUOptDataModule):
        pass

    with pytest.raises(NotImplementedError, match=r"NoTrain must override `train_dataset\(self\)`"):
        pl.Trainer(max_epochs=1, **TRAINER_QUIET).fit(RecordingRegressor(), NoTrain(num_workers=0))


class ForgotSuper(TrainVal):
    """A subclass whose __init__ sets its own fields but never calls the base's."""

    def __init__(self, n_train: int = 50) -> None:
        self.n_train, self.n_val = n_train, 20


NO_SUPER = (
    "ForgotSuper.__init__ did not call GPUOptDataModule.__init__{}: add `super().__init__(batch_size=...)`, with "
    "the loader options it takes, to ForgotSuper.__init__."
)


@pytest.mark.parametrize(
    ("use", "missing"),
    [
        ("fit", ""),
        ("train_dataloader", ""),
        ("val_dataloader", ""),
        ("batch_size", " (so it has no `batch_size`)"),
        ("num_workers", " (so it has no `num_workers`)"),
    ],
)
def test_a_subclass_that_skips_the_base_init_is_told_what_to_add(use, missing):
    dm = ForgotSuper()
    with pytest.raises(AttributeError) as err:
        if use == "fit":
            pl.Trainer(max_steps=1, **TRAINER_QUIET).fit(RecordingRegressor(), dm)
        elif use.endswith("_dataloader"):
            getattr(dm, use)()
        else:
            getattr(dm, use)
    assert str(err.value) == NO_SUPER.format(missing)
    assert "\n" not in str(err.value) and "_datasets" not in str(err.value)
    assert not hasattr(dm, "batch_size")  # hasattr and getattr with a default keep working


def test_a_missing_attribute_of_a_set_up_datamodule_is_pythons_usual_error():
    dm = TrainVal(num_workers=0)
    with pytest.raises(AttributeError, match=r"^'TrainVal' object has no attribute 'nope'$"):
        dm.nope  # noqa: B018
    assert getattr(dm, "nope", 7) == 7


def test_dataset_method_returning_none_or_junk_is_a_clear_error():
    class NoneTrain(GPUOptDataModule):
        def train_dataset(self):
            return None

    class JunkTrain(GPUOptDataModule):
        def train_dataset(self):
            return 42

    with pytest.raises(ValueError, match=r"NoneTrain.train_dataset\(\) returned None"):
        NoneTrain(num_workers=0).train_dataloader()
    with pytest.raises(TypeError, match=r"JunkTrain.train_dataset\(\) must return a torch Dataset, got int"):
        JunkTrain(num_workers=0).train_dataloader()


@pytest.mark.parametrize(
    ("cpus", "devices", "expected"),
    [(1, 1, 0), (2, 1, 1), (8, 1, 7), (64, 1, 8), (16, 2, 7), (64, 8, 7), (4, 8, 0)],
)
def test_auto_num_workers_rule(cpus, devices, expected):
    assert auto_num_workers(cpus, devices) == expected


def test_auto_workers_use_process_affinity_and_are_announced_once(monkeypatch, caplog):
    monkeypatch.setattr(cpus_mod.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    monkeypatch.setattr(cpus_mod, "_cgroup_cpu_limit", lambda: None)
    dm = TrainVal(batch_size=4)
    with caplog.at_level(logging.INFO):
        assert dm.train_dataloader().num_workers == 4
        assert dm.val_dataloader().num_workers == 4
    announced = [r.getMessage() for r in caplog.records if "num_workers='auto' -> 4" in r.getMessage()]
    assert len(announced) == 1 and "5 CPUs for 1 local device(s)" in announced[0]


def test_pin_memory_auto_is_off_on_cpu():
    dm = TrainVal(batch_size=4, num_workers=0)
    assert dm.resolved_pin_memory() is torch.cuda.is_available()
    assert dm.train_dataloader().pin_memory is torch.cuda.is_available()


@pytest.mark.cuda
def test_pin_memory_auto_is_on_when_training_on_cuda():
    model = RecordingRegressor()
    dm = TrainVal(batch_size=4, num_workers=0)
    trainer = pl.Trainer(max_steps=1, **{**TRAINER_QUIET, "accelerator": "cuda"})
    trainer.fit(model, dm)
    assert dm.resolved_pin_memory() is True


def test_datamodule_pickles_with_its_settings():
    dm = TrainVal(batch_size=7, num_workers=0)
    dm.train_dataloader()
    clone = pickle.loads(pickle.dumps(dm))
    assert clone.batch_size == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(next(iter(clone.train_dataloader()))[0]) == 7


# ---------------------------------------------------------------------------- machine defaults


def _fake_trainer(device: str = "cpu", num_devices: int = 1, module=None) -> SimpleNamespace:
    """What the datamodule reads from its Trainer, without a Trainer (and without a GPU for "cuda")."""
    return SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device(device)),
        num_devices=num_devices,
        lightning_module=module,
    )


@pytest.mark.parametrize(
    ("affinity", "quota", "devices", "expected"),
    [(16, None, 1, 8), (16, None, 4, 3), (16, 4, 1, 3), (64, None, 8, 7), (2, 8, 1, 1), (3, None, 4, 0)],
    ids=[
        "16cpu-1dev",
        "16cpu-4dev",
        "quota-4",
        "64cpu-8dev",
        "quota-above-affinity",
        "fewer-cpus-than-devices",
    ],
)
def test_auto_workers_from_mocked_cpus_quota_and_trainer_devices(
    monkeypatch, affinity, quota, devices, expected
):
    monkeypatch.setattr(cpus_mod.os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    monkeypatch.setattr(cpus_mod, "_cgroup_cpu_limit", lambda: quota)
    dm = TrainVal(batch_size=4)
    dm.trainer = _fake_trainer(num_devices=devices)
    assert dm.resolved_num_workers() == expected
    assert dm.train_dataloader().num_workers == expected


def test_auto_workers_without_a_trainer_count_visible_gpus_and_fall_back_to_cpu_count(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delattr(cpus_mod.os, "sched_getaffinity", raising=False)  # not Linux
    monkeypatch.setattr(cpus_mod.os, "cpu_count", lambda: 12)
    monkeypatch.setattr(cpus_mod, "_cgroup_cpu_limit", lambda: 10)
    dm = TrainVal(batch_size=4)
    with caplog.at_level(logging.INFO):
        assert dm.resolved_num_workers() == 4  # min(12, quota 10) CPUs // 2 devices - 1
    assert "10 CPUs (cgroup quota; affinity allows 12) for 2 local device(s)" in caplog.text


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "150000 100000"}, 2),
        (
            {"cpu.max": "400000 100000", "job/cpu.max": "200000 100000"},
            2,
        ),  # the tighter quota, here the child's
        ({"cpu.max": "100000 100000", "job/cpu.max": "max 100000"}, 1),  # a parent's quota binds its children
        ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({}, None),
    ],
    ids=["v2-max", "v2-1.5cpu", "v2-nested-child", "v2-nested-parent", "v1", "v1-unlimited", "none"],
)
def test_cgroup_cpu_quota(tmp_path, files, expected):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("0::/job\n1:cpu,cpuacct:/\n")
    (root / "cpu,cpuacct").mkdir(parents=True, exist_ok=True)
    assert cpus_mod._cgroup_cpu_limit(str(root), str(proc)) == expected


def test_available_cpus_is_at_least_one_and_at_most_the_affinity():
    assert 1 <= available_cpus() <= len(cpus_mod.os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("pin_memory", "device", "expected"),
    [("auto", "cpu", False), ("auto", "cuda", True), (True, "cpu", True), (False, "cuda", False)],
    ids=["auto-cpu", "auto-cuda", "forced-on", "forced-off"],
)
def test_pinning_decisions(pin_memory, device, expected):
    dm = TrainVal(batch_size=4, num_workers=0, pin_memory=pin_memory)
    dm.trainer = _fake_trainer(device)
    assert dm.resolved_pin_memory() is expected
    assert dm.train_dataloader().pin_memory is expected


class MovesItself(RecordingRegressor):
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


class AugmentsOnHost(TrainVal):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch


@pytest.mark.parametrize(
    ("setting", "device", "module", "datamodule", "expected", "reason"),
    [
        ("auto", None, None, TrainVal, False, "no Trainer attached"),
        ("auto", "cpu", None, TrainVal, False, "training on cpu"),
        ("auto", "cuda", RecordingRegressor(), TrainVal, True, "copied on a side CUDA stream"),
        (
            "auto",
            "cuda",
            MovesItself(),
            TrainVal,
            False,
            "`MovesItself.transfer_batch_to_device` is overridden",
        ),
        (
            "auto",
            "cuda",
            None,
            AugmentsOnHost,
            False,
            "`AugmentsOnHost.on_before_batch_transfer` is overridden",
        ),
        (True, "cuda", MovesItself(), TrainVal, True, None),
        (True, "cpu", None, TrainVal, False, None),  # nothing to do off CUDA
        (False, "cuda", None, TrainVal, False, None),
    ],
    ids=[
        "no-trainer",
        "cpu",
        "gpu",
        "module-moves-itself",
        "host-hook",
        "forced-on",
        "forced-on-cpu",
        "forced-off",
    ],
)
def test_device_prefetch_decisions(caplog, setting, device, module, datamodule, expected, reason):
    dm = datamodule(batch_size=4, num_workers=0, device_prefetch=setting)
    if device is not None:
        dm.trainer = _fake_trainer(device, module=module)
    with caplog.at_level(logging.INFO):
        assert dm.resolved_device_prefetch() is expected
        loader = dm.train_dataloader()  # built without iterating: needs no GPU
    if expected:
        assert isinstance(loader, DevicePrefetchLoader) and isinstance(loader.transfer, CudaStreamTransfer)
        assert loader.transfer.device == torch.device("cuda")
    else:
        assert type(loader) is DataLoader
    assert dm.device_prefetch_bytes == 0 and dm.prefetched_batch_bytes == 0  # nothing copied yet
    announced = [r.getMessage() for r in caplog.records if "device_prefetch='auto'" in r.getMessage()]
    if reason is None:
        assert announced == []
    else:
        assert len(announced) == 1 and f"-> {expected} (" in announced[0] and reason in announced[0]


def test_each_auto_value_is_announced_once_and_again_when_it_changes(caplog):
    dm = TrainVal(batch_size=4, num_workers=0)
    with caplog.at_level(logging.INFO):
        dm.train_dataloader()
        dm.val_dataloader()  # no Trainer: host batches, announced once
        dm.trainer = _fake_trainer("cuda", module=RecordingRegressor())
        dm.resolved_device_prefetch()
        dm.resolved_device_prefetch()
    messages = [r.getMessage() for r in caplog.records if "device_prefetch='auto'" in r.getMessage()]
    assert [m.split(" (")[0] for m in messages] == [
        "GPUOptDataModule: device_prefetch='auto' -> False",
        "GPUOptDataModule: device_prefetch='auto' -> True",
    ]
