"""MemoryAwareBatchSize started from the prediction: at most 3 real steps, within 90 % of the true maximum.

The true maximum is found by bisecting real training steps (``batch_models.true_maxima``). ResNet-18,
the transformer and the superlinear model are checked in test_batch_size.py's acceptance tests; here an
MLP and a tiny Hugging Face GPT-2 (config built offline), the hand-over to the measured search, and
the switch.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import MemoryAwareBatchSize
from lightning_gpuopt.batch_size.peak_model import SizeSearch, StepMeasurement
from lightning_gpuopt.batch_size.predicted import PredictedSearch, TracedStep, TransientCurve
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
    finder = MemoryAwareBatchSize(target_fraction=1.0)
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
    predicted = MemoryAwareBatchSize(target_fraction=1.0)
    fit("mlp", [predicted], limit=limit, steps=1, batch_size=32)
    assert plain.prediction_note == "predict=False: the measured search"
    first, second = (m.size for m in plain.result.measurements[:2])
    assert (
        second == 8 * first
    )  # the measured search's second step: 8x its first, where one point says it fits
    assert predicted.result.measurements[1].size != second and predicted.prediction_note.startswith("started")
    with pytest.raises(ValueError, match="`predict` must be True or False"):
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
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    trainer = pl.Trainer(max_steps=1, callbacks=[finder], **TRAINER_QUIET)
    dataset = Waves(length=256)
    with SimulatedMemory(limit_bytes=4 * 2**20):
        trainer.fit(Filtered(), DataLoader([(x, y) for _, x, y in dataset], batch_size=64))
    assert "could not be traced" in finder.prediction_note and "measured search" in finder.prediction_note
    assert finder.micro_batch_size is not None


# --- the search itself (pure) ----------------------------------------------------------------------


def _run(search: SizeSearch, step) -> SizeSearch:
    while (n := search.next_size()) is not None:
        search.record(step(n))
    return search


def _quadratic(n: int) -> StepMeasurement:
    """A real step growing faster than linearly (what forward and backward add above the held memory)."""
    return StepMeasurement(n, 5_000 + 400 * n + 6 * n * n, 1_000)


ARGS = dict(budget_bytes=120_000, base_bytes=20_000, smallest=1, largest=512, first_size=8)


def _within(step, budget: int, base: int):
    """``step`` as a real device runs it: out of memory over the budget (target_fraction 1)."""

    def run(n: int) -> StepMeasurement:
        m = step(n)
        return m if base + m.forward_backward_bytes <= budget else StepMeasurement(n, None, None)

    return run


def test_a_wrong_prediction_hands_over_to_the_measured_search_and_never_ends_below_it():
    # The traces saw a tenth of the memory and no curvature: the calibrated steps run out of memory.
    curve = TransientCurve(tuple(TracedStep(n, 500 * n) for n in (2, 64, 128)))
    step = _within(_quadratic, ARGS["budget_bytes"], ARGS["base_bytes"])
    plain = _run(SizeSearch(**ARGS), step)
    guided = _run(PredictedSearch(**ARGS, curve=curve), step)
    assert not guided.used_prediction and "handed over to the measured search" in guided.note, guided.note
    # The measured search continued from the shared first step exactly as it runs alone.
    assert guided.fallback.measurements == plain.measurements
    assert guided.result.size >= plain.result.size
    truth = max(n for n in range(1, 513) if 20_000 + _quadratic(n).forward_backward_bytes <= 120_000)
    assert guided.result.size <= truth


def test_a_right_prediction_needs_three_steps_where_memory_grows_faster_than_linearly():
    curve = TransientCurve(tuple(TracedStep(n, _quadratic(n).forward_backward_bytes) for n in (2, 64, 128)))
    guided = _run(PredictedSearch(**ARGS, curve=curve), _quadratic)
    truth = max(n for n in range(1, 513) if 20_000 + _quadratic(n).forward_backward_bytes <= 120_000)
    assert guided.used_prediction and len(guided.measurements) <= 3
    assert 0.9 * truth <= guided.result.size <= truth


def _bent(n: int) -> StepMeasurement:
    """A real step whose growth bends between two traced sizes (a convolution's algorithm changing with the
    batch: 14 KB per sample below 55 samples, 22.5 KB above), as measured on ResNet-18."""
    below = min(n, 55)
    return StepMeasurement(n, 140_000 + 14_336 * (below - 2) + 22_528 * max(0, n - 55), 0)


def test_completed_steps_are_traced_so_a_bend_between_traces_does_not_mislead_the_calibration():
    """Traces exact at 2, 19 and 78 samples; the bend lies between 19 and 78. Calibrated against the chord,
    the first two steps (below the bend) scale the curve down and the third overshoots; with each completed
    step traced too, the third lands on the largest size that fits."""
    args = dict(ARGS, budget_bytes=1_300_000, base_bytes=0, first_size=16)
    truth = max(n for n in range(1, 513) if _bent(n).forward_backward_bytes <= args["budget_bytes"])
    traces = tuple(TracedStep(n, _bent(n).forward_backward_bytes) for n in (2, 19, 78))
    step = _within(_bent, args["budget_bytes"], 0)
    chord_only = _run(PredictedSearch(**args, curve=TransientCurve(traces)), step)
    assert not chord_only.used_prediction  # it ran past three steps
    traced = []

    def tracer(n: int) -> TracedStep:
        traced.append(n)
        return TracedStep(n, _bent(n).forward_backward_bytes)

    guided = _run(PredictedSearch(**args, curve=TransientCurve(traces), tracer=tracer), step)
    assert guided.used_prediction and len(guided.measurements) == 3, guided.note
    assert guided.result.size == truth
    assert traced == [m.size for m in guided.measurements[:2]]  # each step a calibrated one follows
