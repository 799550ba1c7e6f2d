"""Compiled models under the pack: OOM recovery, the recompilation budget, the report, the refusals.

Both forms of compiled model: the LightningModule compiled the way Lightning documents
(``trainer.fit(torch.compile(model))``) and a compiled submodule. ``backend="aot_eager"`` keeps the logic tests
fast on 2 cores; one case runs inductor. Recompilations are read from dynamo's own counters, reset in each run.

Floors (64-true, measured): a compiled run recovered from an OOM equals the compiled run without one
elementwise (rtol 1e-9); its training distance is 0 to 2e-16 in every case here.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch import nn
from torch._dynamo.utils import counters
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import DataStallMonitor, GPUOptReport, MemoryAwareBatchSize, OOMRecovery
from lightning_gpuopt._compiled import (
    CUDA_GRAPHS_REASON,
    RecompileBudget,
    cuda_graphs_refusal,
    is_compiled_anywhere,
)
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.report import summary_rows
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.batch_models import FAMILIES, fit, peaks_at, true_maxima
from tests.callbacks.test_batch_size_models import MLP
from tests.helpers import TRAINER_QUIET, assert_same_training, parameters_of

pytestmark = pytest.mark.filterwarnings(
    # torch's own note on global module hooks (SimulatedMemory adopts tensors through one) and compiled modules
    "ignore:Using `torch.compile\\(module\\)` when there are global hooks:UserWarning"
)

BATCH = 32


class CNN(pl.LightningModule):
    def __init__(self, compile_net: str | None = None) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(8, 8, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(8, 10),
            )
        if compile_net:
            self.net = torch.compile(self.net, backend=compile_net)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    @staticmethod
    def data() -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        return TensorDataset(
            torch.randn(BATCH * 8, 3, 12, 12, generator=g), torch.randint(0, 10, (BATCH * 8,), generator=g)
        )


class Transformer(pl.LightningModule):
    """One encoder layer over 16 tokens, no dropout (the same function of the batch however it is split)."""

    def __init__(self, compile_net: str | None = None) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Embedding(64, 32),
                nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True),
                nn.Linear(32, 64),
            )
        if compile_net:
            self.net = torch.compile(self.net, backend=compile_net)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.net(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    @staticmethod
    def data() -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (BATCH * 8, 16), generator=g)
        return TensorDataset(tokens, torch.roll(tokens, 1, dims=1))


class Squeeze(pl.Callback):
    """From step ``at`` on, the limit leaves room for ``share`` of the previous step's transient memory: an OOM."""

    def __init__(self, at: int = 2, share: float = 0.5) -> None:
        self.at, self.share = at, share
        self.start = self.peak = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        probe = get_probe()
        if trainer.global_step == self.at:
            probe.limit_bytes = probe.allocated + int(self.share * (self.peak - self.start))
        probe.reset_peak()
        self.start = probe.allocated

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peak = get_probe().peak


def _fit(family, form: str, backend: str, squeeze: bool, tmp_path, steps: int = 5):
    """One compiled fit from fresh dynamo state: (θ0, θ, frames compiled, trainer, report, memory)."""
    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0, verbose=False)
    model = family(compile_net=backend if form == "submodule" else None)
    theta0 = parameters_of(model)
    fitted = torch.compile(model, backend=backend) if form == "module" else model
    report = GPUOptReport(dirpath=str(tmp_path / f"report_{squeeze}"), plot=False, table=False)
    callbacks = [OOMRecovery(), report, DataStallMonitor()] + ([Squeeze()] if squeeze else [])
    trainer = pl.Trainer(max_steps=steps, precision="64-true", callbacks=callbacks, **TRAINER_QUIET)
    with SimulatedMemory() as memory:
        trainer.fit(fitted, DataLoader(family.data(), batch_size=BATCH))
    return theta0, parameters_of(model), counters["frames"]["ok"], trainer, report, memory


def _check_recovered_run(family, form, backend, tmp_path):
    theta0, theta_ref, frames_ref, _, _, _ = _fit(family, form, backend, False, tmp_path)
    _, theta, frames, trainer, report, memory = _fit(family, form, backend, True, tmp_path)
    assert frames_ref >= 1, "the reference run compiled nothing"
    # Recovery: the squeeze forced an OOM, the batch was split, and training went on to the end.
    assert memory.num_ooms >= 1 and trainer.global_step == 5
    splits = [d for d in decisions(trainer) if d.kind == "micro-batches" and d.data["cause"] == "oom"]
    assert splits and splits[-1].data["k_after"] > 1
    # The same result as the compiled full-batch run.
    assert_same_training(theta0, theta, theta_ref, floor=1e-12, elementwise=True)
    # The budget: beyond the reference run, at most one recompilation of each compiled frame per split.
    extra = frames - frames_ref
    assert extra <= len(splits) * frames_ref, (extra, len(splits), frames_ref)
    # Every one of them is the pack's, and shown: as decisions and in the report's table.
    recompiled = [d for d in decisions(trainer) if d.kind == "recompilation"]
    assert sum(d.data["frames"] for d in recompiled) == extra
    assert recompiled and recompiled[0].message.startswith(f"recompiled after split {BATCH} → ")
    assert "batch dimension dynamic from now on" in recompiled[0].message
    assert len(report.report["steps"]) == 5 and report.report["steps"][-1]["data_wait_fraction"] is not None
    rows = dict(summary_rows(report.report))
    assert rows["recompilations by the pack"].startswith(f"{extra} (last: split {BATCH} → ")
    return extra, len(splits)


@pytest.mark.parametrize("form", ["module", "submodule"])
@pytest.mark.parametrize("family", [CNN, Transformer], ids=["cnn", "transformer"])
def test_a_compiled_run_recovers_from_an_oom_with_the_same_result_and_few_recompilations(
    family, form, tmp_path
):
    extra, splits = _check_recovered_run(family, form, "aot_eager", tmp_path)
    # The batch dimension is dynamic from the first split on: the second split compiles nothing more.
    assert (extra, splits) == (1, 2)


@pytest.mark.slow
def test_inductor_recovers_with_the_same_result_and_budget(tmp_path):
    _check_recovered_run(CNN, "submodule", "inductor", tmp_path)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_no_micro_batch_of_one_sample_while_two_may_fit(compiled):
    """dynamo specialises a size of 1: under compile, a k that would leave 1 sample per micro-batch runs 2."""
    from lightning_gpuopt.microbatch import MicroBatchEngine

    torch._dynamo.reset()
    counters.clear()
    ran: list[int] = []

    class AskForOne(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            engine = MicroBatchEngine.get(trainer)
            if trainer.global_step == 1:
                engine.propose(BATCH, "test", "micro-batches of one sample", batch_size=BATCH)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ran.append(MicroBatchEngine.get(trainer).effective_k(batch))

    trainer = pl.Trainer(max_steps=3, callbacks=[OOMRecovery(), AskForOne()], **TRAINER_QUIET)
    with SimulatedMemory():
        trainer.fit(
            CNN(compile_net="aot_eager" if compiled else None), DataLoader(CNN.data(), batch_size=BATCH)
        )
    assert ran == [1, BATCH // 2, BATCH // 2] if compiled else [1, BATCH, BATCH], ran


def test_micro_batches_of_one_sample_when_two_do_not_fit():
    from lightning_gpuopt.microbatch import MicroBatchEngine

    torch._dynamo.reset()
    counters.clear()
    ran: list[int] = []

    class AskForOne(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:
                MicroBatchEngine.get(trainer).propose(BATCH, "test", "one sample", batch_size=BATCH)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ran.append(MicroBatchEngine.get(trainer).effective_k(batch))

    # From step 2 on, room for 90 % of what micro-batches of 2 needed at step 1: 2 samples fail, 1 fits
    # (measured: 0.9, 0.95 and 0.98 do this; at 0.75 one sample does not fit either).
    callbacks = [OOMRecovery(), AskForOne(), Squeeze(at=2, share=0.9)]
    trainer = pl.Trainer(max_steps=4, callbacks=callbacks, **TRAINER_QUIET)
    with SimulatedMemory() as memory:
        trainer.fit(CNN(compile_net="aot_eager"), DataLoader(CNN.data(), batch_size=BATCH))
    assert memory.num_ooms >= 1
    assert ran == [1, BATCH // 2, BATCH, BATCH], ran
    # Micro-batches of 1 cost one more recompilation (dynamo specialises the size), recorded as such.
    recompiled = [d.data["cause"] for d in decisions(trainer) if d.kind == "recompilation"]
    assert recompiled == [f"split {BATCH} → 2 (batch dimension dynamic from now on)", "split 2 → 1"], (
        recompiled
    )


def test_cuda_graphs_are_refused_with_the_reason_and_the_alternative():
    model = CNN()
    model.net = torch.compile(model.net, mode="reduce-overhead")
    assert is_compiled_anywhere(model)
    message = cuda_graphs_refusal(model, torch.device("cuda", 0), "OOMRecovery")
    assert message == f"OOMRecovery cannot run a model compiled with CUDA graphs: {CUDA_GRAPHS_REASON}."
    assert "mode='max-autotune-no-cudagraphs'" in message
    assert cuda_graphs_refusal(model, torch.device("cpu"), "OOMRecovery") is None  # no CUDA graphs there
    plain = CNN()
    plain.net = torch.compile(plain.net)
    assert cuda_graphs_refusal(plain, torch.device("cuda", 0), "OOMRecovery") is None
    in_place = CNN()
    in_place.net.compile(mode="reduce-overhead")  # module.compile(): the context sits in its compiled call
    assert cuda_graphs_refusal(in_place, torch.device("cuda", 0), "OOMRecovery") == message
    with inductor_config.patch({"triton.cudagraphs": True}):  # inductor's global switch
        assert cuda_graphs_refusal(plain, torch.device("cuda", 0), "OOMRecovery") == message


def test_a_warning_before_dynamo_stops_compiling():
    from lightning_gpuopt import GPUOptWarning

    # dynamo's own patch: monkeypatch's undo would delete the config entry for every later compilation
    with torch._dynamo.config.patch(recompile_limit=3):
        budget = RecompileBudget()
        budget.seen(["step.py:1 step", "net.py:1 forward"])
        budget.add(1, "split 32 → 16", ["step.py:1 step"])  # another frame's compilations do not add up
        budget.seen(["step.py:1 step"])
        with pytest.warns(
            GPUOptWarning, match="compiled 2 times in this fit.*recompile limit is 3 per frame"
        ):
            budget.add(1, "split 16 → 8", ["step.py:1 step"])
        budget.seen(["step.py:1 step"])
        budget.add(1, "split 8 → 4", ["step.py:1 step"])  # warned once
    assert budget.caused == 3


class CompiledMLP(MLP):
    """test_batch_size_models's MLP with its network a compiled submodule (aot_eager)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="aot_eager")


FAMILIES.update(compiled_mlp=CompiledMLP)


def test_memory_aware_batch_size_on_a_compiled_model_reaches_90_percent_in_at_most_4_steps():
    torch._dynamo.reset()
    peaks = peaks_at("compiled_mlp", [8, 56], 64)
    limit = (peaks[8] + peaks[56]) // 2
    torch._dynamo.reset()
    counters.clear()
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    run = fit("compiled_mlp", [finder], limit=limit, steps=2, batch_size=64)
    frames = counters["frames"]["ok"]
    assert run.trainer.global_step == 2  # every simulated OOM was a trial step's:
    assert run.memory.num_ooms == sum(m.out_of_memory for m in finder.result.measurements)
    assert finder.trials <= 4, finder.result.measurements
    truth = true_maxima("compiled_mlp", [limit], 32)[limit]
    assert 0.9 * truth <= finder.micro_batch_size <= truth, (finder.micro_batch_size, truth)
    # Every trial size and then the training's micro-batches ran on one compilation (the batch dimension
    # dynamic from the first trial on), and the decision says what the trials compiled.
    assert frames == 1, frames
    decision = next(d for d in decisions(run.trainer) if d.kind == "batch size")
    assert decision.data["compiled_frames"] == 1
    assert "torch.compile: the trial steps compiled 1 frame(s), batch dimension dynamic" in decision.message
    assert not [d for d in decisions(run.trainer) if d.kind == "recompilation"]


def test_a_precision_switch_recompiles_once_and_says_so():
    from lightning.pytorch.plugins import MixedPrecision

    from lightning_gpuopt import PrecisionSwitch
    from tests.callbacks.oom_models import Waves
    from tests.callbacks.precision_models import Troubled

    torch._dynamo.reset()
    counters.clear()
    model = Troubled(overflow=(5, None))  # float16 overflows from step 5 on: a switch to bf16-mixed at step 6
    model.net[0] = torch.compile(model.net[0], backend="aot_eager")
    switch = PrecisionSwitch(initial="keep", verbose=False)
    trainer = pl.Trainer(
        max_steps=9,
        precision=None,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        callbacks=[switch],
        **TRAINER_QUIET,
    )
    trainer.fit(model, DataLoader(Waves(length=1024), batch_size=BATCH))
    assert [(c.step, c.before, c.after) for c in switch.switches] == [(6, "16-mixed", "bf16-mixed")]
    # One compilation for float16 autocast, one for bfloat16: the switch's, recorded as such.
    assert counters["frames"]["ok"] == 2
    recompiled = [d for d in decisions(trainer) if d.kind == "recompilation"]
    assert [(d.step, d.message) for d in recompiled] == [
        (6, "recompiled after precision switch 16-mixed → bf16-mixed")
    ]


class ValidatedCNN(CNN):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))


class SqueezeValidation(pl.Callback):
    """From validation batch 1 on, room for half of batch 0's transient memory."""

    def __init__(self) -> None:
        self.start = self.peak = 0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        probe = get_probe()
        if batch_idx == 1:
            probe.limit_bytes = probe.allocated + (self.peak - self.start) // 2
        probe.reset_peak()
        self.start = probe.allocated

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.peak = get_probe().peak


@pytest.mark.parametrize("form", ["module", "submodule"])
def test_an_evaluation_split_under_compile_recompiles_once_and_says_so(form):
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    model = ValidatedCNN(compile_net="aot_eager" if form == "submodule" else None)
    fitted = torch.compile(model, backend="aot_eager") if form == "module" else model
    callback = OOMRecovery()
    trainer = pl.Trainer(limit_val_batches=4, callbacks=[callback, SqueezeValidation()], **TRAINER_QUIET)
    with SimulatedMemory() as memory:
        trainer.validate(fitted, DataLoader(CNN.data(), batch_size=BATCH), verbose=False)
    assert memory.num_ooms >= 1 and callback.eval_k["validation"] == 2
    recompiled = [d for d in decisions(trainer) if d.kind == "recompilation"]
    assert [d.message for d in recompiled] == [
        f"recompiled after split {BATCH} → {BATCH // 2} in validation (batch dimension dynamic from now on)"
    ]
    # dynamo's own reasons: one recompilation, for the batch dimension (Lightning's `self.log` under compile
    # recompiles for reasons of its own, which the pack neither causes nor counts)
    reasons = [m.recompile_reason or "" for m in get_compilation_metrics()]
    batch_dimension = [r for r in reasons if "size mismatch at index 0" in r]
    assert len(batch_dimension) == 1 == recompiled[0].data["frames"], reasons
    assert batch_dimension[0].endswith(f"expected {BATCH}, actual {BATCH // 2}")


def test_only_recompilations_a_batch_size_or_autocast_explains_are_the_packs():
    from torch._dynamo.utils import clear_compilation_metrics

    from lightning_gpuopt._compiled import caused_compilations, compilations_since, compile_marker

    torch._dynamo.reset()
    clear_compilation_metrics()
    scale = {"value": 2.0}
    net = torch.compile(lambda x: (x * scale["value"]).sum(), backend="aot_eager")  # with backward graphs
    start = compile_marker()
    net(torch.randn(4, 3, requires_grad=True)).backward()
    after_first = compile_marker()
    scale["value"] = 3.0  # a guard on the user's own state: not the pack's doing
    net(torch.randn(4, 3, requires_grad=True)).backward()
    assert caused_compilations(after_first) == (0, [])
    net(torch.randn(2, 3, requires_grad=True)).backward()  # a new batch size
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a precision switch
        net(torch.randn(2, 3, requires_grad=True)).backward()
    caused, names = caused_compilations(after_first)
    assert caused == 2 and len(set(names)) == 1 and names[0].endswith(" <lambda>")
    assert caused_compilations(start)[0] == 3  # the first compilation of a frame counts
    assert len(compilations_since(start)) == 4  # dynamo's per-frame limit counts every compilation
