"""Tiny Hugging Face models (configs built offline, no weights downloaded) and padded batches for the
loss-weighting tests, with one fit helper that records θ_0, θ_N and the first batch's gradients."""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from tests.helpers import TRAINER_QUIET, parameters_of

VOCAB, LENGTH, LABELS = 48, 12, 3
KINDS = ("causal-lm", "masked-lm", "token-classification", "sequence-classification")


class PaddedText(Dataset):
    """Right-padded sequences of random lengths (2 to LENGTH), with labels as HF's collators make them."""

    def __init__(self, kind: str, n: int = 32) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask  # pad id 0
        if kind == "causal-lm":
            self.labels = self.ids.masked_fill(self.mask == 0, -100)
        elif kind == "masked-lm":
            chosen = (torch.rand(n, LENGTH, generator=g) < 0.3) & (self.mask == 1)
            chosen[:, 0] = True  # at least one masked token per sample
            self.labels = self.ids.masked_fill(~chosen, -100)
            self.ids = self.ids.masked_fill(chosen, VOCAB - 1)  # the [MASK] id
        elif kind == "token-classification":
            tags = torch.randint(0, LABELS, (n, LENGTH), generator=g)
            self.labels = tags.masked_fill(self.mask == 0, -100)
        else:
            self.labels = torch.randint(0, LABELS, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def hf_model(kind: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "causal-lm":
        config = tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,  # dropout would differ between splits
        )
        return tf.GPT2LMHeadModel(config)
    config = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,  # dropout draws differ between a split and an unsplit batch
        attention_probs_dropout_prob=0.0,
    )
    if kind == "masked-lm":
        return tf.BertForMaskedLM(config)
    if kind == "token-classification":
        return tf.BertForTokenClassification(config)
    return tf.BertForSequenceClassification(config)


def exact_count(kind: str):
    """The hand-written weight_fn that counts what each head's loss averages over (the floor's weighting)."""
    if kind == "causal-lm":
        return lambda batch: int((batch["labels"][:, 1:] != -100).sum())
    if kind == "sequence-classification":
        return lambda batch: len(batch["labels"])
    return lambda batch: int((batch["labels"] != -100).sum())


class HFModule(pl.LightningModule):
    """An unchanged LightningModule around an HF model: the loss is the model's own."""

    def __init__(self, kind: str, optimizer: str) -> None:
        super().__init__()
        self.model = hf_model(kind)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Recorder(Callback):
    """θ_0 at the start of fit and the first batch's gradients, before the optimizer step."""

    def __init__(self) -> None:
        self.theta0: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.theta0 = parameters_of(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {
                n: p.grad.detach().double().clone()
                for n, p in pl_module.named_parameters()
                if p.grad is not None
            }


@dataclass
class Trained:
    model: pl.LightningModule
    trainer: pl.Trainer
    theta0: dict[str, torch.Tensor]
    theta: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


def train(
    model: pl.LightningModule,
    dataset: Dataset,
    callbacks: list,
    steps: int = 3,
    batch_size: int = 16,
    **kwargs,
) -> Trained:
    pl.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[*callbacks, recorder],
        **{**TRAINER_QUIET, "precision": "32-true", **kwargs},
    )
    trainer.fit(model, DataLoader(dataset, batch_size=batch_size, shuffle=False))
    return Trained(model, trainer, recorder.theta0, parameters_of(model), recorder.grads)


class TokenText(Dataset):
    """Token sequences of random lengths, labels -100 on padding."""

    def __init__(self, n: int = 32, length: int = 16, vocab: int = 16, equal_odd: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (n, length), generator=g)
        lengths = torch.randint(2, length + 1, (n,), generator=g)
        if equal_odd:  # odd samples (rank 1's under DDP) all full length: samples and tokens count alike
            lengths[1::2] = length
        self.labels = self.tokens.masked_fill(torch.arange(length)[None, :] >= lengths[:, None], -100)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.labels[i]}


class TokenMeanLM(pl.LightningModule):
    """A hand-written token-mean loss (no Hugging Face)."""

    def __init__(self, optimizer: str = "sgd", vocab: int = 16, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        logits = self.head(torch.tanh(self.embed(batch["input_ids"])))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.5)
