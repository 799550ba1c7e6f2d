"""What exact resume costs: checkpoint and resume time as multiples of one training step, and step overhead;
then streams and resumes on another number of ranks.

    python benchmarks/resume.py [--hidden 1024] [--steps 30] [--out benchmarks/results]

An MLP (4 layers of ``--hidden``, AdamW) over a GPUOptDataModule with ExactResume: one step's time,
``save_checkpoint`` (median of 5), the extra time of ``fit(ckpt_path=...)`` to its first batch, and the step
overheads of the resumable loader and of ExactResume. Then a second table: a ShardedStream of 16 JSON-lines
shards of 1,250 samples, a shuffle buffer of 512, batch 100: the time to the first batch of a resume at 10, 50 and
90 % of the epoch and the samples decoded to reach it, on the same number of ranks and on half of them (a
checkpoint of 2 ranks read by 1); and, where ``datasets`` and ``torchdata`` are installed, the baseline: the same
shards through Hugging Face ``datasets`` streaming (``shuffle(buffer_size=512)``) and torchdata's
``StatefulDataLoader``, stopped at 25, 50 and 75 % and resumed: the samples it repeats and loses, or the error it
raises. Last, the samples decoded in a whole epoch over all ranks and loader workers, as a multiple of the
samples used, for shards read from their start (JSON lines, gzip-compressed tars) and by index (uncompressed tars).
Details in docs/benchmarks.md.
"""

from __future__ import annotations

import collections
import io
import json
import os
import signal
import statistics
import tarfile
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import common
import lightning.pytorch as pl
import torch
from common import Data, StepClock, clocked, markdown_header, markdown_row, positive_int, write_json
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_gpuopt import ExactResume, GPUOptDataModule
from lightning_gpuopt.data import ShardedStream
from lightning_gpuopt.data.resume import ResumableSampler
from lightning_gpuopt.data.stream import StreamPositions

SHARDS, SHARD, WINDOW, BATCH = 16, 1250, 512, 100


class MLP(pl.LightningModule):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        layers = [nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.1)]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(args, root: Path, steps: int, resumable: bool, exact: bool, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    callbacks = [clock, ExactResume()] if exact else [clock]
    trainer = common.trainer(steps, callbacks, args.device, default_root_dir=root)
    g, n = torch.Generator().manual_seed(0), args.batch_size * (steps + 5)
    dataset = TensorDataset(torch.randn(n, args.dim, generator=g), torch.randn(n, 1, generator=g))
    data = Data(dataset, batch_size=args.batch_size, num_workers=0, resumable=resumable)
    t0 = time.perf_counter()
    trainer.fit(MLP(args.dim, args.hidden), data, ckpt_path=ckpt_path)
    step_times = clock.periods()[1:]
    return trainer, statistics.median(step_times) if step_times else None, clock.starts[0][0] - t0


def main() -> None:
    parser = common.arguments(__doc__, "resume.json", device="cpu")
    for name, default in (("--hidden", 1024), ("--dim", 256), ("--batch-size", 64), ("--steps", 30)):
        parser.add_argument(name, type=positive_int, default=default)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    _, plain_step, _ = _fit(args, root / "plain", args.steps, resumable=False, exact=False)
    _, resumable_step, _ = _fit(args, root / "resumable", args.steps, resumable=True, exact=False)
    trainer, exact_step, fresh_first = _fit(args, root / "exact", args.steps, resumable=True, exact=True)
    path = root / "exact" / "step.ckpt"
    save = statistics.median(clocked(trainer.save_checkpoint, path)[0] for _ in range(5))
    _, _, resumed_first = _fit(args, root / "exact", args.steps + 3, True, True, ckpt_path=path)
    resume = max(0.0, resumed_first - fresh_first)
    params = sum(p.numel() for p in MLP(args.dim, args.hidden).parameters())
    result = {"device": args.device, "parameters": params, "checkpoint_bytes": path.stat().st_size}
    result.update(step_s=plain_step, checkpoint_s=save, resume_s=resume, checkpoint_steps=save / plain_step)
    result.update(resume_steps=resume / plain_step, resumable_loader_overhead=resumable_step / plain_step - 1)
    result["exact_resume_overhead"] = exact_step / plain_step - 1
    markdown_header(f"{params / 1e6:.1f} M parameters, AdamW, {args.device}|value")
    markdown_row("checkpoint file", f"{result['checkpoint_bytes'] / 2**20:.1f} MiB")
    markdown_row(f"one training step (batch {args.batch_size})", f"{plain_step * 1e3:.1f} ms")
    checkpoint = f"{save * 1e3:.1f} ms = {result['checkpoint_steps']:.1f} steps"
    markdown_row("checkpoint (`save_checkpoint`)", checkpoint)
    steps = result["resume_steps"]
    markdown_row("resume (extra time to the first step)", f"{resume * 1e3:.1f} ms = {steps:.1f} steps")
    markdown_row("step time, resumable loader vs plain", f"{result['resumable_loader_overhead']:+.1%}")
    markdown_row("step time, + ExactResume", f"{result['exact_resume_overhead']:+.1%}")
    result["stream"] = _stream_rows(root)
    result["epoch_decoding"] = _decoding_rows(root)
    write_json(args.out, "resume.json", result)


def _read_jsonl(path: str):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["id"]


def _shards(root: Path) -> list[str]:
    paths = []
    for s in range(SHARDS):
        path = root / f"part-{s:02d}.jsonl"
        path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(s * SHARD, (s + 1) * SHARD)))
        paths.append(str(path))
    return paths


def _stream_resume(paths: list[str] | None, fraction: float, world_before: int) -> dict:
    """Time to the first batch of a resume at ``fraction`` of the epoch, one rank reading a checkpoint of
    ``world_before``, and the samples decoded to reach it (``paths`` ``None``: the same samples as a map-style
    dataset, shuffled)."""

    class Stream(GPUOptDataModule):
        def train_dataset(self):
            if paths is None:
                return list(range(SHARDS * SHARD))
            return ShardedStream(paths, _read_jsonl, shuffle_buffer=WINDOW)

    consumed = int(fraction * SHARDS * SHARD) // (BATCH * world_before) * BATCH * world_before
    state = {
        "epoch": 0,
        "batches": consumed // (BATCH * world_before),
        "batch_size": BATCH,
        "samples": consumed,
    }
    state.update(seed=0, world_size=world_before, shard_sizes=[SHARD] * SHARDS, configured_batch_size=BATCH)
    t0 = time.perf_counter()
    data = Stream(batch_size=BATCH, num_workers=0, pin_memory=False, device_prefetch=False)
    data.trainer = SimpleNamespace(
        world_size=1, global_rank=0, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    data.load_state_dict({"train_loader": state})
    loader = data.train_dataloader()
    next(iter(loader))
    seconds = time.perf_counter() - t0
    return {
        "data": "map-style" if paths is None else "stream",
        "fraction": fraction,
        "world_before": world_before,
        "first_batch_s": seconds,
        "decoded": loader.dataset.dataset.decoded if paths is not None else None,
    }


def _baseline(paths: list[str]) -> dict:
    """HF datasets streaming + StatefulDataLoader over the same shards, stopped at 25, 50, 75 % and resumed."""
    try:
        import datasets
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as err:
        return {"skipped": f"{err.name} is not installed"}

    def leg(seen, workers, batches, state):
        stream = datasets.load_dataset("json", data_files=paths, streaming=True, split="train")
        loader = StatefulDataLoader(
            stream.shuffle(seed=0, buffer_size=WINDOW), batch_size=BATCH, num_workers=workers
        )
        if state is not None:
            loader.load_state_dict(state)
        for n, batch in enumerate(loader, 1):
            seen.update(int(i) for i in batch["id"])
            if n == batches:
                break
        return loader.state_dict()

    out: dict = {}
    quarter = SHARDS * SHARD // BATCH // 4
    for name, workers in (("2 -> 1 workers", (2, 1, 1, 1)), ("0 workers kept", (0, 0, 0, 0))):
        seen: collections.Counter = collections.Counter()
        state = None
        try:
            for k, w in enumerate(workers):
                state = leg(seen, w, quarter if k < 3 else None, state)
        except Exception as err:  # what a user meets: recorded, not raised
            out[name] = f"leg {k + 1}: {type(err).__name__} {str(err)[:80]!r}"
            continue
        lost = SHARDS * SHARD - len(seen)
        out[name] = f"{sum(c - 1 for c in seen.values())} repeated, {lost} lost"
    return out


class _LitDataModule(pl.LightningModule):
    """Trains on nothing: notes each batch's ids, and sends itself SIGTERM after batch ``stop`` (ExactResume stops)."""

    def __init__(
        self, folder: Path, workers: int, batch: int, seen: collections.Counter, stop: int | None
    ) -> None:
        super().__init__()
        self.folder, self.workers, self.batch, self.seen, self.stop = folder, workers, batch, seen, stop
        self.layer = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        self.seen.update(int(i) for i in batch["id"])
        if batch_idx == self.stop:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.layer(batch["id"][:, None].float()).sum() * 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        import litdata

        dataset = litdata.StreamingDataset(str(self.folder), shuffle=True, seed=0)
        return litdata.StreamingDataLoader(dataset, batch_size=self.batch, num_workers=self.workers)


def _litdata_baseline(root: Path) -> dict:
    """LitData's own StreamingDataLoader under Lightning (its state in the fit loop's): stopped at 25 % of the epoch
    by SIGTERM (ExactResume), resumed with the same loader, and with 1 worker and batch 200 (a resume on half the
    ranks keeping the optimizer batch)."""
    try:
        from litdata.streaming.writer import BinaryWriter
    except ImportError as err:
        return {"skipped": f"{err.name} is not installed"}
    folder = root / "litdata"
    writer = BinaryWriter(str(folder), chunk_size=SHARD)
    for i in range(SHARDS * SHARD):
        writer[i] = {"id": i}
    writer.done()
    writer.merge(1)
    out = {}
    quarter = SHARDS * SHARD // BATCH // 4
    for name, second in (
        ("2 workers x 100 kept", (2, BATCH)),
        ("2 workers x 100 -> 1 x 200", (1, 2 * BATCH)),
    ):
        seen: collections.Counter = collections.Counter()
        run = root / f"litdata-{second[0]}"
        for (workers, batch), stop, resume in (((2, BATCH), quarter - 1, None), (second, None, "last")):
            trainer = pl.Trainer(
                max_epochs=1,
                callbacks=[ExactResume()],
                default_root_dir=run,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
            )
            module = _LitDataModule(folder, workers, batch, seen, stop)
            trainer.fit(module, ckpt_path=None if resume is None else run / "checkpoints" / "last.ckpt")
        lost = SHARDS * SHARD - len(seen)
        out[name] = f"{sum(c - 1 for c in seen.values())} repeated, {lost} lost"
    return out


def _stream_rows(root: Path) -> dict:
    paths = _shards(root)
    rows = [_stream_resume(paths, f, w) for w in (1, 2) for f in (0.1, 0.5, 0.9)]
    rows += [_stream_resume(None, 0.5, w) for w in (1, 2)]
    print()
    markdown_header(
        f"{SHARDS} x {SHARD} samples, window {WINDOW}, batch {BATCH}|first batch|decoded to reach it"
    )
    for row in rows:
        where = f"{row['data']}, resume at {row['fraction']:.0%}, {row['world_before']} -> 1 rank(s)"
        decoded = "" if row["decoded"] is None else f"{row['decoded']} (≤ {SHARD + WINDOW})"
        markdown_row(where, f"{row['first_batch_s'] * 1e3:.0f} ms", decoded)
    baseline = _baseline(paths)
    for name, said in baseline.items():
        markdown_row(f"baseline, HF datasets + StatefulDataLoader, {name}", said, "")
    litdata = _litdata_baseline(root)
    for name, said in litdata.items():
        markdown_row(f"baseline, LitData StreamingDataLoader under Lightning, {name}", said, "")
    baseline = {**baseline, **{f"litdata, {k}": v for k, v in litdata.items()}}
    return {"resumes": rows, "baseline": baseline}


def _tars(root: Path, suffix: str) -> list[str]:
    paths = []
    for s in range(SHARDS):
        path = root / f"part-{s:02d}{suffix}"
        with tarfile.open(path, "w:gz" if suffix.endswith("gz") else "w") as tar:
            for i in range(s * SHARD, (s + 1) * SHARD):
                payload = json.dumps({"id": i}).encode()
                info = tarfile.TarInfo(f"{i:06d}.json")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
        paths.append(str(path))
    return paths


def _epoch_decoded(stream: ShardedStream, ranks: int, workers: int, batch: int) -> float:
    """The samples decoded in one epoch by every rank's every loader worker (each its own process, with its own
    place in the stream, given every ``workers``-th batch of its rank), over the samples used."""
    decoded = 0
    for rank in range(ranks):
        sampler = ResumableSampler(range(len(stream)), num_replicas=ranks, rank=rank, shuffle=False)
        keys = list(sampler)
        batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
        for worker in range(workers):
            view = StreamPositions.of(stream, run_seed=0)
            for keys_of_batch in batches[worker::workers]:
                for key in keys_of_batch:
                    view[key]
            decoded += view.decoded
    return decoded / len(stream)


def _decoding_rows(root: Path) -> list[dict]:
    decode = lambda sample: json.loads(sample["json"])["id"]  # noqa: E731
    streams = {
        "JSON lines (read from the start)": ShardedStream(_shards(root), _read_jsonl, shuffle_buffer=WINDOW),
        "tar, gzip (read from the start)": ShardedStream.from_tars(
            _tars(root, ".tar.gz"), decode, shuffle_buffer=WINDOW
        ),
        "tar (read by index)": ShardedStream.from_tars(_tars(root, ".tar"), decode, shuffle_buffer=WINDOW),
    }
    layouts = ((1, 1, 100), (2, 2, 100), (8, 4, 32))
    print()
    markdown_header(
        f"a whole epoch, {SHARDS} x {SHARD} samples, window {WINDOW}|"
        + "|".join(f"{r} rank(s) x {w} worker(s), batch {b}" for r, w, b in layouts)
    )
    rows = []
    for name, stream in streams.items():
        ratios = [_epoch_decoded(stream, r, w, b) for r, w, b in layouts]
        markdown_row(f"{name}: samples decoded / used", *(f"{x:.1f}x" for x in ratios))
        rows.append({"shards": name, "layouts": [list(x) for x in layouts], "decoded_per_used": ratios})
    return rows


if __name__ == "__main__":
    main()
