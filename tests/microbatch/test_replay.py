"""replay.py: a piece's random draws replayed on its parts, driven directly with small steps: the parts see the
piece's rows, a user's own generator is left alone, and what cannot be replayed is reported, not guessed."""

from __future__ import annotations

import random

import torch

from lightning_gpuopt.microbatch.replay import RandomDraws


def _noise_step(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn_like(x)


def test_each_part_sees_the_pieces_draws_for_its_rows():
    x, draws = torch.arange(8.0).view(4, 2), RandomDraws(4)
    with draws.record():
        whole = _noise_step(x)
    assert draws.drew and draws.host is None
    with draws.replay(1, 3) as part:
        middle = _noise_step(x[1:3])
    assert part.failure is None
    assert torch.equal(middle, whole[1:3])


def test_an_operator_given_a_generator_is_the_users_and_not_recorded():
    draws = RandomDraws(4)
    with draws.record():
        torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    assert not draws.drew


def test_what_cannot_be_replayed_is_reported():
    x, draws = torch.zeros(4, 2), RandomDraws(4)
    with draws.record():
        _noise_step(x)
        _noise_step(x)
    with draws.replay(0, 2) as part:  # a part that draws fewer times than its piece (a loop over samples?)
        _noise_step(x[:2])
    assert part.failure == (
        "torch's random operators ran as randn_like x2 on a piece of 4 samples, but only 1 time(s) on its part of 2 "
        "sample(s) (a loop over samples?)"
    )
    state = random.getstate()
    host = RandomDraws(4)
    try:
        with host.record():
            random.random()
    finally:
        random.setstate(state)
    assert host.host == "Python's `random` module"
