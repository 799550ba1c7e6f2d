"""ShardedStream (issue 37): a training stream of shards in one canonical order per (seed, epoch), read by
position, resumed exactly mid-epoch on any number of ranks and workers.

The order is swept with Hypothesis (shard sizes, window sizes, epochs): every sample once per epoch, a position
read alone equal to the same position read in order. A resume at 90 % of the epoch decodes at most one shard plus
one shuffle window. The issue's acceptance run (tests/resume_child.py over gloo): 16 shards of 1,250 samples, a
shuffle buffer of 512, stopped three times in one epoch and resumed as 2 ranks x 2 workers -> 1 x 1 -> 2 x 0 ->
2 x 2: every sample exactly once.
"""

from __future__ import annotations

import collections
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gpuopt import GPUOptDataModule
from lightning_gpuopt.data import ShardedStream
from lightning_gpuopt.data.stream import StreamPositions
from tests import resume_child
from tests.helpers import run_ranks

SHARD = 1250


def _ids(shard_sizes: list[int]):
    starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
    return lambda s: (starts[s] + i for i in range(shard_sizes[s]))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    window=st.integers(0, 12),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_an_epoch_is_every_sample_once_and_any_position_reads_alone_as_in_order(sizes, window, epoch, data):
    stream = ShardedStream(list(range(len(sizes))), _ids(sizes), shuffle_buffer=window, seed=3)
    in_order = StreamPositions(stream, seed=3)
    order = [in_order[(epoch, p)] for p in range(len(in_order))]
    assert sorted(order) == list(range(sum(sizes)))
    if sum(sizes):
        p = data.draw(st.integers(0, sum(sizes) - 1), label="position")
        alone = StreamPositions(stream, seed=3)
        assert alone[(epoch, p)] == order[p]
        assert alone.decoded <= max(sizes) + max(1, window)  # one shard before the window, then the window


def test_epochs_and_seeds_draw_other_orders_and_a_window_stays_a_window():
    stream = ShardedStream(list(range(4)), _ids([25] * 4), shuffle_buffer=10, seed=0)
    view = StreamPositions(stream, seed=0)
    first, second = ([view[(e, p)] for p in range(100)] for e in (0, 1))
    assert first != second and sorted(first) == sorted(second) == list(range(100))
    other_seed = StreamPositions(stream, seed=1)
    assert [other_seed[(0, p)] for p in range(100)] != first
    shard_of = [i // 25 for i in first]  # a window of 10 mixes at most two neighbouring shards
    assert all(len(set(shard_of[w : w + 10])) <= 2 for w in range(0, 100, 10))


class _Stream(GPUOptDataModule):
    def train_dataset(self):
        return ShardedStream(list(range(16)), _ids([SHARD] * 16), shuffle_buffer=512)


def _loader(state: dict | None = None):
    data = _Stream(batch_size=100, num_workers=0, pin_memory=False, device_prefetch=False)
    data.trainer = SimpleNamespace(
        world_size=1, global_rank=0, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    if state is not None:
        data.load_state_dict({"train_loader": state})
    return data.train_dataloader()


def test_a_resume_at_90_percent_decodes_at_most_one_shard_plus_the_shuffle_buffer():
    whole = [int(i) for batch in _loader() for i in batch]
    assert sorted(whole) == list(range(16 * SHARD))
    state = {"epoch": 0, "batches": 180, "batch_size": 100, "samples": 18_000, "seed": 0, "world_size": 1}
    loader = _loader({**state, "shard_sizes": [SHARD] * 16, "configured_batch_size": 100})
    batches = iter(loader)
    first = next(batches)
    decoded = loader.dataset.dataset.decoded
    assert decoded <= SHARD + 512, decoded
    rest = [int(i) for i in first] + [int(i) for batch in batches for i in batch]
    assert rest == whole[18_000:] and len(loader) == 200  # 180 counted by the fit loop, 20 left


def _leg(root: Path, ranks: int, workers: int, *args: object) -> None:
    run_ranks(
        Path(resume_child.__file__),
        root,
        *("--stream", 16, "--shuffle-buffer", 512, "--length", 16 * SHARD, "--batch-size", 100),
        *("--devices", ranks, "--workers", workers, "--no-dropout", *args),
        ranks=1,
        result="params.pt",
        timeout=400,
    )


@pytest.mark.slow
def test_stopped_three_times_in_one_epoch_on_other_ranks_and_workers_every_sample_once(tmp_path):
    """Optimizer batch 200 (2 ranks x 100, then 1 x 200, ...): SIGTERM at steps 25, 50 and 75 of the 100."""
    _leg(tmp_path, 2, 2, "--term-batch", 25)
    _leg(tmp_path, 1, 1, "--term-batch", 50, "--resume")
    _leg(tmp_path, 2, 0, "--term-batch", 75, "--resume")
    _leg(tmp_path, 2, 2, "--resume")
    seen = collections.Counter()
    sizes = {}
    for rank in (0, 1):
        lines = (tmp_path / f"ids_rank{rank}.txt").read_text().splitlines()
        sizes[rank] = collections.Counter(len(line.split()[2].split(",")) for line in lines)
        for line in lines:
            seen.update(int(i) for i in line.split()[2].split(","))
    assert sorted(seen) == list(range(16 * SHARD)) and set(seen.values()) == {1}, seen.most_common(3)
    # Each leg trained its part: rank 0 ran 25 batches of 200 on its own (the second leg), rank 1 none then.
    assert sizes == {0: {100: 75, 200: 25}, 1: {100: 75}}
