"""``FSDP2Strategy()`` with its defaults on an encoder-decoder, 2 CPU ranks (gloo), run as a script: Lightning's
launcher starts rank 1 by re-running it.

    PYTHONPATH=. python tests/strategy/fsdp2_defaults_run.py OUT_DIR MODEL

MODEL: ``demo`` (Lightning's demo Transformer, an ``nn.Transformer`` whose encoder and decoder layers are two
``ModuleList``s) or ``t5`` (a tiny Hugging Face T5 from a config, no weights). Three training steps of 8
sequences per rank with MemoryAwareBatchSize and OOMRecovery, each rank under its own SimulatedMemory.
Every rank writes ``OUT_DIR/rank{r}.pt``: the units FSDP2 sharded (name and type), the steps trained, the
micro-batch size MemoryAwareBatchSize chose, the error if any.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import LightningTransformer
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import TensorDataset

from lightning_gpuopt import FSDP2Strategy, GPUOptDataModule, MemoryAwareBatchSize, OOMRecovery
from lightning_gpuopt.testing import SimulatedMemory
from tests.helpers import TRAINER_QUIET, run_script

VOCAB, SEQ, BATCH, STEPS = 100, 16, 8, 3


class DemoTransformer(LightningTransformer):
    """Lightning's demo: embedding, ``nn.Transformer`` (2 encoder and 2 decoder layers), a head; no WikiText2."""

    def __init__(self) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            super().__init__(vocab_size=VOCAB)

    def prepare_data(self) -> None:  # the data comes from Tokens, not a download
        pass


class TinyT5(pl.LightningModule):
    """A 2 + 2 layer T5 (d_model 32) built from its config; the loss is the model's own."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_ff=64,
            d_kv=16,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        )
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.model = transformers.T5ForConditionalGeneration(config)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return self.model(input_ids=inputs, labels=target).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Tokens(GPUOptDataModule):
    """Random token sequences and their targets, the same on every rank."""

    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__(batch_size=batch_size, num_workers=0)

    def train_dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        inputs = torch.randint(1, VOCAB, (2 * BATCH * STEPS, SEQ), generator=g)
        return TensorDataset(inputs, torch.roll(inputs, 1, dims=1))


MODELS = {"demo": DemoTransformer, "t5": TinyT5}


class Record(pl.Callback):
    """Each rank under its own SimulatedMemory; at the end of the fit, what it sharded and trained."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.memory: SimulatedMemory | None = None

    def setup(self, trainer, pl_module, stage):
        self.memory = SimulatedMemory()
        self.memory.__enter__()

    def on_fit_end(self, trainer, pl_module):
        children = {id(c) for c in pl_module.children()}
        units = [  # fully_shard makes a class FSDP<type> of (FSDPModule, type)
            (name, next(b for b in type(m).__bases__ if b is not FSDPModule).__name__)
            for name, m in pl_module.named_modules()
            if isinstance(m, FSDPModule) and id(m) not in children and m is not pl_module
        ]
        finder = next(c for c in trainer.callbacks if isinstance(c, MemoryAwareBatchSize))
        result = {
            "units": units,
            "steps": trainer.global_step,
            "micro_batch_size": finder.micro_batch_size,
            "strategy": type(trainer.strategy).__name__,
        }
        torch.save(result, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))
        self.memory.__exit__(None, None, None)


def main() -> None:
    out_dir, model = sys.argv[1], sys.argv[2]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(),
        max_steps=STEPS,
        callbacks=[MemoryAwareBatchSize(verbose=False), OOMRecovery(verbose=False), Record(out_dir)],
        limit_val_batches=0,
        **{**TRAINER_QUIET, "devices": 2},
    )
    trainer.fit(MODELS[model](), datamodule=Tokens())


if __name__ == "__main__":
    run_script(main)
