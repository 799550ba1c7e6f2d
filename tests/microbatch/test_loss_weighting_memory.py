"""The loss-weighting check under memory pressure: it decides at the first split, or says in one line that it cannot.

A hand-written language model on ``{"input_ids", "labels"}`` batches (labels -100 on the padding, lengths 2 to
32) trains 3 steps of batch 32 in 64-true under ``SimulatedMemory``, with a limit set as a fraction of the
unsplit step's peak. ``OOMRecovery()`` with its defaults must split, decide the weighting at the first split (the
check runs on two samples, which fit wherever a micro-batch's training step does) and end within 1e-9 of the
unsplit run, for a token mean, a mean over samples and a sum, at several limits and so several k (0.75 of the
peak splits in 2, 0.5 in 3 and 0.3 in 5 or 6 here; the two lower limits run under the slow marker).

Where even the two-sample check cannot run (a step whose forward without gradients needs more than its training
step at one sample), the batch runs at the largest k and the split uses sample shares, saying so in one line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import GPUOptWarning, MemoryAwareBatchSize, OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import TRAINER_QUIET, assert_same_training, parameters_of, run_ranks

BATCH, LENGTH, VOCAB = 32, 32, 64


class PaddedTokens(Dataset):
    """Right-padded token sequences of lengths 2 to ``length``, as dicts; labels -100 on the padding."""

    def __init__(self, n: int = 3 * BATCH, length: int = LENGTH, vocab: int = VOCAB) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, vocab, (n, length), generator=g)
        lengths = torch.randint(2, length + 1, (n,), generator=g)
        self.labels = self.ids.masked_fill(torch.arange(length)[None, :] >= lengths[:, None], -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class HandWrittenLM(pl.LightningModule):
    """Embedding, one hidden layer, a vocabulary head; the loss reduced as ``reduction`` says."""

    def __init__(self, reduction: str = "token-mean", vocab: int = VOCAB, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.reduction = reduction

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.hidden(torch.tanh(self.embed(ids))))

    def training_step(self, batch, batch_idx):
        logits = self.head(self.features(batch["input_ids"]))
        labels = batch["labels"]
        if self.reduction == "token-mean":
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        if self.reduction == "sum":
            return per_token.sum()
        return (per_token.sum(1) / (labels != -100).sum(1)).mean()  # each sample's token mean, then samples

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01 if self.reduction == "sum" else 0.5)


@dataclass
class Fit:
    theta0: dict[str, torch.Tensor]
    theta: dict[str, torch.Tensor]
    peak: int
    trainer: pl.Trainer


def _fit(model: pl.LightningModule, callbacks: list, limit: int | None = None, steps: int = 3) -> Fit:
    pl.seed_everything(0, verbose=False)
    theta0 = parameters_of(model)
    trainer = pl.Trainer(max_steps=steps, precision="64-true", callbacks=callbacks, **TRAINER_QUIET)
    with SimulatedMemory(limit) as memory:
        trainer.fit(model, DataLoader(PaddedTokens(), batch_size=BATCH, shuffle=False))
    return Fit(theta0, parameters_of(model), memory.peak_bytes, trainer)


@functools.cache
def _unsplit(reduction: str) -> Fit:
    return _fit(HandWrittenLM(reduction), [])


EXPECTED = {"token-mean": "tokens", "sample-mean": "samples", "sum": "sum"}


@pytest.mark.parametrize(
    "fraction", [0.75, pytest.param(0.5, marks=pytest.mark.slow), pytest.param(0.3, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("reduction", list(EXPECTED))
def test_the_check_decides_at_the_first_split_under_memory_pressure(reduction, fraction):
    ref = _unsplit(reduction)
    oom = OOMRecovery()
    run = _fit(HandWrittenLM(reduction), [oom], limit=int(fraction * ref.peak))
    assert oom.failures and oom.k >= 2, "the limit must make the step split"
    log = decisions(run.trainer)
    first_split = next(i for i, d in enumerate(log) if d.kind == "micro-batches")
    (weighting,) = [d for d in log if d.kind == "loss weighting"]
    assert log[first_split + 1] is weighting, [d.message for d in log]  # no OOM in the check, no second split
    assert weighting.data["checked"] and weighting.data["weighting"] == EXPECTED[reduction]
    assert_same_training(ref.theta0, run.theta, ref.theta, floor=1e-9, factor=1.0, elementwise=True)


# ----------------------------------------------------------------------------- when the check cannot run


class DiagnosedLM(HandWrittenLM):
    """A token-mean LM whose step also logs a diagnostic, each sample's token-by-token similarity (a
    ``LONG`` x ``LONG`` matrix per sample, computed without gradients). The diagnostic dominates the forward's
    memory: the check's forward on two samples needs more than a training step on one."""

    def __init__(self) -> None:
        super().__init__("token-mean", vocab=16, width=8)

    def training_step(self, batch, batch_idx):
        h = self.features(batch["input_ids"])
        loss = F.cross_entropy(self.head(h).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        h = h.detach()
        self.log("similarity", (h @ h.transpose(1, 2)).mean())
        return loss


LONG, FEW = 256, 8  # FEW samples a batch: the smallest micro-batch is reached in few retries


class LongTokens(PaddedTokens):
    def __init__(self) -> None:
        super().__init__(n=2 * FEW, length=LONG, vocab=16)


def _fit_long(callbacks: list, limit: int | None = None, steps: int = 2, marks=None) -> Fit:
    pl.seed_everything(0, verbose=False)
    model = DiagnosedLM()
    theta0 = parameters_of(model)
    trainer = pl.Trainer(max_steps=steps, precision="64-true", callbacks=callbacks, **TRAINER_QUIET)
    with SimulatedMemory(limit) as memory:
        if marks is not None:
            marks.memory = memory
        trainer.fit(model, DataLoader(LongTokens(), batch_size=FEW, shuffle=False))
    return Fit(theta0, parameters_of(model), memory.peak_bytes, trainer)


class StepPeaks(pl.Callback):
    """The memory peak of every training step (``memory`` is set to the SimulatedMemory in use)."""

    def __init__(self) -> None:
        self.memory: SimulatedMemory | None = None
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.memory.reset_peak()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.peaks.append(self.memory.peak_bytes)


@functools.cache
def _between_check_and_step() -> int:
    """A limit above a training step at micro-batches of one sample, below the check on two samples.

    Measured at one sample a micro-batch without a limit: the first step runs the check, the second does not.
    """
    oom, peaks = OOMRecovery(loss_reduction="tokens"), StepPeaks()
    oom.load_state_dict({"k": FEW})
    _fit_long([oom, peaks], steps=2, marks=peaks)
    with_check, step = peaks.peaks
    assert with_check > 1.2 * step, f"the model must make the check the larger: {with_check} vs {step}"
    return (with_check + step) // 2


def test_a_check_that_cannot_run_splits_with_sample_shares_and_says_so_once():
    limit = _between_check_and_step()
    oom = OOMRecovery()
    with pytest.warns(GPUOptWarning) as record:
        run = _fit_long([oom], limit=limit)
    assert run.trainer.global_step == 2
    assert oom.k == FEW, "every k is tried before the weighting goes unchecked"
    lines = [str(w.message) for w in record if issubclass(w.category, GPUOptWarning)]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "loss weighting: sample shares — not checked: the check ran out of memory on 2 samples at micro-batches "
        f"of 1 sample (k {FEW}), and no larger k is left; used unchecked for every split."
    )
    assert "loss_reduction=" in lines[0] and "\n" not in lines[0]
    (weighting,) = [d for d in decisions(run.trainer) if d.kind == "loss weighting"]
    assert weighting.data["weighting"] == "samples" and not weighting.data["checked"]
    # Unchecked is not kept: a resumed run (maybe with more memory) checks again.
    assert oom.state_dict()["loss_weighting_checked"] is False


def test_a_given_weighting_is_used_as_given_when_the_check_cannot_run():
    limit = _between_check_and_step()
    ref = _fit_long([])
    oom = OOMRecovery(loss_reduction="tokens")
    run = _fit_long([oom], limit=limit)  # no warning: the weighting is the user's own
    assert oom.k == FEW
    (weighting,) = [d for d in decisions(run.trainer) if d.kind == "loss weighting"]
    assert weighting.message == (
        "loss weighting: tokens (labels != -100) (given) — not checked: the check ran out of memory on 2 samples"
    )
    assert_same_training(ref.theta0, run.theta, ref.theta, floor=1e-9, factor=1.0, elementwise=True)


def test_without_oom_recovery_a_check_that_cannot_run_says_so_at_once():
    """MemoryAwareBatchSize alone splits to one sample a micro-batch; nothing may split further for the check."""
    batch_size = MemoryAwareBatchSize(verbose=False)
    with pytest.warns(GPUOptWarning) as record:
        run = _fit_long([batch_size], limit=_between_check_and_step())
    assert run.trainer.global_step == 2
    (line,) = [str(w.message) for w in record if issubclass(w.category, GPUOptWarning)]
    assert line.startswith(
        f"loss weighting: sample shares — not checked: the check ran out of memory on 2 samples at micro-batches "
        f"of 1 sample (k {FEW}), and without OOMRecovery nothing splits further; used unchecked for every split."
    )


@pytest.mark.slow
@pytest.mark.parametrize("limited_rank", [0, 1])
def test_ranks_hold_one_weighting_when_the_check_cannot_run_on_one(tmp_path, limited_rank):
    """Rank 0's check decides for every rank: where it cannot run, every rank splits further, then every rank
    uses sample shares (one line, from rank 0); where only rank 1's cannot, both take rank 0's tokens."""
    script = Path(__file__).with_name("ddp_weighting_oom_run.py")
    ranks = run_ranks(script, tmp_path, limited_rank, _between_check_and_step())
    expected = ("samples", False) if limited_rank == 0 else ("tokens", True)
    for rank, got in enumerate(ranks):
        assert got["error"] is None and got["steps"] == 2, (rank, got["error"])
        (weighting,) = got["weighting"]
        assert (weighting["weighting"], weighting["checked"]) == expected, rank
        assert got["k"] == FEW, "every rank splits to one sample a micro-batch, as the limited one needs"
    lines = [line for got in ranks for line in got["lines"]]
    assert len(lines) == (1 if limited_rank == 0 else 0), lines
    assert ranks[0]["lines"] == lines, "the line comes from rank 0"
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


# ----------------------------------------------------------------------------- a hand-written (ids, labels) batch


class TupleTokens(PaddedTokens):
    """The same samples as ``(ids, labels)`` tuples: the most common hand-written language-model batch."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], self.labels[i]


class TupleLM(HandWrittenLM):
    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return super().training_step({"input_ids": ids, "labels": labels}, batch_idx)


def test_a_tuple_batch_is_weighted_by_its_tokens_with_no_setting():
    """Issue 36: default OOMRecovery() on (ids, labels) with -100 on the padding and a token-mean loss: the check
    finds the tokens in the tuple at the first split, and the run ends within 1e-9 of the unsplit run."""

    def fit(limit: int | None, callbacks: list) -> Fit:
        pl.seed_everything(0, verbose=False)
        model = TupleLM("token-mean")
        theta0 = parameters_of(model)
        trainer = pl.Trainer(max_steps=3, precision="64-true", callbacks=callbacks, **TRAINER_QUIET)
        with SimulatedMemory(limit) as memory:
            trainer.fit(model, DataLoader(TupleTokens(), batch_size=BATCH, shuffle=False))
        return Fit(theta0, parameters_of(model), memory.peak_bytes, trainer)

    ref = fit(None, [])
    oom = OOMRecovery()
    run = fit(int(0.75 * ref.peak), [oom])
    assert oom.failures and oom.k >= 2
    (weighting,) = [d for d in decisions(run.trainer) if d.kind == "loss weighting"]
    assert weighting.data["checked"] and weighting.data["weighting"] == "tokens", weighting.message
    assert "batch[1] != -100" in weighting.message
    assert_same_training(ref.theta0, run.theta, ref.theta, floor=1e-9, factor=1.0, elementwise=True)
