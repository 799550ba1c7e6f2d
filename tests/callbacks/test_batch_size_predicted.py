"""MemoryAwareBatchSize started from the prediction: at most 3 real steps, within 90 % of the true maximum.

The true maximum is found by bisecting real training steps (``batch_models.true_maxima``). ResNet-18,
the transformer and the superlinear model are checked in test_batch_size.py's acceptance tests; here an
MLP and a tiny Hugging Face GPT-2 (config built offline) and others, and the switch. The search itself
(pure) is checked in tests/batch_size/test_predicted.py.
"""

from __future__ import annotations

import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import MemoryAwareBatchSize
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.batch_models import FAMILIES, SizedModule, Tensors, fit, peaks_at, true_maxima
from tests.callbacks.oom_models import Waves
from tests.helpers import TRAINER_QUIET


class MLP(SizedModule):
    """An MLP over 64 positions per sample, plain SGD: activations, not weights or the optimizer, set the peak."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x).mean(dim=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    @staticmethod
    def data(n: int = 512):
        g = torch.Generator().manual_seed(0)
        return Tensors(torch.randn(n, 64, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


class _HFTokens(SizedModule):
    """A Hugging Face language model (``self.net``) on 16-token sequences of a 256-word vocabulary, its own loss, AdamW."""

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.net(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    @staticmethod
    def data(n: int = 512):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (n, 16), generator=g)
        return Tensors(ids, ids.clone())

    def _build(self, make) -> None:
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            self.net = make()


class GPT2(_HFTokens):
    """A tiny Hugging Face GPT-2 (2 layers, 32 wide), its own shifted-token loss."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="the [test] extra installs transformers")
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        self._build(lambda: transformers.GPT2LMHeadModel(config))


class SqueezeNet(SizedModule):
    """torchvision SqueezeNet 1.1 on 32×32 images, SGD with momentum: convolutions and their CPU scratch."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = torchvision.models.squeezenet1_1(num_classes=10)

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    @staticmethod
    def data(n: int = 512):
        g = torch.Generator().manual_seed(0)
        return Tensors(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


class BERT(_HFTokens):
    """A tiny Hugging Face BERT (2 layers, 32 wide) with its masked-LM loss."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="the [test] extra installs transformers")
        config = transformers.BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=256,
            max_position_embeddings=16,
        )
        self._build(lambda: transformers.BertForMaskedLM(config))


class DemoTransformer(SizedModule):
    """Lightning's demo Transformer (``lightning.pytorch.demos.Transformer``: 2 layers, 32 wide) on 16 tokens, SGD."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = Transformer(vocab_size=256, ninp=32, nhead=2, nhid=64, nlayers=2)

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        return F.nll_loss(self.net(ids, targets), targets.view(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    data = _HFTokens.data


FAMILIES.update(mlp=MLP, gpt2=GPT2, squeezenet=SqueezeNet, bert=BERT, demo_transformer=DemoTransformer)


@pytest.mark.parametrize(
    ("family", "calibration"),
    [(name, (8, 56)) for name in ("mlp", "gpt2", "squeezenet", "bert", "demo_transformer")],
    ids=["mlp", "gpt2", "squeezenet", "bert", "demo_transformer"],
)
def test_at_most_three_real_steps_reach_90_percent_of_the_true_maximum(family, calibration):
    lo, hi = calibration
    peaks = peaks_at(family, [lo, hi], 64)
    limit = (peaks[lo] + peaks[hi]) // 2
    finder = MemoryAwareBatchSize(target_fraction=1.0, predict=True)
    run = fit(family, [finder], limit=limit, steps=1, batch_size=64)
    assert run.trainer.global_step == 1 and run.memory.num_ooms == 0  # trained at the answer
    assert finder.trials <= 3, finder.result.measurements
    assert finder.prediction_note.startswith("started from the prediction"), finder.prediction_note
    truth = true_maxima(family, [limit], 64)[limit]  # micro-batches of the same batch as the run
    assert 0.9 * truth <= finder.micro_batch_size <= truth, (finder.micro_batch_size, truth)
    # The report's decision says how the prediction served: predicted against measured peak.
    decision = next(d for d in decisions(run.trainer) if d.kind == "batch size")
    assert decision.data["prediction"] == finder.prediction_note and "measured" in decision.message


def test_predict_false_runs_the_measured_search():
    limit = (lambda p: (p[4] + p[28]) // 2)(peaks_at("mlp", [4, 28], 32))
    plain = MemoryAwareBatchSize(target_fraction=1.0, predict=False)
    fit("mlp", [plain], limit=limit, steps=1, batch_size=32)
    predicted = MemoryAwareBatchSize(target_fraction=1.0, predict=True)
    fit("mlp", [predicted], limit=limit, steps=1, batch_size=32)
    assert plain.prediction_note == "measured only (predict=False)"
    first, second = (m.size for m in plain.result.measurements[:2])
    assert (
        second == 8 * first
    )  # the measured search's second step: 8x its first, where one point says it fits
    assert predicted.result.measurements[1].size != second and predicted.prediction_note.startswith("started")
    with pytest.raises(ValueError, match="`predict` must be None \\(auto\\), True or False"):
        MemoryAwareBatchSize(predict="yes")


class Filtered(pl.LightningModule):
    """A training step whose shapes depend on the data (``nonzero``): it cannot be traced on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        keep = torch.nonzero(y[:, 0] > -100).squeeze(1)
        return F.mse_loss(self.net(x[keep]), y[keep])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_step_that_cannot_be_traced_runs_the_measured_search_and_says_why():
    finder = MemoryAwareBatchSize(target_fraction=1.0, predict=True)
    trainer = pl.Trainer(max_steps=1, callbacks=[finder], **TRAINER_QUIET)
    dataset = Waves(length=256)
    with SimulatedMemory(limit_bytes=4 * 2**20):
        trainer.fit(Filtered(), DataLoader([(x, y) for _, x, y in dataset], batch_size=64))
    assert finder.prediction_note.startswith("measured only: the training step cannot be predicted (")
    assert finder.micro_batch_size is not None


class Traceable(Filtered):
    """A step the traces can run; ``seconds``: how long the first real step sleeps (a trace does not)."""

    seconds = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.slept = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.seconds and not self.slept and type(x).__name__ != "FakeTensor" and x.device.type != "meta":
            time.sleep(self.seconds)  # the search times its first real step only: the others need not wait
            self.slept = True
        return F.mse_loss(self.net(x), y)


class SlowStep(Traceable):
    # A fifth of it, 1 s, lets a cold trace of this small step (with kernel scratch) finish on a loaded machine:
    # it took 0.12 s beside a running test suite on 2 cores, so a load 8 times that still takes this path.
    seconds = 5.0


@pytest.mark.parametrize(
    ("module", "path"),
    [
        (Traceable, "measured only"),
        pytest.param(SlowStep, "predicted, then measured", marks=pytest.mark.slow),
    ],
    ids=["cheap", "slow"],
)
def test_auto_takes_the_traced_start_only_where_a_real_step_costs_more_than_the_traces(module, path):
    """predict=None: a cheap CPU step is measured; a step dearer than five traces starts from them; the note says why."""
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    trainer = pl.Trainer(max_steps=1, callbacks=[finder], **TRAINER_QUIET)
    dataset = Waves(length=256)
    with SimulatedMemory(limit_bytes=4 * 2**20):
        trainer.fit(module(), DataLoader([(x, y) for _, x, y in dataset], batch_size=64))
    assert finder.prediction_note.startswith(f"{path}: "), finder.prediction_note
    assert (
        "5 predicted steps take" in finder.prediction_note
        and "to save one real step of" in finder.prediction_note
    )
    assert finder.micro_batch_size is not None


@pytest.fixture
def counted_traces(monkeypatch):
    """The traces run (calls of the tracer's predict_peak_deep; none kept: conftest) counted in a list."""
    from lightning_gpuopt.batch_size import trace

    calls: list[int] = []
    deep = trace.predict_peak_deep

    def counting(module, batch, *args, **kwargs):
        calls.append(batch[0].shape[0])
        return deep(module, batch, *args, **kwargs)

    monkeypatch.setattr(trace, "predict_peak_deep", counting)
    return calls


def _search(predict: bool | None, module: type[pl.LightningModule] = Traceable) -> MemoryAwareBatchSize:
    finder = MemoryAwareBatchSize(target_fraction=1.0, predict=predict)
    trainer = pl.Trainer(max_steps=1, callbacks=[finder], **TRAINER_QUIET)
    dataset = Waves(length=256)
    with SimulatedMemory(limit_bytes=4 * 2**20):
        trainer.fit(module(), DataLoader([(x, y) for _, x, y in dataset], batch_size=64))
    return finder


def test_a_second_search_of_the_same_step_reuses_the_traces_of_the_first(counted_traces):
    """predict=True twice on the same step: the second search runs no trace, finds the same size, and says so."""
    first = _search(True)
    traced = len(counted_traces)
    assert traced >= 2 and len(set(counted_traces)) == traced  # no size traced twice within a search
    second = _search(True)
    assert len(counted_traces) == traced, counted_traces  # nothing traced again
    assert second.micro_batch_size == first.micro_batch_size
    assert f"0 predicted step(s) run, {traced} reused from an earlier search" in second.prediction_note, (
        second.prediction_note
    )


def test_auto_stops_the_timed_trace_of_a_cheap_step_and_times_it_once_per_step(counted_traces):
    """predict=None on a cheap step: the trace is stopped after a fifth of the step, and the next search of the
    same step takes the time from the first instead of tracing again; once every trace the traced start plans
    is kept (a predict=True search ran), it takes that start, one real step fewer, no trace; a step dearer
    than five traces reuses the timed trace where the traced start traces that size."""
    first = _search(None)
    assert first.prediction_note.startswith("measured only: 5 predicted steps take at least "), (
        first.prediction_note
    )
    assert first.prediction_note.endswith("; predict=True predicts anyway"), first.prediction_note
    assert len(counted_traces) == 1
    second = _search(None)
    assert len(counted_traces) == 1, counted_traces  # no trace: the time is known
    assert ", as timed in an earlier search," in second.prediction_note, second.prediction_note
    forced = _search(True)  # traces the step's plan (kept)
    traced = len(counted_traces)
    third = _search(None)
    assert third.prediction_note.startswith("predicted, then measured"), third.prediction_note
    assert "kept from an earlier search" in third.prediction_note and len(counted_traces) == traced
    assert third.micro_batch_size == forced.micro_batch_size and third.trials < first.trials
    slow = _search(None, SlowStep)
    assert slow.prediction_note.startswith("predicted, then measured"), slow.prediction_note
    timed, *planned = counted_traces[traced:]
    assert timed == slow.result.measurements[0].size and timed not in planned  # traced once, used twice
