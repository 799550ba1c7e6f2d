"""The loss-weighting check on steps that draw random numbers inside ``training_step`` (issue 26).

The check runs the piece of the batch with torch's random draws recorded, and its parts with them replayed
(``microbatch/replay.py``), so a diffusion or flow-matching step is weighted exactly like a deterministic one.
Each fit runs under SimulatedMemory with a limit that makes the default ``OOMRecovery()`` split every batch,
unless it says otherwise.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from lightning_gpuopt import LossWeightingError, OOMRecovery
from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.microbatch.loss_weighting_rules import Weighting
from lightning_gpuopt.microbatch.replay import RandomDraws, draws_random, op_arguments, rows_for
from tests.helpers import training_distance
from tests.microbatch.stochastic_models import (
    Diffusion,
    FlowMatching,
    Images,
    MaskingInStep,
    NoisyInfoNCE,
    Points,
    Tokens,
    Wide,
    limit_forcing_split,
    train,
)


def _weighting(trainer) -> list[str]:
    return [d.message for d in decisions(trainer) if d.kind == "loss weighting"]


def _split_fit(make, dataset, callback=None, batch_size: int = 16, **kwargs):
    limit = limit_forcing_split(
        make, dataset, batch_size=batch_size, precision=kwargs.get("precision", "32-true")
    )
    callback = callback or OOMRecovery(verbose=False)
    run = train(make(), dataset, [callback], limit=limit, batch_size=batch_size, **kwargs)
    return run, callback


def test_diffusers_ddpm_splits_with_sample_shares_and_no_warning():
    pytest.importorskip("diffusers", reason="diffusers is not installed (the `test` extra has it)")
    run, oom = _split_fit(Diffusion, Images(), batch_size=8, steps=2)
    assert run.trainer.global_step == 2 and oom.k >= 2 and run.memory.num_ooms >= 1
    assert oom.loss_weighting.decided.kind is Weighting.SAMPLES
    (message,) = _weighting(run.trainer)
    assert message.startswith("loss weighting: sample shares — matches your loss to")
    assert "random draws replayed" in message
    assert run.pack_warnings == []


@pytest.mark.parametrize(("reduction", "expected"), [("mean", Weighting.SAMPLES), ("sum", Weighting.SUM)])
def test_flow_matching_chooses_sample_shares_for_a_mean_and_the_sum_for_a_sum(reduction, expected):
    run, oom = _split_fit(lambda: FlowMatching(reduction), Points())
    assert run.trainer.global_step == 4 and oom.k >= 2
    assert oom.loss_weighting.decided.kind is expected
    assert oom.loss_weighting.result.mismatch <= 1e-6
    assert run.pack_warnings == []


def test_infonce_with_noise_drawn_in_the_step_is_refused_naming_the_coupling():
    with pytest.raises(
        LossWeightingError, match=r"no weighting of micro-batch losses reproduces your loss"
    ) as err:
        _split_fit(NoisyInfoNCE, Points())
    assert "a loss that couples the samples of a batch (in-batch negatives, contrastive losses" in str(
        err.value
    )


def test_random_masking_in_the_step_is_refused_in_one_line():
    with pytest.raises(LossWeightingError) as err:
        _split_fit(MaskingInStep, Tokens())
    message = str(err.value)
    assert "\n" not in message
    assert "tokens your training_step selects at random" in message
    assert "no count taken from the batch can match it" in message
    assert "Mask in the collate function" in message and 'loss_reduction="mean"' in message


def test_random_masking_with_loss_reduction_mean_trains_unchecked():
    run, oom = _split_fit(MaskingInStep, Tokens(), OOMRecovery(verbose=False, loss_reduction="mean"))
    assert run.trainer.global_step == 4 and oom.k >= 2
    (message,) = _weighting(run.trainer)
    assert message == (
        "loss weighting: sample shares (given) — not checked: the loss averages over tokens the step selects at random"
    )


def test_noise_seeded_per_sample_from_the_data_matches_the_unsplit_run():
    make = lambda: FlowMatching("mean", seeded=True)  # noqa: E731
    ref = train(make(), Points(), simulate=False, precision="64-true")
    run, oom = _split_fit(make, Points(), precision="64-true")
    assert oom.k >= 2 and run.trainer.global_step == ref.trainer.global_step == 4
    assert oom.loss_weighting.decided.kind is Weighting.SAMPLES
    assert training_distance(ref.theta0, run.theta, ref.theta) <= 1e-9


# ----------------------------------------------------------------------------- what cannot be replayed


class PythonNoise(FlowMatching):
    def training_step(self, batch, batch_idx):
        _, x1 = batch
        scale = random.uniform(0.5, 1.5)
        return (self.net(torch.cat([x1 * scale, x1[:, :1]], 1)) - x1).square().mean()


class NumpyNoise(FlowMatching):
    def training_step(self, batch, batch_idx):
        _, x1 = batch
        scale = float(np.random.uniform(0.5, 1.5))
        return (self.net(torch.cat([x1 * scale, x1[:, :1]], 1)) - x1).square().mean()


class PoolNoise(FlowMatching):
    """A random shape that is not batch-major: a pool of noise vectors the size of the batch plus one."""

    def training_step(self, batch, batch_idx):
        _, x1 = batch
        pool = torch.randn(len(x1) + 1, x1.shape[1])
        return (self.net(torch.cat([x1 + pool[1:], x1[:, :1]], 1)) - x1).square().mean()


class LoopNoise(FlowMatching):
    """Noise drawn one sample at a time from torch's global generator."""

    def training_step(self, batch, batch_idx):
        _, x1 = batch
        noise = torch.stack([torch.randn(x1.shape[1]) for _ in range(len(x1))])
        return (self.net(torch.cat([x1 + noise, x1[:, :1]], 1)) - x1).square().mean()


@pytest.mark.parametrize(
    ("make", "source"),
    [
        (PythonNoise, r"it draws from Python's `random` module"),
        (NumpyNoise, r"it draws from NumPy's global random state \(`np.random`\)"),
        (
            PoolNoise,
            r"torch's randn drew a tensor of shape \(\d+, 6\) on a piece of \d+ samples and \(\d+, 6\) .*not batch-major",
        ),
        (
            LoopNoise,
            r"torch's random operators ran as randn x\d+ on a piece of \d+ samples, .*a loop over samples",
        ),
    ],
    ids=["python", "numpy", "shape", "loop"],
)
def test_randomness_the_check_cannot_replay_is_refused_in_one_line_naming_it(make, source):
    with pytest.raises(LossWeightingError, match=r"cannot replay on the parts of a batch \(" + source) as err:
        _split_fit(make, Points())
    message = str(err.value)
    assert "\n" not in message and "OOMRecovery(loss_reduction=...)" in message


def test_with_loss_reduction_given_an_unreplayable_step_trains_and_says_it_was_not_checked():
    state = random.getstate()
    run, oom = _split_fit(PythonNoise, Points(), OOMRecovery(verbose=False, loss_reduction="mean"))
    assert run.trainer.global_step == 4 and oom.k >= 2
    (message,) = _weighting(run.trainer)
    assert message.startswith(
        "loss weighting: sample shares (given) — not checked: the step's random numbers"
    )
    assert "Python's `random` module" in message
    random.setstate(state)


class SkipsFirstBatch(FlowMatching):
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 0 else super().training_step(batch, batch_idx)


def test_a_piece_that_returns_none_leaves_the_decision_to_the_next_split():
    oom = OOMRecovery(verbose=False)
    oom.load_state_dict({"k": 2})  # split from the first batch
    run = train(SkipsFirstBatch(), Points(), [oom], simulate=False, steps=3)
    (decision,) = [d for d in decisions(run.trainer) if d.kind == "loss weighting"]
    assert decision.step == 1 and oom.loss_weighting.decided.kind is Weighting.SAMPLES
    assert run.trainer.global_step == 3


def test_under_torch_compile_the_replay_leaves_the_compiled_frames_alone():
    """The check runs eagerly (``set_stance("force_eager")``): its record and replay modes compile nothing, so
    a run with the check compiles exactly the frames of a run without it."""

    def fit(check: bool) -> tuple[int, Weighting]:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = FlowMatching("mean")
        model.net = torch.compile(model.net, backend="aot_eager")
        oom = OOMRecovery(verbose=False)
        oom.load_state_dict({"k": 2})
        oom.loss_weighting.check = check
        run = train(model, Points(), [oom], simulate=False, steps=3)
        assert run.trainer.global_step == 3
        return torch._dynamo.utils.counters["frames"]["ok"], oom.loss_weighting.decided

    frames, decided = fit(check=True)
    assert decided.kind is Weighting.SAMPLES
    assert frames >= 1 and fit(check=False)[0] == frames


# ----------------------------------------------------------------------------- the replay itself


def test_which_operators_are_replayed():
    x = torch.ones(4, 3)
    assert draws_random(torch.ops.aten.randn_like.default, (x,), {})
    assert draws_random(torch.ops.aten.randint.low, (0, 5, [4]), {})
    generator = torch.Generator().manual_seed(0)
    assert not draws_random(torch.ops.aten.randn.generator, ([4],), {"generator": generator})
    assert not draws_random(torch.ops.aten.native_dropout.default, (x, 0.5, False), {})
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not draws_random(flash, (x, x, x), {})  # dropout_p defaults to 0
    assert not draws_random(torch.ops.aten.add.Tensor, (x, x), {})


def test_rows_of_the_piece_by_the_dimension_that_counts_its_samples():
    recorded = torch.arange(2 * 4 * 3.0).view(2, 4, 3)  # (time, batch, features)
    assert torch.equal(rows_for(recorded, torch.Size([2, 1, 3]), 4, 1, 2), recorded[:, 1:2])
    assert torch.equal(rows_for(recorded, torch.Size([2, 4, 3]), 4, 1, 2), recorded)  # the same shape: whole
    assert rows_for(recorded, torch.Size([2, 2, 2]), 4, 1, 3) is None  # two dimensions differ
    assert rows_for(torch.zeros(5), torch.Size([2]), 4, 1, 3) is None  # 5 values are not 4 samples' share


def test_a_step_without_random_draws_runs_its_parts_without_any_mode():
    draws = RandomDraws(4)
    with draws.record():
        torch.ones(4).sum()
    assert not draws.drew and draws.host is None
    with draws.replay(0, 2):
        assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_an_aten_calls_arguments_by_name_with_their_defaults():
    named = op_arguments(torch.ops.aten.randn.generator, ([2],), {"generator": None})
    assert named["size"] == [2] and named["generator"] is None and "dtype" in named
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert op_arguments(attention, (1, 2, 3), {})["dropout_p"] == 0.0


class Mixup(Wide):
    """Mixup inside the step: each sample mixed with another of the batch, chosen by a random permutation."""

    def training_step(self, batch, batch_idx):
        ids, x1 = batch
        mixed = 0.7 * x1 + 0.3 * x1[torch.randperm(len(x1), device=x1.device)]
        return (self.net(torch.cat([mixed, ids[:, None].to(x1.dtype)], 1)) - mixed).square().mean()


def test_a_step_that_fails_on_a_part_with_the_replayed_draws_is_refused_naming_the_coupling():
    """The permutation drawn for two samples indexes past a one-sample part: the step's IndexError is not the
    user's bug, it is how mixup couples the samples."""
    with pytest.raises(LossWeightingError) as err:
        _split_fit(Mixup, Points())
    message = str(err.value)
    assert "\n" not in message
    assert re.search(
        r"with the piece's random values replayed on a part, it raised IndexError: index 1 is out of bounds .*"
        r"\(random indices into the batch, such as a permutation for mixup, couple its samples\)",
        message,
    ), message


class NeedsTwo(FlowMatching):
    """A step that draws nothing and refuses a single sample, as a layer that needs batch statistics would."""

    def training_step(self, batch, batch_idx):
        _, x1 = batch
        if len(x1) < 2:
            raise ValueError("this step needs two samples or more")
        return (self.net(torch.cat([x1, x1[:, :1]], 1)) - x1).square().mean()


def test_a_step_that_cannot_run_on_one_sample_is_told_the_check_did_and_what_to_give():
    """The check runs the step on single samples; a step that refuses one, without drawing anything, gets one
    line saying so (not a replay refusal, not "the model cannot run micro-batches this small"), and trains
    with the weighting given."""
    with pytest.raises(LossWeightingError) as err:
        _split_fit(NeedsTwo, Points())
    message = str(err.value)
    assert message.startswith(
        "loss weighting: the check runs your training_step on one sample of the batch at a time, and it raised "
        "ValueError: this step needs two samples or more; "
    )
    assert "OOMRecovery(loss_reduction=...)" in message and "\n" not in message
    run, oom = _split_fit(NeedsTwo, Points(), OOMRecovery(verbose=False, loss_reduction="mean"))
    assert run.trainer.global_step == 4 and oom.k >= 2
    (line,) = _weighting(run.trainer)
    assert line.startswith(
        "loss weighting: sample shares (given) — not checked: the step cannot run on one sample"
    )
