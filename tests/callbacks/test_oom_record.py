"""The OOM record: every OOM the pack handles has one, and its breakdown is what existed at that moment.

Three models (an MLP, a convolutional model, a transformer) run under SimulatedMemory with a limit set
from their own measured step, so that an OOM happens in the forward, in the backward or in the optimizer
step. Each model's training step saves what autograd keeps for backward through its own
``saved_tensors_hooks`` pair: the bytes saved and still alive at the OOM are measured independently of
the pack, at the moment the record is taken, and so are the gradients and optimizer state.
"""

from __future__ import annotations

import csv
import gc
import json
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import GPUOptReport, MemoryAwareBatchSize, OOMRecovery
from lightning_gpuopt.cli import main
from lightning_gpuopt.memory import forensics, get_probe
from lightning_gpuopt.microbatch import OptimizerStepOOMError
from lightning_gpuopt.report import PNG_NAME, summary_rows
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import WideRegressor, fit
from tests.helpers import TRAINER_QUIET

BATCH = 64


class Saved:
    """What autograd saved for backward inside the training step: each packed tensor, while autograd holds it."""

    def __init__(self) -> None:
        self.packed: list[
            tuple[weakref.ref, int, int]
        ] = []  # (the packed tensor, its storage's address, bytes)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        held = (
            t.detach()
        )  # the tensor itself would tie a saved output to its own node: a cycle gc cannot free
        storage = t.untyped_storage()
        self.packed.append((weakref.ref(held), storage.data_ptr(), storage.nbytes()))
        self.packed = [entry for entry in self.packed if entry[0]() is not None]
        return held

    def alive_bytes(self, exclude: set[int]) -> int:
        """Bytes of the distinct storages autograd still holds for a backward, less those in ``exclude``."""
        alive = {ptr: n for ref, ptr, n in self.packed if ref() is not None and ptr not in exclude}
        return sum(alive.values())


class Measured(pl.LightningModule):
    """``net`` over ``(x, y)`` batches with a mean-squared loss; records the forward's memory and what it saves."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "mlp":
            self.net = nn.Sequential(nn.Linear(8, 1024), nn.Tanh(), nn.Linear(1024, 1))
        elif kind == "conv":
            self.net = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(16, 16, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(16, 1),
            )
        else:
            self.net = nn.Sequential(
                nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True),
                nn.Flatten(),
                nn.Linear(16 * 32, 1),
            )
        self.saved = Saved()
        self.marks: list[tuple[int, int]] = []  # (allocated at the step's start, the forward's peak)

    def training_step(self, batch, batch_idx):
        probe = get_probe()
        start = probe.allocated
        probe.reset_peak()
        x, y = batch
        with torch.autograd.graph.saved_tensors_hooks(self.saved.pack, lambda t: t):
            loss = F.mse_loss(self.net(x), y)
        self.marks.append((start, probe.peak))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _data(kind: str) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    shape = {"mlp": (8,), "conv": (3, 16, 16), "transformer": (16, 32)}[kind]
    x = torch.randn(BATCH * 6, *shape, generator=g)
    return DataLoader(TensorDataset(x, x.flatten(1).sum(1, keepdim=True).sin()), batch_size=BATCH)


class Pressure(pl.Callback):
    """At ``step``, a limit from the model's own measured step: ``"forward"`` (the full batch's forward does not
    fit), ``"backward"`` (its forward fits, its backward does not) or ``"optimizer step"`` (Adam's state does not
    fit beside garbage that only a garbage collection frees, which the retry's cleanup does)."""

    def __init__(self, phase: str, step: int = 2) -> None:
        self.phase, self.step = phase, step
        self.fb_peak = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step or self.phase == "optimizer step":
            return
        start, forward_peak = pl_module.marks[-1]
        mem = get_probe()
        mem.limit_bytes = {
            "forward": start + int(0.6 * (forward_peak - start)),
            "backward": forward_peak + int(0.5 * (self.fb_peak - forward_peak)),
        }[self.phase]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.fb_peak = max(self.fb_peak, get_probe().peak)  # forward and backward, measured before the limit
        if self.phase != "optimizer step" or trainer.global_step != 0:
            return
        param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        mem = get_probe()
        self.garbage = [torch.empty(3 * param_bytes // 4)]
        self.garbage.append(self.garbage)  # a reference cycle: freed by gc.collect() only
        self.garbage = None
        mem.limit_bytes = mem.allocated_bytes + param_bytes + 16 * 1024  # one of Adam's two moments fits


class AtTheOOM:
    """Measures, independently of the pack, what the model saved for backward, its gradients and its optimizer
    state when a record's breakdown is taken (``forensics.saved_activations``, wrapped).

    The saved bytes count once the engine has caught the error (``forensics.failure_caught``, wrapped): of what
    the hooks packed and autograd held when the allocation failed, what autograd still holds then. That leaves out
    the inputs the failing operator had packed for a node of its own, which died with it.
    """

    def __init__(self, monkeypatch, model: Measured, trainer_ref: list) -> None:
        self.moments: list[dict[str, int]] = []
        self._held: list[tuple[weakref.ref, int, int]] = []
        saved_activations, failure_caught = forensics.saved_activations, forensics.failure_caught

        def at_the_allocation(device, exclude=None):
            params = list(model.parameters())
            ptrs = {p.untyped_storage().data_ptr() for p in params}
            optimizer = trainer_ref[0].optimizers[0]
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            self._held = [e for e in model.saved.packed if e[0]() is not None and e[1] not in ptrs]
            self.moments.append(
                {
                    "activations": 0,
                    "gradients": sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None),
                    "optimizer_state": sum(v.untyped_storage().nbytes() for v in state),
                }
            )
            return saved_activations(device, exclude)

        def when_caught(error, **context):
            alive = {ptr: n for ref, ptr, n in self._held if ref() is not None}
            self.moments[-1]["activations"] = sum(alive.values())
            return failure_caught(error, **context)

        monkeypatch.setattr(forensics, "saved_activations", at_the_allocation)
        monkeypatch.setattr(forensics, "failure_caught", when_caught)


def _fit(kind: str, phase: str, monkeypatch, tmp_path, steps: int = 4):
    model = Measured(kind)
    report = GPUOptReport(dirpath=str(tmp_path), table=False)
    trainer = pl.Trainer(
        max_steps=steps,
        precision="64-true",
        callbacks=[Pressure(phase), OOMRecovery(verbose=False), report],
        **TRAINER_QUIET,
    )
    at_the_oom = AtTheOOM(monkeypatch, model, [trainer])
    with SimulatedMemory() as mem:
        trainer.fit(model, _data(kind))
    return model, report, mem, at_the_oom


CASES = [(kind, phase) for kind in ("mlp", "conv", "transformer") for phase in ("forward", "backward")] + [
    ("mlp", "optimizer step")
]


@pytest.mark.parametrize(("kind", "phase"), CASES, ids=[f"{k}-{p.replace(' ', '-')}" for k, p in CASES])
def test_every_oom_has_a_record_whose_breakdown_is_what_existed_then(kind, phase, monkeypatch, tmp_path):
    model, report, mem, at_the_oom = _fit(kind, phase, monkeypatch, tmp_path)
    ooms = report.report["ooms"]
    assert len(ooms) == mem.num_ooms >= 1, "one record per OOM the simulated device raised"
    assert len(at_the_oom.moments) == len(ooms)
    assert ooms[0]["phase"] == phase and ooms[0]["stage"] == "train"
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for record, moment in zip(ooms, at_the_oom.moments):
        categories = record["categories"]
        assert set(categories) == {"parameters", "gradients", "optimizer_state", "activations", "other"}
        assert abs(sum(categories.values()) - record["allocated_bytes"]) <= 0.01 * record["allocated_bytes"]
        assert categories["parameters"] == param_bytes
        for name in ("gradients", "optimizer_state"):
            assert abs(categories[name] - moment[name]) <= 0.01 * max(moment[name], 1), (name, record)
        # Within 5 %, plus 64 bytes: a scalar that Lightning keeps for a backward, outside the training step.
        assert abs(categories["activations"] - moment["activations"]) <= 0.05 * moment["activations"] + 64, (
            record,
            moment,
        )
        assert record["rank"] == 0 and record["requested_bytes"] > 0 and record["limit_bytes"]
        assert record["action"], record
    if phase != "optimizer step":
        assert ooms[0]["activations_measured"] and ooms[0]["categories"]["activations"] > 0
        assert ooms[0]["action"].startswith("micro-batch 64 → ")
    else:
        assert ooms[0]["action"].startswith("optimizer step retried once")
        assert ooms[0]["modules"]["top"] == []


class Plain(Measured):
    """Measured without the test's own saved-tensor hooks (the report's measurement of the owners then sees all)."""

    def training_step(self, batch, batch_idx):
        probe = get_probe()
        start = probe.allocated
        probe.reset_peak()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.marks.append((start, probe.peak))
        return loss


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The MLP with an OOM in the forward at step 2."""
    folder = tmp_path_factory.mktemp("plain")
    report = GPUOptReport(dirpath=str(folder), table=False)
    trainer = pl.Trainer(
        max_steps=4,
        precision="64-true",
        callbacks=[Pressure("forward"), OOMRecovery(verbose=False), report],
        **TRAINER_QUIET,
    )
    with SimulatedMemory():
        trainer.fit(Plain("mlp"), _data("mlp"))
    return report, folder


def test_a_record_names_the_modules_that_own_the_activations_and_the_picture_is_drawn(plain_run):
    report, folder = plain_run
    record = report.report["ooms"][0]
    assert record["modules"]["how"].startswith("measured at step 3, the next training batch after the OOM")
    top = record["modules"]["top"]
    assert top[0]["module"] == "net.1" and top[0]["bytes"] > 0  # the Tanh keeps its 1024-wide output
    assert record["picture"] == "oom_2_rank0.png" and (folder / "oom_2_rank0.png").is_file()
    assert (folder / PNG_NAME).is_file()
    saved = json.loads((folder / "gpuopt_report.json").read_text())
    assert saved["ooms"] == report.report["ooms"]
    rows = dict(summary_rows(saved))
    assert rows["OOMs"].startswith(f"{len(saved['ooms'])}: train forward")
    assert rows["decisions"].startswith(f"{len(saved['ooms'])} oom")  # the count comes from the records


def test_gpuopt_report_lists_the_ooms_and_prints_one_in_full(plain_run, capsys):
    _, folder = plain_run
    main(["report", str(folder), "--no-plot"])
    out = capsys.readouterr().out
    assert "OOMs (`--oom N` prints one in full):" in out
    assert "#0  step 2 rank 0 train forward:" in out and "micro-batch 64 → " in out
    main(["report", str(folder), "--oom", "0"])
    one = capsys.readouterr().out
    assert one.startswith("OOM #0: step 2, rank 0, train, forward")
    for line in ("in use by category:", "parameters", "activations by module (measured at step 3", "action"):
        assert line in one, line
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(folder), "--oom", "9"])
    assert exit_info.value.code == 2
    assert "--oom takes a record number from 0 to" in capsys.readouterr().err


def test_an_oom_the_pack_gives_up_on_is_recorded_with_why(tmp_path):
    """Adam's state does not fit even after the retry: the fit ends, and the report says what the pack did."""

    class NoGarbage(Pressure):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 0:
                param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
                get_probe().limit_bytes = get_probe().allocated_bytes + param_bytes

    report = GPUOptReport(dirpath=str(tmp_path), table=False, plot=False)
    trainer = pl.Trainer(
        max_steps=2,
        precision="64-true",
        callbacks=[NoGarbage("optimizer step"), OOMRecovery(verbose=False), report],
        **TRAINER_QUIET,
    )
    with pytest.raises(OptimizerStepOOMError), SimulatedMemory() as mem:
        trainer.fit(Measured("mlp"), _data("mlp"))
    saved = json.loads((tmp_path / "gpuopt_report.json").read_text())
    assert len(saved["ooms"]) == mem.num_ooms == 2  # the step and its retry
    assert [r["phase"] for r in saved["ooms"]] == ["optimizer step"] * 2
    assert saved["ooms"][0]["action"].startswith("optimizer step retried once")
    assert saved["ooms"][1]["action"].startswith("gave up: Out of memory in the optimizer step (Adam.step)")


def test_trial_steps_of_the_batch_size_search_get_records_of_their_own(tmp_path):
    report = GPUOptReport(dirpath=str(tmp_path), table=False, plot=False)
    run = fit(
        WideRegressor("adam"),
        [MemoryAwareBatchSize(), OOMRecovery(verbose=False), report],
        steps=2,
        limit=3 * 2**20,
    )
    ooms = report.report["ooms"]
    assert len(ooms) == run.memory.num_ooms >= 1  # the search tried a size that did not fit
    assert {r["stage"] for r in ooms} == {"trial"}
    assert all(r["action"].startswith("MemoryAwareBatchSize's search") for r in ooms)
    assert all(
        abs(sum(r["categories"].values()) - r["allocated_bytes"]) <= 0.01 * r["allocated_bytes"] for r in ooms
    )


def test_the_loggers_get_k_the_micro_batch_the_precision_and_the_data_wait(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv")
    quiet = {**TRAINER_QUIET, "logger": logger}
    trainer = pl.Trainer(
        max_steps=6,
        log_every_n_steps=2,
        precision="64-true",
        callbacks=[Pressure("forward"), OOMRecovery(verbose=False), GPUOptReport(plot=False, table=False)],
        **quiet,
    )
    with SimulatedMemory():
        trainer.fit(Measured("mlp"), _data("mlp"))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert {"gpuopt/k", "gpuopt/micro_batch_size", "gpuopt/precision", "gpuopt/data_wait"} <= columns
    logged = [r for r in rows if r["gpuopt/k"]]
    assert [int(float(r["gpuopt/k"])) for r in logged][:1] == [1] and int(float(logged[-1]["gpuopt/k"])) > 1
    assert {float(r["gpuopt/precision"]) for r in logged} == {53.0}  # float64's significand bits
    assert all(0.0 <= float(r["gpuopt/data_wait"]) <= 1.0 for r in logged if r["gpuopt/data_wait"])


def test_an_oom_in_validation_has_a_record_of_that_stage(tmp_path):
    class Validated(Plain):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y))

    class ValidationLimit(pl.Callback):
        def on_validation_start(self, trainer, pl_module):
            get_probe().limit_bytes = get_probe().allocated_bytes + 2**20  # a 256-sample batch does not fit

        def on_validation_end(self, trainer, pl_module):
            get_probe().limit_bytes = None

    report = GPUOptReport(dirpath=str(tmp_path), table=False, plot=False)
    trainer = pl.Trainer(
        max_steps=2,
        precision="64-true",
        val_check_interval=1,
        limit_val_batches=1,
        callbacks=[ValidationLimit(), OOMRecovery(verbose=False), report],
        **TRAINER_QUIET,
    )
    gc.collect()
    elsewhere = sum(
        forensics.saved_activations(torch.device("cpu")).values()
    )  # graphs other tests left alive
    with SimulatedMemory() as mem:
        trainer.fit(Validated("mlp"), _data("mlp"), DataLoader(_data("mlp").dataset, batch_size=256))
    ooms = report.report["ooms"]
    assert len(ooms) == mem.num_ooms >= 1 and {r["stage"] for r in ooms} == {"validation"}
    # evaluation keeps no graph: nothing beyond what was alive before the run
    assert all(r["phase"] == "forward" and r["categories"]["activations"] <= elsewhere for r in ooms)
    assert ooms[-1]["action"].startswith("validation batches in ")
    assert ooms[0]["modules"]["how"].startswith("none: evaluation saves nothing")


@pytest.mark.slow
def test_the_oom_forensics_example_explains_its_oom(tmp_path, capsys):
    from examples.oom_forensics import main as example

    report = example(str(tmp_path))
    (record,) = report["ooms"]
    assert (record["step"], record["stage"], record["phase"]) == (3, "train", "forward")
    assert max(record["categories"], key=record["categories"].get) == "activations"
    assert record["modules"]["top"] and (tmp_path / "oom_3_rank0.png").is_file()
    assert "OOM #0: step 3, rank 0, train, forward" in capsys.readouterr().out
