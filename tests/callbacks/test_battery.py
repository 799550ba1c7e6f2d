"""The same battery for every exported callback: defaults, pickling, copying, state, fit twice, resume.

The state and resume checks run each callback where it has something to decide: under SimulatedMemory
with a limit the full batch does not fit (so MemoryAwareBatchSize really searches and OOMRecovery really
splits), in a datamodule it can tune, for 8 steps with a checkpoint at step 6. The checkpoint's state
must hold the callback's decisions, and a fresh callback resumed from it must act on them (no new search,
the same k, the same precision, the same RNG) and end where the uninterrupted run ended.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import pickle
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_gpuopt
import lightning_gpuopt.callbacks as pack_callbacks
from lightning_gpuopt import (
    AdaptiveBatchSize,
    DataStallMonitor,
    ExactResume,
    GPUOptDataModule,
    GPUOptReport,
    GradientNoiseScale,
    MemoryAwareBatchSize,
    OOMRecovery,
    PrecisionSwitch,
)
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import StepPeaks, Waves, WideRegressor, step_marks
from tests.helpers import REPO, TRAINER_QUIET

CALLBACKS = [
    obj
    for name in pack_callbacks.__all__
    if inspect.isclass(obj := getattr(pack_callbacks, name)) and issubclass(obj, Callback)
]

BATCH, STEPS, SAVED_AT = 32, 8, 6  # 4 batches per epoch: the checkpoint is mid-epoch, after one epoch


class WaveData(GPUOptDataModule):
    """128 Waves samples; no workers (DataStallMonitor's autotune starts from 0)."""

    def __init__(self) -> None:
        super().__init__(batch_size=BATCH, num_workers=0)

    def train_dataset(self):
        return Waves(length=128)


class Counted(WideRegressor):
    """Also records the size of every training-mode ``training_step`` call: real micro-batches and trial steps
    (the engine's one-time loss-weighting check runs the step in eval mode)."""

    def __init__(self) -> None:
        super().__init__("adam")
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        if self.training:
            self.trained.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


class Draws(Callback):
    """One torch draw per training batch: equal in two runs only if the RNG state is."""

    def __init__(self) -> None:
        self.draws: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.draws[trainer.global_step] = torch.rand(()).item()


@dataclass
class Resumed:
    """One callback's case: the uninterrupted run, the checkpoint it wrote, and the run resumed from it."""

    reference: Callback
    reference_trainer: pl.Trainer
    reference_model: WideRegressor
    reference_draws: Draws
    saved: dict[str, Any]  # the callback's state in the checkpoint
    engine_saved: dict[str, Any]  # the micro-batch engine's state in the checkpoint (if any)
    resumed: Callback
    trainer: pl.Trainer
    model: WideRegressor
    draws: Draws
    limit: int | None


def _fit(callback, limit, root, ckpt_path=None, steps=STEPS, checkpoint=None):
    pl.seed_everything(0, verbose=False)
    model, draws = Counted(), Draws()
    extra = [checkpoint] if checkpoint is not None else []
    trainer = pl.Trainer(
        max_steps=steps,
        precision="64-true",
        callbacks=[callback, draws, *extra],
        default_root_dir=root,
        **{**TRAINER_QUIET, "enable_checkpointing": checkpoint is not None},
    )
    with SimulatedMemory(limit):
        trainer.fit(model, datamodule=WaveData(), ckpt_path=ckpt_path)
    return model, trainer, draws


@pytest.fixture(scope="module")
def limit(tmp_path_factory) -> int:
    """A limit the full batch's step does not fit under, measured here: 3/4 of its growth above the step's start."""
    peaks = StepPeaks()
    model, _, _ = _fit(peaks, None, tmp_path_factory.mktemp("calibrate"), steps=2)
    start, _, _ = step_marks(model)
    return start + int(0.75 * (peaks.peaks[-1] - start))


@dataclass
class Case:
    """How a callback is built, whether it runs under the limit, and what its decisions are."""

    make: Callable[[], Callback]
    limited: bool
    decided: Callable[[dict[str, Any], Resumed], None]
    kept: Callable[[Resumed], None]
    resume_with: Callable[[], Callback] | None = None  # a fresh callback that would decide otherwise


def _stall_decided(state, run):
    # Not stalled (a threshold a CPU step cannot reach): autotune measured epoch 0 and settled on 0 workers.
    assert state["converged"] is True and state["num_workers"] == 0
    assert [t[0] for t in state["trials"]] == [0] and state["trials"][0][1] > 0


def _stall_kept(run):
    assert run.resumed.state_dict()["trials"] == run.saved["trials"]  # no new trial after the resume
    assert run.trainer.datamodule.num_workers == 0


def _exact_decided(state, run):
    assert state["clean"] is True and state["world_size"] == 1 and len(state["rng"]) == 1


def _exact_kept(run):
    after = range(SAVED_AT, STEPS)
    assert [run.draws.draws[s] for s in after] == [run.reference_draws.draws[s] for s in after]


def _report_decided(state, run):
    assert [s["step"] for s in state["steps"]] == list(range(SAVED_AT))
    assert all(s["peak_bytes"] > 0 for s in state["steps"])


def _report_kept(run):
    report = run.resumed.report
    assert [s["step"] for s in report["steps"]] == list(range(STEPS))
    (resume,) = report["resumes"]
    assert (resume["step"], resume["steps_before"]) == (SAVED_AT, SAVED_AT)
    assert (resume["world_size_before"], resume["world_size"], resume["k"]) == (1, 1, 1)


def _batch_size_decided(state, run):
    assert state["batch_size"] == BATCH and state["trials"] >= 2
    assert 1 < state["micro_batch_size"] < BATCH  # a real search: the batch does not fit, one sample does
    assert state["budget_bytes"] <= run.limit


def _batch_size_kept(run):
    n = run.saved["micro_batch_size"]
    assert run.resumed.micro_batch_size == n and run.resumed.k == -(-BATCH // n)
    # Every training step after the resume is a real micro-batch of at most n samples: no trial step ran.
    assert len(run.model.trained) == (STEPS - SAVED_AT) * run.resumed.k and max(run.model.trained) <= n
    assert "batch size" not in {d.kind for d in decisions(run.trainer)}


def _oom_decided(state, run):
    assert state["oom_count"] >= 1
    assert run.engine_saved["k"] >= 2  # k is the engine's, saved once by it


def _oom_kept(run):
    assert run.resumed.failures == []  # it started at the k it had reached: no OOM to find it again
    assert run.resumed.k == run.engine_saved["k"] == run.reference.k


def _precision_decided(state, run):
    assert state["precision"] == state["start"] == "bf16-mixed"


def _precision_kept(run):
    # A fresh PrecisionSwitch() would pick 32-true on a CPU; the resumed one continues in the saved precision.
    assert run.resumed.precision == run.trainer.precision == "bf16-mixed"


def _noise_decided(state, run):
    assert len(state["history"]) == state["count"]


def _noise_kept(run):
    assert run.resumed.ema.count >= run.saved["count"]  # it continued the saved averages


def _adaptive_decided(state, run):
    assert state["base_accumulate"] == state["accumulate"] == 1 and state["samples"] > 0


def _adaptive_kept(run):
    assert run.resumed.samples > run.saved["samples"] and run.resumed.accumulate == 1


CASES: dict[type[Callback], Case] = {
    AdaptiveBatchSize: Case(AdaptiveBatchSize, False, _adaptive_decided, _adaptive_kept),
    GradientNoiseScale: Case(lambda: GradientNoiseScale(every=1), False, _noise_decided, _noise_kept),
    DataStallMonitor: Case(
        lambda: DataStallMonitor(threshold=0.99, window=3, autotune=True), False, _stall_decided, _stall_kept
    ),
    ExactResume: Case(ExactResume, False, _exact_decided, _exact_kept),
    GPUOptReport: Case(lambda: GPUOptReport(plot=False, table=False), False, _report_decided, _report_kept),
    MemoryAwareBatchSize: Case(
        lambda: MemoryAwareBatchSize(verbose=False), True, _batch_size_decided, _batch_size_kept
    ),
    OOMRecovery: Case(lambda: OOMRecovery(verbose=False), True, _oom_decided, _oom_kept),
    PrecisionSwitch: Case(
        lambda: PrecisionSwitch(initial="bf16-mixed", verbose=False),
        False,
        _precision_decided,
        _precision_kept,
        resume_with=lambda: PrecisionSwitch(verbose=False),
    ),
}

_RUNS: dict[type[Callback], Resumed] = {}


@pytest.fixture
def resumed(request, limit, tmp_path_factory) -> Resumed:
    """The callback's case, run once per module: 8 steps with a checkpoint at step 6, then resumed from it."""
    cls = request.param
    if cls not in _RUNS:
        case, root = CASES[cls], tmp_path_factory.mktemp(cls.__name__)
        cap = limit if case.limited else None
        checkpoint = ModelCheckpoint(dirpath=root, filename="at", every_n_train_steps=SAVED_AT, save_top_k=-1)
        reference = case.make()
        model, trainer, draws = _fit(reference, cap, root, checkpoint=checkpoint)
        path = root / "at.ckpt"
        states = torch.load(path, weights_only=False)["callbacks"]
        fresh = (case.resume_with or case.make)()
        again = ModelCheckpoint(dirpath=root / "again", every_n_train_steps=SAVED_AT, save_top_k=-1)
        model2, trainer2, draws2 = _fit(fresh, cap, root, ckpt_path=str(path), checkpoint=again)
        _RUNS[cls] = Resumed(
            reference,
            trainer,
            model,
            draws,
            states[reference.state_key],
            states.get("MicroBatchEngine", {}),
            fresh,
            trainer2,
            model2,
            draws2,
            cap,
        )
    return _RUNS[cls]


# ----------------------------------------------------------------------------- what is exported


def _defined_callbacks() -> set[str]:
    """Every public Callback class defined in a module of the package, found without `__all__`."""
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
                defined.add(name)
    return defined


def test_every_public_callback_is_exported_and_has_a_battery_case():
    internal = {"EngineState"}  # the engine's own state holder, added by the pack's callbacks
    internal |= {"StepBoundaryCheckpoint"}  # a ModelCheckpoint: Lightning's own state and battery
    exported = {c.__name__ for c in CALLBACKS}
    assert _defined_callbacks() - internal == exported
    assert {
        c.__name__ for c in CASES
    } == exported  # a new callback needs a case: what it decides, how it resumes


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_every_exported_callback_is_documented_with_an_example(cls):
    index = (REPO / "docs" / "index.md").read_text()
    row = re.search(rf"^\| `{cls.__name__}` \| Callback \| .+\|$", index, re.MULTILINE)
    assert row, f"docs/index.md's table has no row for {cls.__name__}"
    pages = [
        p for p in (REPO / "docs").glob("*.md") if p.name != "index.md" and cls.__name__ in p.read_text()
    ]
    assert pages, f"no page of docs/ but the index names {cls.__name__}"
    doc = inspect.getdoc(cls) or ""
    assert "Example:" in doc and ">>> " in doc, f"{cls.__name__}'s docstring has no example"
    assert "Args:" in doc or not inspect.signature(cls).parameters, f"{cls.__name__}'s docstring has no Args"


# ----------------------------------------------------------------------------- the battery


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_constructs_pickles_and_copies(cls):
    callback = cls()
    for clone in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert type(clone) is cls
        assert clone.state_dict() == callback.state_dict()


@pytest.mark.parametrize("resumed", CALLBACKS, ids=lambda c: c.__name__, indirect=True)
def test_the_checkpoint_holds_the_decisions_as_plain_values(resumed):
    cls = type(resumed.reference)
    state = resumed.saved
    plain = (int, float, str, bool, list, type(None))
    assert state and all(isinstance(v, plain) for v in state.values()), state
    CASES[cls].decided(state, resumed)
    fresh = cls()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    fresh.load_state_dict({})  # missing keys fall back to defaults
    assert fresh.state_dict() == cls().state_dict()


@pytest.mark.parametrize("resumed", CALLBACKS, ids=lambda c: c.__name__, indirect=True)
def test_a_resumed_callback_acts_on_its_decisions_and_ends_where_the_uninterrupted_run_ended(resumed):
    assert resumed.trainer.global_step == resumed.reference_trainer.global_step == STEPS
    CASES[type(resumed.reference)].kept(resumed)
    for (name, a), b in zip(resumed.model.named_parameters(), resumed.reference_model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_survives_fit_twice(cls, tmp_path):
    callback = cls()
    _, first, _ = _fit(callback, None, tmp_path, steps=2)
    _, second, _ = _fit(callback, None, tmp_path, steps=3)
    assert first.global_step == 2 and second.global_step == 3


@pytest.mark.parametrize(
    "callback",
    [c for c in CALLBACKS if len(inspect.signature(c).parameters) > 8],
    ids=lambda c: c.__name__,
)
def test_a_callback_of_many_arguments_checks_them_in_one_options_dataclass(callback):
    # `gpuopt fit` reads the constructor's signature: it must name exactly the options' fields, in order.
    made = callback()
    fields = [f.name for f in dataclasses.fields(made.options)]
    assert fields == list(inspect.signature(callback).parameters)
    assert all(getattr(made, name) == getattr(made.options, name) for name in fields)
    assert callback(**vars(made.options)).options == made.options
