"""The models the prediction is checked on: (model factory, batch factory, step), small enough for CI."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from torch import nn


def _classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _images(n: int, size: int = 32):
    return torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    return model, lambda n: (torch.randn(n, 512), torch.randint(0, 10, (n,))), _classify


def resnet18():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10), _images, _classify


def squeezenet():
    torch.manual_seed(0)
    return torchvision.models.squeezenet1_1(num_classes=10), lambda n: _images(n, 64), _classify


def demo_transformer():
    from lightning.pytorch.demos import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab_size=1000, ninp=128, nhead=4, nhid=256, nlayers=2)

    def step(m, batch):
        x, y = batch
        return nn.functional.nll_loss(m(x, y), y.view(-1))

    return model, lambda n: (torch.randint(0, 1000, (n, 32)), torch.randint(0, 1000, (n, 32))), step


def _tokens(n: int, length: int = 64) -> dict:
    ids = torch.randint(0, 1000, (n, length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _hf_step(model, batch):
    return model(**batch).loss


def gpt2():
    transformers = pytest.importorskip("transformers", reason="the [test] extra installs transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config), _tokens, _hf_step


def bert():
    transformers = pytest.importorskip("transformers", reason="the [test] extra installs transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=128,
        intermediate_size=256,
        vocab_size=1000,
        max_position_embeddings=128,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.BertForMaskedLM(config), _tokens, _hf_step


MODELS = {
    "mlp": mlp,
    "resnet18": resnet18,
    "squeezenet": squeezenet,
    "demo_transformer": demo_transformer,
    "gpt2": gpt2,
    "bert": bert,
}

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
