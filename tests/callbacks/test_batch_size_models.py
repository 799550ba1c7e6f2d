"""MemoryAwareBatchSize on more model families: at most 4 real steps, within 90 % of the true maximum.

The true maximum is found by bisecting real training steps (``batch_models.true_maxima``). ResNet-18,
the transformer and the superlinear model are checked in test_batch_size.py's acceptance tests; here an
MLP, a tiny Hugging Face GPT-2 and BERT (configs built offline), SqueezeNet and Lightning's demo Transformer,
and the deprecated ``predict`` switch. The search itself (pure) is checked in tests/batch_size/test_search.py.
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
def test_at_most_four_real_steps_reach_90_percent_of_the_true_maximum(family, calibration):
    lo, hi = calibration
    peaks = peaks_at(family, [lo, hi], 64)
    limit = (peaks[lo] + peaks[hi]) // 2
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    run = fit(family, [finder], limit=limit, steps=1, batch_size=64)
    # Trained at the answer: every simulated OOM was a trial step's.
    assert run.trainer.global_step == 1
    assert run.memory.num_ooms == sum(m.out_of_memory for m in finder.result.measurements)
    assert finder.trials <= 4, finder.result.measurements
    truth = true_maxima(family, [limit], 64)[limit]  # micro-batches of the same batch as the run
    assert 0.9 * truth <= finder.micro_batch_size <= truth, (finder.micro_batch_size, truth)
    # The report's decision says what the search measured.
    decision = next(d for d in decisions(run.trainer) if d.kind == "batch size")
    assert decision.data["trials"] == finder.trials and "measured" in decision.message


def test_predict_is_deprecated_and_ignored():
    limit = (lambda p: (p[4] + p[28]) // 2)(peaks_at("mlp", [4, 28], 32))
    plain = MemoryAwareBatchSize(target_fraction=1.0)
    fit("mlp", [plain], limit=limit, steps=1, batch_size=32)
    with pytest.warns(DeprecationWarning, match=r"predict=\.\.\.\) is deprecated and ignored"):
        old = MemoryAwareBatchSize(target_fraction=1.0, predict=True)
    fit("mlp", [old], limit=limit, steps=1, batch_size=32)
    assert [m.size for m in old.result.measurements] == [m.size for m in plain.result.measurements]
    assert old.micro_batch_size == plain.micro_batch_size
    with pytest.warns(DeprecationWarning, match="prediction_note is deprecated"):
        assert old.prediction_note == ""


class Filtered(pl.LightningModule):
    """A training step whose shapes depend on the data (``nonzero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        keep = torch.nonzero(y[:, 0] > -100).squeeze(1)
        return F.mse_loss(self.net(x[keep]), y[keep])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_step_whose_shapes_depend_on_the_data_is_measured_like_any_other():
    finder = MemoryAwareBatchSize(target_fraction=1.0)
    trainer = pl.Trainer(max_steps=1, callbacks=[finder], **TRAINER_QUIET)
    dataset = Waves(length=256)
    with SimulatedMemory(limit_bytes=4 * 2**20):
        trainer.fit(Filtered(), DataLoader([(x, y) for _, x, y in dataset], batch_size=64))
    assert finder.micro_batch_size is not None and 1 <= finder.trials <= 4
