"""A Llama-shaped LightningModule built on the ``meta`` device, to plan a large model on a small machine.

``gpuopt plan`` traces its training step on fake tensors: nothing of the model is allocated, so a
7B-parameter configuration is planned for 8 × 80 GB GPUs on a laptop::

    PYTHONPATH=. gpuopt plan --config examples/configs/llama7b_plan.yaml --trainer.devices 8 \\
        --gpuopt.device_memory 80GB

Needs ``transformers`` (the ``[test]`` extra). Training it for real needs ``init_on_meta=False``
(or a ``configure_model`` that materialises the weights on the devices).
"""

from __future__ import annotations

import contextlib

import lightning as L
import torch
from torch.utils.data import Dataset

from lightning_gpuopt import GPUOptDataModule

SIZES = {
    # hidden, layers, heads, intermediate (Llama-2 7B's shape), and a tiny one for tests
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128),
}


class LlamaModule(L.LightningModule):
    """A causal language model of Llama's shape.

    Args:
        size: ``"7b"`` or ``"tiny"``.
        vocab_size: tokens in the vocabulary.
        init_on_meta: build the weights on the ``meta`` device (for planning; nothing is allocated).
    """

    def __init__(self, size: str = "7b", vocab_size: int = 32000, init_on_meta: bool = True) -> None:
        super().__init__()
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as err:  # pragma: no cover - the [test] extra installs it
            raise ImportError("LlamaModule needs transformers: pip install 'lightning_gpuopt[test]'") from err
        config = LlamaConfig(vocab_size=vocab_size, **SIZES[size])
        with torch.device("meta") if init_on_meta else contextlib.nullcontext():
            self.model = LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class _Tokens(Dataset):
    def __init__(self, samples: int, length: int, vocab_size: int) -> None:
        self.samples, self.length, self.vocab_size = samples, length, vocab_size

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (self.length,), generator=torch.Generator().manual_seed(i))


class TokenData(GPUOptDataModule):
    """Random token sequences of ``length`` tokens.

    Args:
        length: tokens per sequence.
        vocab_size: tokens in the vocabulary.
        samples: sequences in the dataset.
        **kwargs: passed to :class:`~lightning_gpuopt.GPUOptDataModule` (``batch_size``, ...).
    """

    def __init__(self, length: int = 2048, vocab_size: int = 32000, samples: int = 1024, **kwargs) -> None:
        super().__init__(**kwargs)
        self.length, self.vocab_size, self.samples = length, vocab_size, samples

    def train_dataset(self) -> Dataset:
        return _Tokens(self.samples, self.length, self.vocab_size)
