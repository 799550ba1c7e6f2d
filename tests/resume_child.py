"""A training run the exact-resume tests start as a subprocess, kill, signal and resume.

64-true, an MLP with dropout, random augmentation (torch, Python and NumPy draws), AdamW, a
GPUOptDataModule, ExactResume and a StepBoundaryCheckpoint writing ``last.ckpt`` every optimizer step.

    python tests/resume_child.py ROOT [--devices 2] [--accumulate 2] [--workers 2] [--persistent] [--kill-batch N]
        [--crash-batch N] [--term-batch N --term-ranks all|1] [--oom-limit BYTES --oom-from N] [--hidden H]
        [--batch-size B] [--length L] [--epochs E] [--val] [--val-every N] [--onecycle] [--epoch-schedule] [--adaptive]
        [--record-epochs] [--no-dropout] [--stream SHARDS | --stored GLOB] [--shuffle-buffer N] [--elastic keep_optimizer_batch|keep_per_rank] [--report] [--resume]

``--kill-batch N`` SIGKILLs the process at the end of training batch N (counted over the whole run, before
that batch's checkpoint); ``--crash-batch N`` raises :class:`Crash` there instead, which an in-process caller
catches (the same place in the run, without a process to kill); ``--term-batch N`` sends SIGTERM at its start.

Each rank appends ``epoch batch_idx id,id,...`` per training batch to ``ROOT/ids_rank{r}.txt`` (flushed,
so a killed run keeps its lines), with ``--record-epochs`` also ``epoch -1 -`` where ``on_train_epoch_start`` ran; at the end of fit rank 0 saves the parameters to ``ROOT/params.pt`` and
every rank writes the decisions of its run to ``ROOT/decisions_rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from lightning_gpuopt import (
    AdaptiveBatchSize,
    ExactResume,
    GPUOptDataModule,
    GPUOptReport,
    GradientNoiseScale,
    OOMRecovery,
)
from lightning_gpuopt.callbacks.exact_resume import StepBoundaryCheckpoint
from lightning_gpuopt.data.stream import ShardedStream
from lightning_gpuopt.decisions import decisions

LENGTH, DIM, BATCH = 64, 8, 4
VAL_LENGTH = 12


class Augmented(Dataset):
    """Sample i is (i, x_i + noise, y_i); the noise draws from torch, Python and NumPy."""

    def __init__(self, length: int = LENGTH, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, DIM, generator=g, dtype=torch.float64)
        self.y = self.x @ torch.randn(DIM, 1, generator=g, dtype=torch.float64)
        #: Token counts for batching by tokens (``--max-tokens``): the samples themselves stay fixed-size.
        self.lengths = [1 + (i * 7) % 13 for i in range(length)]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = (
            0.1
            * torch.randn(DIM, dtype=torch.float64)
            * random.uniform(0.5, 1.5)
            * np.random.uniform(0.5, 1.5)
        )
        return i, self.x[i] + noise, self.y[i]


class ReadShard:
    """Shard ``s`` of a stream over :class:`Augmented`: its samples ``s*size .. (s+1)*size-1``, one at a time."""

    def __init__(self, samples: Augmented, size: int) -> None:
        self.samples, self.size = samples, size

    def __call__(self, shard: int):
        for i in range(shard * self.size, (shard + 1) * self.size):
            yield self.samples[i]


class FromId:
    """A sample ``(i, x_i, y_i)`` of :class:`Augmented` (without its noise) from a stored record of its id: a Hugging
    Face row ``{"id": i}`` or a tar sample whose ``json`` is ``{"id": i}``."""

    def __init__(self, samples: Augmented) -> None:
        self.samples = samples

    def __call__(self, record: dict) -> tuple:
        i = int(record["id"]) if "id" in record else int(json.loads(record["json"])["id"])
        return i, self.samples.x[i], self.samples.y[i]


class Mapped:
    """``read_shard`` of another stream, each sample through ``fn``."""

    def __init__(self, read_shard, fn) -> None:
        self.read_shard, self.fn = read_shard, fn

    def __call__(self, shard):
        return (self.fn(sample) for sample in self.read_shard(shard))


class Data(GPUOptDataModule):
    def __init__(
        self, length: int = LENGTH, shards: int = 0, shuffle_buffer: int = 0, stored: str = "", **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.length, self.shards, self.shuffle_buffer, self.stored = length, shards, shuffle_buffer, stored

    def train_dataset(self):
        samples = Augmented(self.length)
        if self.stored.endswith(".jsonl"):  # a glob of JSON-lines shards, through Hugging Face datasets
            import glob

            import datasets

            files = sorted(glob.glob(self.stored))
            hf = datasets.load_dataset("json", data_files=files, streaming=True, split="train")
            stream = ShardedStream.from_hf(hf, shuffle_buffer=self.shuffle_buffer)
            stream.read_shard = Mapped(stream.read_shard, FromId(samples))
            return stream
        if self.stored.endswith(".tar"):  # a glob of WebDataset-style tar shards
            import glob

            return ShardedStream.from_tars(
                sorted(glob.glob(self.stored)), FromId(samples), shuffle_buffer=self.shuffle_buffer
            )
        if not self.shards:
            return samples
        read = ReadShard(samples, self.length // self.shards)
        return ShardedStream(list(range(self.shards)), read, shuffle_buffer=self.shuffle_buffer)


class DataWithValidation(Data):
    def val_dataset(self):
        return Augmented(VAL_LENGTH, seed=1)


class DropoutRegressor(pl.LightningModule):
    def __init__(
        self, hidden: int = 32, onecycle: bool = False, epoch_schedule: bool = False, dropout: float = 0.3
    ) -> None:
        super().__init__()
        self.onecycle, self.epoch_schedule = onecycle, epoch_schedule
        # float64 from the start: Lightning loads a checkpoint's weights before 64-true converts the module,
        # so a float32 module would round the float64 weights it resumes from.
        self.net = nn.Sequential(
            nn.Linear(DIM, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        ).double()

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        if self.epoch_schedule:  # stepped by Lightning at each epoch's end
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}
        if not self.onecycle:
            return optimizer
        # Reads `estimated_stepping_batches`, which makes Lightning drop a stateful loader's state (#20550).
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.02, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ValidatedRegressor(DropoutRegressor):
    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))


class Recorder(pl.Callback):
    def __init__(self, root: str, epochs: bool = False) -> None:
        self.root, self.epochs = root, epochs

    def on_train_epoch_start(self, trainer, pl_module):
        if self.epochs:  # as batch -1 of the epoch, with no sample
            with open(os.path.join(self.root, f"ids_rank{trainer.global_rank}.txt"), "a") as f:
                f.write(f"{trainer.current_epoch} -1 -\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ids = ",".join(str(int(i)) for i in batch[0])
        with open(os.path.join(self.root, f"ids_rank{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx} {ids}\n")


class Crash(Exception):
    """What ``--crash-batch`` raises: the run dies where ``--kill-batch`` would SIGKILL it."""


class Fault(pl.Callback):
    """SIGKILL (or :class:`Crash`) at the end of a batch, before its checkpoint, or SIGTERM at the start of one."""

    def __init__(
        self,
        kill_batch: int | None = None,
        term_batch: int | None = None,
        term_ranks: str = "all",
        crash_batch: int | None = None,
    ) -> None:
        self.kill_batch, self.term_batch, self.term_ranks = kill_batch, term_batch, term_ranks
        self.crash_batch = crash_batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.term_batch and (
            self.term_ranks == "all" or str(trainer.global_rank) == self.term_ranks
        ):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.kill_batch:
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.fit_loop.total_batch_idx == self.crash_batch:
            raise Crash(f"crash at batch {self.crash_batch}")


class MemoryLimit(pl.Callback):
    """From batch ``start`` on, forward and backward run under a SimulatedMemory limit (an OOM at k = 1).

    The limit is lifted for the optimizer step (the OOM to recover from is the activations'). ``limit`` 0:
    measure only; the largest forward-and-backward peak goes to ``ROOT/peak.txt``.
    """

    def __init__(self, root: str, limit: int, start: int) -> None:
        from lightning_gpuopt.testing import SimulatedMemory

        self.memory, self.limit, self.start, self.root = SimulatedMemory(None), limit, start, root
        self.peak = 0

    def on_fit_start(self, trainer, pl_module):
        self.memory.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.memory.reset_peak()
        if self.limit and trainer.fit_loop.total_batch_idx >= self.start:
            self.memory.limit_bytes = self.limit

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.peak = max(self.peak, self.memory.peak_bytes)
        self.memory.limit_bytes = None

    def on_fit_end(self, trainer, pl_module):
        self.memory.__exit__(None, None, None)
        with open(os.path.join(self.root, "peak.txt"), "w") as f:
            f.write(str(self.peak))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--crash-batch", type=int, default=None)
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--val", action="store_true")
    parser.add_argument("--val-every", type=int, default=None)
    parser.add_argument("--kill-batch", type=int, default=None)
    parser.add_argument("--term-batch", type=int, default=None)
    parser.add_argument("--term-ranks", default="all")
    parser.add_argument("--oom-limit", type=int, default=None)
    parser.add_argument("--oom-from", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--onecycle", action="store_true")
    parser.add_argument("--epoch-schedule", action="store_true")
    parser.add_argument("--record-epochs", action="store_true")
    parser.add_argument("--adaptive", action="store_true")
    parser.add_argument("--no-dropout", action="store_true")
    parser.add_argument("--stream", type=int, default=0, help="shards of a ShardedStream over the samples")
    parser.add_argument("--shuffle-buffer", type=int, default=0)
    parser.add_argument("--stored", default="", help="a glob of *.jsonl (Hugging Face) or *.tar shards")
    parser.add_argument("--elastic", default="keep_optimizer_batch")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.root, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    callbacks = [
        ExactResume(elastic=args.elastic),
        Recorder(args.root, args.record_epochs),
        Fault(args.kill_batch, args.term_batch, args.term_ranks, args.crash_batch),
        StepBoundaryCheckpoint(
            dirpath=os.path.join(args.root, "ckpt"), every_n_train_steps=1, save_top_k=0, save_last=True
        ),
    ]
    if args.adaptive:  # the batch grows 8 -> 16 -> 32 mid-epoch (up to min_batch)
        callbacks += [
            GradientNoiseScale(every=1, min_measurements=2),
            AdaptiveBatchSize(interval=1, min_batch=32, max_batch=32),
        ]
    if args.report:
        callbacks.append(GPUOptReport(dirpath=args.root, plot=False, table=False))
    if args.oom_limit is not None:
        callbacks += [OOMRecovery(), MemoryLimit(args.root, args.oom_limit, args.oom_from)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision="64-true",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=args.val_every,
        callbacks=callbacks,
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    validation = args.val or args.val_every is not None
    model = (ValidatedRegressor if validation else DropoutRegressor)(
        args.hidden, args.onecycle, args.epoch_schedule, 0.0 if args.no_dropout else 0.3
    )
    data = (DataWithValidation if validation else Data)(
        length=args.length,
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=args.persistent,
        max_tokens=args.max_tokens,
        shards=args.stream,
        shuffle_buffer=args.shuffle_buffer,
        stored=args.stored,
    )
    trainer.fit(model, data, ckpt_path="last" if args.resume else None)
    rank = trainer.global_rank
    with open(os.path.join(args.root, f"decisions_rank{rank}.json"), "w") as f:
        json.dump([d.as_dict() for d in decisions(trainer)], f)
    if rank == 0:
        torch.save(
            {n: p.detach().clone() for n, p in model.named_parameters()}, os.path.join(args.root, "params.pt")
        )


if __name__ == "__main__":
    main()
    # The process group a DDP run leaves, destroyed before the interpreter's exit races gloo's threads
    # (a SIGABRT after a run that succeeded; tests.helpers.run_script, not importable here).
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
