"""Models, data and the ground truth for the MemoryAwareBatchSize tests: the largest micro-batch that really trains.

Three model families with different memory shapes: a torchvision ResNet-18 on 8x8 images (11 M
parameters dominate; conv activations, BatchNorm), a small transformer encoder (attention, dropout: the RNG must be restored
exactly), and a model whose memory grows faster than linearly in the batch (a batch-wide attention
masked to the diagonal, so every sample still only sees itself and micro-batching stays exact).
"""

from __future__ import annotations

import functools
import math

import lightning.pytorch as pl
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import GPUOptDataModule
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.microbatch import MicroBatchEngine, MicroBatchUser
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import Run, StepPeaks
from tests.helpers import TRAINER_QUIET


class Tensors(Dataset):
    """Sample i is (inputs[i], targets[i]); fixed random data, the same in every run."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]


class SizedModule(pl.LightningModule):
    """Base: Adam and a classification loss; ``chunk`` is the micro-batch size :class:`ChunkProbe` imposes."""

    def __init__(self) -> None:
        super().__init__()
        self.chunk: int | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class ResNet(SizedModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = torchvision.models.resnet18(num_classes=10)

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)  # state: one buffer per parameter

    @staticmethod
    def data(n: int = 512, size: int = 8) -> Dataset:
        g = torch.Generator().manual_seed(0)
        return Tensors(torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g))


class Transformer(SizedModule):
    """Token classification over sequences of 16 tokens: 2 encoder layers, d_model 32, dropout 0.1."""

    def __init__(self, vocab: int = 128, d_model: int = 32, seq: int = 16) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = nn.Embedding(vocab, d_model)
            self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
            layer = nn.TransformerEncoderLayer(
                d_model, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(
            self(tokens).flatten(0, 1), targets.flatten()
        )  # same length: token mean = sample mean
        self.log("train_loss", loss)
        return loss

    @staticmethod
    def data(n: int = 512, seq: int = 16, vocab: int = 128) -> Dataset:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (n, seq), generator=g)
        return Tensors(tokens, torch.roll(tokens, 1, dims=1))


class PairwiseMixer(SizedModule):
    """An MLP whose middle layer attends over the whole batch, masked to the diagonal.

    The (n, n, heads) score and attention tensors make forward+backward memory grow with n²; the mask
    lets each sample attend only to itself, so the output (and every gradient) is that of the MLP alone,
    sample by sample, and splitting the batch changes nothing.
    """

    def __init__(self, dim: int = 32, hidden: int = 128, heads: int = 64) -> None:
        super().__init__()
        self.heads = heads
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.inp = nn.Linear(dim, hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 10))

    def forward(self, x):
        h = self.inp(x)
        n, d = h.shape
        q, k, v = self.qkv(h).view(n, 3, self.heads, d // self.heads).unbind(1)
        scores = torch.einsum("ihd,jhd->ijh", q, k) / math.sqrt(d // self.heads)
        mask = torch.full((n, n, 1), float("-inf"), dtype=scores.dtype, device=scores.device)
        mask.diagonal(dim1=0, dim2=1).zero_()
        attn = torch.softmax(scores + mask, dim=1)
        mixed = torch.einsum("ijh,jhd->ihd", attn, v).reshape(n, d)
        return self.out(h + mixed)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    @staticmethod
    def data(n: int = 1024, dim: int = 32) -> Dataset:
        g = torch.Generator().manual_seed(0)
        return Tensors(torch.randn(n, dim, generator=g), torch.randint(0, 10, (n,), generator=g))


FAMILIES = {"resnet18": ResNet, "transformer": Transformer, "superlinear": PairwiseMixer}


class Data(GPUOptDataModule):
    """The family's data through the pack's DataModule, whose ``batch_size`` mode='max' sets."""

    def __init__(self, dataset: Dataset, batch_size: int) -> None:
        super().__init__(batch_size=batch_size, num_workers=0, drop_last=True)
        self.dataset = dataset

    def train_dataset(self) -> Dataset:
        return self.dataset


def fit(
    family: str,
    callbacks: list | None = None,
    limit: int | None = None,
    steps: int = 3,
    batch_size: int = 64,
    precision: str = "32-true",
    datamodule: bool = False,
    **trainer_kwargs,
) -> Run:
    """Train ``steps`` steps under ``SimulatedMemory(limit)``; the data is made before, so it is host memory."""
    cls = FAMILIES[family]
    pl.seed_everything(0, verbose=False)
    model = cls()
    callbacks = list(callbacks or [])
    trainer = pl.Trainer(
        max_steps=steps, precision=precision, callbacks=callbacks, **{**TRAINER_QUIET, **trainer_kwargs}
    )
    # Whole batches only: every step has batch_size samples (the ground truth measures steps of a given size).
    data = (
        Data(cls.data(), batch_size)
        if datamodule
        else DataLoader(cls.data(), batch_size=batch_size, shuffle=True, drop_last=True)
    )
    with SimulatedMemory(limit) as memory:
        trainer.fit(model, datamodule=data) if datamodule else trainer.fit(model, data)
    return Run(model, trainer, memory, callbacks)


class ChunkProbe(MicroBatchUser, pl.Callback):
    """Steady-state peak of real training steps whose micro-batches hold ``size`` samples, for sizes chosen on the fly.

    Step 0 creates the optimizer state (not steady); every later step runs at ``next_size(peaks)``
    (micro-batches of exactly that many samples through the engine's split hook, its k set to match)
    and records its peak; ``next_size`` returning None ends the fit.
    """

    def __init__(self, next_size) -> None:
        self.next_size = next_size
        self.peaks: dict[int, int] = {}
        self.size: int | None = None
        self.cap: int | None = None

    def micro_batch_cap(self) -> int | None:
        return self.cap

    def on_fit_start(self, trainer, pl_module):
        self.engine = MicroBatchEngine.attach(trainer, self)
        pl_module.split_batch = functools.partial(_exact_chunks, pl_module)  # the engine's split hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        n = len(batch[0])
        self.size = self.next_size(self.peaks) if trainer.global_step > 0 else n
        if self.size is None:
            trainer.should_stop = True
            self.size = n
        pl_module.chunk = self.cap = min(self.size, n)
        self.engine.propose(math.ceil(n / pl_module.chunk), "test", "probe", batch_size=n)
        get_probe().reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > 1:  # global_step counts this step already
            self.peaks[self.size] = max(self.peaks.get(self.size, 0), get_probe().peak)

    def teardown(self, trainer, pl_module, stage):
        pl_module.chunk = None
        del pl_module.split_batch
        self.engine.release(self)


def _exact_chunks(module: SizedModule, batch, k: int) -> list:
    """Micro-batches of exactly ``module.chunk`` samples (the last one smaller): the second one, the first
    that runs with gradients allocated, has the size being probed."""
    n = len(batch[0])
    bounds = [(lo, min(n, lo + module.chunk)) for lo in range(0, n, module.chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:  # BatchNorm cannot train on one sample
        (lo, _), (_, hi) = bounds[-2:]
        bounds[-2:] = [(lo, hi - 2), (hi - 2, hi)]
    assert len(bounds) == k, (n, module.chunk, k)
    return [tuple(t[lo:hi] for t in batch) for lo, hi in bounds]


def true_maxima(family: str, limits: list[int], batch_size: int) -> dict[int, int]:
    """For each limit, the largest micro-batch whose real training steps stay within it, by bisection over [1, batch_size].

    One unlimited fit measures the steady-state peak at the sizes the bisections ask for, all limits
    at once (peaks are deterministic, so a size measured once serves every limit).
    """
    bounds = {limit: [0, batch_size + 1] for limit in limits}  # [largest that fits, smallest that does not]

    def next_size(peaks: dict[int, int]) -> int | None:
        for size, peak in peaks.items():
            for limit, bound in bounds.items():
                if peak <= limit:
                    bound[0] = max(bound[0], size)
                else:
                    bound[1] = min(bound[1], size)
        gaps = [(hi - lo, (lo + hi) // 2) for lo, hi in bounds.values() if hi - lo > 1]
        return max(gaps)[1] if gaps else None

    probe = ChunkProbe(next_size)
    fit(family, [probe], steps=2 + 2 * batch_size.bit_length() * len(limits), batch_size=batch_size)
    assert next_size(probe.peaks) is None, "the fit ended before every bisection did"
    return {limit: lo for limit, (lo, _) in bounds.items()}


def peaks_at(family: str, sizes: list[int], batch_size: int) -> dict[int, int]:
    """Steady-state peaks of real training steps with micro-batches of each size."""
    todo = iter(sizes)
    probe = ChunkProbe(lambda peaks: next(todo, None))
    fit(family, [probe], steps=len(sizes) + 2, batch_size=batch_size)
    return probe.peaks


class EngineStepPeaks(StepPeaks):
    """:class:`StepPeaks` of steps run by the micro-batch engine, as in every run with MemoryAwareBatchSize.

    The engine zeroes the gradients before the forward (Lightning zeroes them after it, so that a plain
    step's forward runs with the previous step's gradients alive): its whole-batch step holds less.
    """

    def on_fit_start(self, trainer, pl_module):
        self.engine = MicroBatchEngine.attach(trainer, self)

    def teardown(self, trainer, pl_module, stage):
        self.engine.release(self)


def batch_peak(family: str, batch_size: int) -> int:
    """Steady-state peak of real training steps at ``batch_size`` (whole batches, through the micro-batch engine as
    MemoryAwareBatchSize runs them), from the DataModule."""
    recorder = EngineStepPeaks()
    fit(family, [recorder], steps=2, batch_size=batch_size, datamodule=True)
    return recorder.peaks[-1]  # the first step creates the optimizer state
