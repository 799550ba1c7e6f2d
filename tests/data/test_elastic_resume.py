"""Elastic resume of map-style data (issue 37): a run resumed on another number of ranks goes on past the samples
the interrupted epoch consumed, instead of starting the epoch again.

ResumableSampler deals one order per epoch round-robin, so the ranks' b-th batches together are one window of it
on any number of ranks: the checkpoint's consumed samples are the first C of the order, and the resumed epoch deals
the rest over the new ranks. Swept with Hypothesis (dataset sizes, ranks before and after, batch sizes, the batch
of the interruption, shuffle); and a real run killed on 2 DDP ranks, resumed on 1 (slow): every sample of the epoch
once.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gpuopt.data.resume import ResumableSampler
from tests import resume_child


def _dealt(n: int, world: int, shuffle: bool, skip: int = 0) -> list[list[int]]:
    samplers = [
        ResumableSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=7) for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(3)
        s.skip(3, skip)
    return [[i for _, i in s] for s in samplers]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 60),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    batch=st.integers(1, 5),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_a_resume_on_another_number_of_ranks_sees_every_sample_of_the_epoch(
    n, before, after, batch, shuffle, data
):
    old = _dealt(n, before, shuffle)
    per_rank_batches = -(-len(old[0]) // batch)
    done = data.draw(st.integers(0, per_rank_batches - 1), label="batches consumed")
    consumed = [i for rank in old for i in rank[: done * batch]]
    skip = done * batch * before  # what the checkpoint counts: batches x batch_size x ranks
    new = _dealt(n, after, shuffle, skip)
    assert len({len(rank) for rank in new}) == 1  # every new rank as many samples: as many batches
    seen = collections.Counter(consumed + [i for rank in new for i in rank])
    assert set(seen) == set(range(n))  # nothing lost
    # Repeats: only the padding to a multiple of the ranks (DistributedSampler's), before and after.
    padding = (-n) % before + (-n) % after + after - 1
    assert sum(seen.values()) - n <= padding
    if n % before == 0 and n % after == 0 and (n - skip) % after == 0:
        assert all(c == 1 for c in seen.values())


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    world=st.integers(1, 4),
    batch=st.integers(1, 5),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_on_the_same_number_of_ranks_a_resume_deals_what_the_uninterrupted_epoch_dealt(
    n, world, batch, shuffle, data
):
    full = _dealt(n, world, shuffle)
    done = data.draw(st.integers(0, -(-len(full[0]) // batch) - 1))
    resumed = _dealt(n, world, shuffle, done * batch * world)
    assert resumed == [rank[done * batch :] for rank in full]


def _ids(path: Path) -> dict[tuple[int, int], list[int]]:
    lines = path.read_text().split()
    return {
        (int(e), int(b)): [int(i) for i in ids.split(",")]
        for e, b, ids in zip(lines[::3], lines[1::3], lines[2::3])
    }


@pytest.mark.slow
def test_a_run_killed_on_2_ranks_resumed_on_1_sees_every_sample_of_the_epoch_once(tmp_path, caplog):
    """64 samples, batches of 4: killed at the end of batch 3 on 2 DDP ranks (3 batches checkpointed, 24 samples),
    resumed on 1: the epoch goes on past those 24, and says so."""
    args = [str(tmp_path), "--epochs", "1"]
    done = subprocess.run(
        [sys.executable, resume_child.__file__, *args, "--devices", "2", "--kill-batch", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    first = {r: {k: v for k, v in _ids(tmp_path / f"ids_rank{r}.txt").items() if k[1] < 3} for r in (0, 1)}
    resumed = subprocess.run(
        [sys.executable, resume_child.__file__, *args, "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = {k: v for k, v in _ids(tmp_path / "ids_rank0.txt").items() if k[1] >= 3}
    seen = [i for part in (first[0], first[1], after) for ids in part.values() for i in ids]
    assert sorted(seen) == list(range(resume_child.LENGTH)), collections.Counter(seen).most_common(3)
    line = "the checkpoint was written by 2 rank(s), this run has 1; the interrupted epoch goes on past the 24 sample(s)"
    assert line in resumed.stdout + resumed.stderr
