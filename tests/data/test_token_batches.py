"""TokenBatchSampler: batches within a token budget, every sample once, every rank the same count, the same
count every epoch, the same epoch on any resume (issue 36), swept over lengths, budgets, ranks and epochs."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gpuopt.data.token_batches import TokenBatchSampler


def _lognormal_lengths(n: int = 2000, seed: int = 0) -> list[int]:
    """The issue's data: lengths log-normal around 80 tokens, clipped to 16..512."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=generator) * 0.6 + 4.38).exp().round().clamp(16, 512).long().tolist()


def _ranks(lengths, max_tokens, world, **kwargs) -> list[TokenBatchSampler]:
    return [
        TokenBatchSampler(lengths, max_tokens, num_replicas=world, rank=r, **kwargs) for r in range(world)
    ]


def _epoch(samplers, epoch) -> list[list[list[int]]]:
    """Each rank's batches of ``epoch``, as indices (the items are (epoch, index) pairs)."""
    out = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert all(e == epoch for batch in batches for e, _ in batch)
        out.append([[i for _, i in batch] for batch in batches])
    return out


@settings(max_examples=80, derandomize=True, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=8, max_size=300),
    max_tokens=st.integers(300, 3000),
    world=st.integers(1, 4),
    shuffle=st.booleans(),
)
def test_every_sample_once_within_the_budget_and_the_same_count_on_every_rank_and_epoch(
    lengths, max_tokens, world, shuffle
):
    try:
        samplers = _ranks(lengths, max_tokens, world, shuffle=shuffle, seed=3)
    except (
        ValueError
    ) as err:  # refused only where every batch is one sample and they do not divide by the ranks
        assert "cannot be dealt evenly" in str(err) and len(lengths) % world
        return
    counts = set()
    for epoch in (0, 1, 2):
        ranks = _epoch(samplers, epoch)
        seen = sorted(i for batches in ranks for batch in batches for i in batch)
        assert seen == list(range(len(lengths)))  # every sample once: no repeat, no loss
        assert all(len(batch) * max(lengths[i] for i in batch) <= max_tokens for b in ranks for batch in b)
        counts |= {len(batches) for batches in ranks}
    assert counts == {len(samplers[0])}  # every rank, every epoch: the count known before the epoch


def test_an_epoch_is_a_function_of_seed_and_epoch_and_epochs_differ():
    lengths = _lognormal_lengths(400)
    a, b = TokenBatchSampler(lengths, 2048, seed=1), TokenBatchSampler(lengths, 2048, seed=1)
    assert a.epoch_batches(3) == b.epoch_batches(3)
    assert a.epoch_batches(3) != a.epoch_batches(4)
    assert a.epoch_batches(3) != TokenBatchSampler(lengths, 2048, seed=2).epoch_batches(3)
    members = [{frozenset(batch) for batch in a.epoch_batches(e)} for e in (0, 1)]
    assert len(members[0] & members[1]) < len(members[0]) / 2  # samples meet other neighbours each epoch


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("epoch", "consumed"), [(0, 0), (0, 5), (2, 7), (2, 0)])
def test_a_resumed_epoch_is_the_rest_of_the_uninterrupted_one(world, epoch, consumed):
    lengths = _lognormal_lengths(300)
    whole = _epoch(_ranks(lengths, 2048, world), epoch)
    resumed = _ranks(lengths, 2048, world)
    for sampler in resumed:
        sampler.skip(epoch=epoch, batches=consumed)
    assert _epoch(resumed, epoch) == [batches[consumed:] for batches in whole]
    assert _epoch(resumed, epoch + 1) == _epoch(_ranks(lengths, 2048, world), epoch + 1)  # the skip is over


def test_on_the_issues_data_padding_is_small_and_the_ranks_batches_cost_alike():
    """2,000 samples, log-normal lengths around 80: fixed batches of 64 pad 77 % of what they compute."""
    lengths = _lognormal_lengths()
    for world in (1, 2, 4):
        batches = TokenBatchSampler(lengths, 4096, num_replicas=world).epoch_batches(0)
        costs = [len(batch) * max(lengths[i] for i in batch) for batch in batches]
        assert 1 - sum(lengths) / sum(costs) < 0.06
        steps = [costs[k : k + world] for k in range(0, len(costs), world)]
        ratios = [max(step) / min(step) for step in steps]
        # A step's ranks wait on its costliest batch: within 5 % but for one step an epoch (the remainder's).
        assert statistics.median(ratios) < 1.05 and sum(r > 1.05 for r in ratios) <= 1, ratios


def test_a_sample_over_the_budget_is_refused_in_one_line_or_runs_alone():
    lengths = [10, 12, 50, 11, 60]
    with pytest.raises(
        ValueError, match=r"^sample 4 has 60 tokens, more than max_tokens=40 \(2 sample\(s\) do\)"
    ) as err:
        TokenBatchSampler(lengths, 40)
    assert "\n" not in str(err.value) and "long_samples='alone'" in str(err.value)
    sampler = TokenBatchSampler(lengths, 40, long_samples="alone")
    alone = {tuple(batch) for batch in sampler.epoch_batches(0) if set(batch) & {2, 4}}
    assert alone == {(2,), (4,)}


@pytest.mark.parametrize(
    ("lengths", "kwargs", "message"),
    [
        ([], {}, "no samples"),
        ([3, 0], {}, "got 0 for sample 1"),
        ([3, 4], {"max_tokens": 0}, "max_tokens"),
        (
            [3, 4],
            {"long_samples": "pack"},
            "`long_samples` must be one of ('refuse', 'alone', 'truncate'), got 'pack'",
        ),
        (
            [9, 9, 9],
            {"max_tokens": 9, "num_replicas": 2},
            "3 batches of one sample each cannot be dealt evenly",
        ),
        (
            [1, 1],
            {"max_tokens": 9, "num_replicas": 4},
            "2 batches of one sample each cannot be dealt evenly to 4",
        ),
    ],
)
def test_bad_input_gets_one_line_saying_what_to_do(lengths, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        TokenBatchSampler(lengths, **{"max_tokens": 20, **kwargs})
    assert "\n" not in str(err.value)
