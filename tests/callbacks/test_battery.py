"""The same battery for every exported callback: defaults, pickling, copying, state, fit twice, resume."""

from __future__ import annotations

import copy
import inspect
import pickle

import lightning.pytorch as pl
import pytest
import torch
from helpers import TRAINER_QUIET
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from oom_models import Waves, WideRegressor
from torch.utils.data import DataLoader

import lightning_gpuopt.callbacks as pack_callbacks

CALLBACKS = [
    obj
    for name in pack_callbacks.__all__
    if inspect.isclass(obj := getattr(pack_callbacks, name)) and issubclass(obj, Callback)
]


def test_every_public_callback_of_the_package_is_in_the_battery():
    # Found independently of `__all__`: every public Callback class defined in a module of the package.
    import importlib
    import pkgutil

    import lightning_gpuopt

    defined = set()
    for info in pkgutil.walk_packages(lightning_gpuopt.__path__, "lightning_gpuopt."):
        if info.name.rsplit(".", 1)[-1].startswith("_") or info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except (
            ImportError
        ):  # an optional dependency (jsonargparse for the CLI) is missing: no callbacks there
            continue
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Callback)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                defined.add(obj)
    internal = {"EngineState"}  # the engine's own state holder, added by the pack's callbacks
    assert {c.__name__ for c in defined} - internal == {c.__name__ for c in CALLBACKS}
    assert {c.__name__ for c in CALLBACKS} == {
        "DataStallMonitor",
        "GPUOptReport",
        "MemoryAwareBatchSize",
        "OOMRecovery",
        "PrecisionSwitch",
    }


def _fit(callback, steps, root, ckpt_path=None, extra=()):
    pl.seed_everything(0, verbose=False)
    model = WideRegressor("adam", hidden=64)
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[callback, *extra],
        default_root_dir=root,
        **{**TRAINER_QUIET, "enable_checkpointing": bool(extra)},
    )
    trainer.fit(model, DataLoader(Waves(length=256), batch_size=32), ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_constructs_pickles_and_copies(cls):
    callback = cls()
    for clone in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert type(clone) is cls
        assert clone.state_dict() == callback.state_dict()


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_state_dict_is_plain_and_round_trips(cls, tmp_path):
    callback = cls()
    _fit(callback, steps=2, root=tmp_path)
    state = callback.state_dict()
    plain = (int, float, str, bool, list, type(None))
    assert all(isinstance(v, plain) for v in state.values()), state
    fresh = cls()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    fresh.load_state_dict({})  # missing keys fall back to defaults
    assert fresh.state_dict() == cls().state_dict()


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_survives_fit_twice(cls, tmp_path):
    callback = cls()
    _, first = _fit(callback, steps=2, root=tmp_path)
    _, second = _fit(callback, steps=3, root=tmp_path)
    assert first.global_step == 2 and second.global_step == 3


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_resume_reaches_the_same_result_as_without_the_callback(cls, tmp_path):
    """Resuming with the callback lands where Lightning's own resume lands, and restores its state."""
    results = {}
    for name, make in (("plain", Callback), ("with", cls)):
        folder = tmp_path / name
        _, first = _fit(
            make(), steps=8, root=tmp_path, extra=[ModelCheckpoint(dirpath=folder, save_last=True)]
        )
        saved = first.callbacks[0].state_dict()
        callback = make()
        resumed, trainer = _fit(callback, steps=16, root=tmp_path, ckpt_path=str(folder / "last.ckpt"))
        assert trainer.global_step == 16
        if name == "with" and saved:  # a callback without state has nothing in the checkpoint
            restored = cls()
            restored.load_state_dict(
                torch.load(folder / "last.ckpt", weights_only=True)["callbacks"][callback.state_key]
            )
            assert restored.state_dict() == saved
        results[name] = resumed
    for a, b in zip(results["with"].parameters(), results["plain"].parameters()):
        torch.testing.assert_close(a, b)
