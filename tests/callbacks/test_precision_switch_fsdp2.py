"""PrecisionSwitch under FSDP2 (the pack's FSDP2Strategy): the setup-time MixedPrecisionPolicy and the runtime fallback.

The two-process runs are scripts (``fsdp2_precision_run.py``, gloo on CPU; Lightning's launcher starts rank 1 by
running it again). CPU has no native bfloat16, so every run forces ``initial="bf16-mixed"``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from lightning_gpuopt import FSDP2Strategy, PrecisionSwitch
from lightning_gpuopt.microbatch import unsupported_strategy
from lightning_gpuopt.precision import fsdp2_mixed_precision
from lightning_gpuopt.support import Feature
from tests.callbacks.oom_models import Waves
from tests.callbacks.precision_models import AppliedSteps, Troubled, finite
from tests.helpers import TRAINER_QUIET, run_ranks

SCRIPT = Path(__file__).with_name("fsdp2_precision_run.py")
STEPS, TROUBLE_STEP, UNITS = 8, 3, 3
ENGINE_MISSING = unsupported_strategy(FSDP2Strategy(), Feature.OOM_RECOVERY)


def fsdp2_fit(out: Path, mode: str) -> list[dict]:
    return run_ranks(SCRIPT, out, mode, timeout=300)


# ----------------------------------------------------------------------------- the setup-time choice, no processes


class _Trainer:
    """Enough Trainer for PrecisionSwitch.setup: the strategy and its precision."""

    def __init__(self, strategy):
        self.strategy, self.callbacks = strategy, []

    @property
    def precision(self):
        return self.strategy.precision_plugin.precision


class _ShardsItself(BoringModel):
    def configure_model(self):
        pass


def _strategy() -> FSDP2Strategy:
    strategy = FSDP2Strategy()
    strategy.parallel_devices = [torch.device("cpu")]
    return strategy


@pytest.fixture
def setup(caplog):
    """Run PrecisionSwitch.setup under a fresh FSDP2Strategy (or ``strategy``); returns it and what was said."""

    def run(switch: PrecisionSwitch, module=None, strategy=None) -> tuple[FSDP2Strategy, str]:
        strategy = strategy or _strategy()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            switch.setup(_Trainer(strategy), module or BoringModel(), "fit")
        return strategy, " ".join(r.getMessage() for r in caplog.records)

    return run


def test_bf16_under_fsdp2strategy_becomes_fsdp2s_mixed_precision_policy(setup):
    strategy, said = setup(PrecisionSwitch(initial="bf16-mixed"))
    policy = strategy.mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert strategy.precision_plugin.precision == "bf16-mixed"
    assert "FSDP2 MixedPrecisionPolicy: bfloat16 parameters all-gathered, float32 reductions" in said
    assert "no runtime fallback: FSDP2's MixedPrecisionPolicy is fixed once the model is sharded" in said


@pytest.mark.parametrize(
    ("switch", "module", "expected"),
    [
        (
            PrecisionSwitch(initial="bf16-mixed", fsdp2_policy=False),
            None,
            "bfloat16 autocast over float32 sharded parameters (fsdp2_policy=False)",
        ),
        (PrecisionSwitch(initial="32-true"), None, "precision 32-true (initial='32-true'"),
        (
            PrecisionSwitch(initial="bf16-mixed"),
            _ShardsItself(),
            "_ShardsItself shards itself in configure_model",
        ),
    ],
    ids=("fsdp2_policy-False", "fp32", "module-shards-itself"),
)
def test_no_policy_where_the_run_keeps_float32_parameters(setup, switch, module, expected):
    strategy, said = setup(switch, module)
    assert strategy.mp_policy is None
    assert expected in said
    if switch.initial == "bf16-mixed":  # autocast over float32 parameters: the runtime fallback stays
        assert "falls back to 32-true on persistent non-finite values" in said


def test_a_policy_the_user_gave_is_kept_and_fixes_the_precision(setup):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    own = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    strategy = _strategy()
    strategy.mp_policy = own
    strategy, said = setup(PrecisionSwitch(initial="bf16-mixed"), strategy=strategy)
    assert strategy.mp_policy is own
    assert "the strategy's own mp_policy kept" in said and "no runtime fallback" in said


def test_fsdp2_policy_must_be_a_bool():
    with pytest.raises(TypeError, match="`fsdp2_policy` must be a bool, got str"):
        PrecisionSwitch(fsdp2_policy="yes")


def test_a_policy_for_a_module_that_shards_itself_is_refused():
    strategy = FSDP2Strategy(mp_policy=fsdp2_mixed_precision("bf16-mixed"))
    strategy._lightning_module = _ShardsItself()
    with pytest.raises(ValueError, match="Pass `mp_policy=` to your own `fully_shard` calls there"):
        strategy.setup(None)


@pytest.fixture
def one_rank_group():
    """An in-process FSDP2 fit initialises a one-rank gloo group and sets Lightning's launch variables (LOCAL_RANK
    would tell a later test's launcher that its processes already exist) and the thread count: undo all three."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


def test_under_the_policy_persistent_nonfinite_steps_raise_naming_the_fallback(one_rank_group):
    switch, hook = PrecisionSwitch(initial="bf16-mixed", verbose=False), AppliedSteps()
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(),
        max_steps=6,
        callbacks=[switch, hook],
        **{k: v for k, v in TRAINER_QUIET.items() if k != "devices"},
    )
    model = Troubled(overflow=(2, None), bad_in="always")
    with pytest.raises(
        FloatingPointError,
        match=r"no precision to fall back to: FSDP2's MixedPrecisionPolicy.*fsdp2_policy=False",
    ):
        trainer.fit(model, DataLoader(Waves(length=512), batch_size=16))
    assert hook.steps() == [0, 1] and hook.nonfinite_applied == 0 and finite(model)
    assert switch.nonfinite_steps == 2 and switch.switches == [] and switch.precision == "bf16-mixed"


# ----------------------------------------------------------------------------- two FSDP2 ranks


@pytest.mark.slow
def test_policy_gathers_bf16_reduces_fp32_and_both_ranks_hold_back_a_step_only_one_saw(tmp_path):
    """Rank 1's loss is infinite at step 3, its gradients finite: rank 0 sees nothing wrong locally."""
    ranks = fsdp2_fit(tmp_path / "policy", "policy")
    for rank in ranks:
        # What FSDP handed to the collectives, each unit gathered in the forward and again in the backward.
        assert Counter(rank["collectives"]) == {
            ("all_gather", "bfloat16", "bfloat16"): 2 * UNITS * STEPS,
            ("reduce_scatter", "float32", "float32"): UNITS * STEPS,
        }
        assert {dtype for *_, dtype in rank["calls"]} == {"bfloat16"}  # the forward computed in bfloat16
        assert rank["sharded_dtypes"] == ["torch.float32"]  # the optimizer steps float32 shards
        assert rank["applied"] == [s for s in range(STEPS) if s != TROUBLE_STEP]
        assert rank["nonfinite_applied"] == 0
        assert rank["state"]["nonfinite_steps"] == 1 and rank["state"]["switches"] == []
        # no switch; the held-back step is a decision on both ranks, naming the step and what was non-finite
        assert rank["precision"] == "bf16-mixed" and rank["decisions"] == [
            ("held back", TROUBLE_STEP, "loss")
        ]
        assert all(bool(torch.isfinite(p).all()) for p in rank["params"].values())


@pytest.fixture(scope="module")
def lightnings_own_swap(tmp_path_factory) -> list[dict]:
    """No trouble; Lightning's plugin swapped bf16-mixed → 32-true at the start of step 3 by a plain callback."""
    return fsdp2_fit(tmp_path_factory.mktemp("fsdp2-precision") / "reference", "reference")


@pytest.mark.slow
@pytest.mark.skipif(
    ENGINE_MISSING is not None, reason=f"running the batch again needs the engine: {ENGINE_MISSING}"
)
def test_autocast_fallback_switches_both_ranks_and_runs_the_batch_again(tmp_path, lightnings_own_swap):
    """``fsdp2_policy=False``: rank 1's loss and gradients are NaN at step 3 while bfloat16 autocast is on."""
    ranks = fsdp2_fit(tmp_path / "switch", "switch")
    for rank in ranks:
        assert [s[:3] for s in rank["state"]["switches"]] == [[TROUBLE_STEP, "bf16-mixed", "32-true"]]
        assert rank["decisions"] == [("precision", "bf16-mixed", "32-true")]
        assert rank["precision"] == "32-true" and rank["state"]["rerun_batches"] == 1
        # The batch of step 3 ran in bfloat16, then again in float32, and was applied once, finite.
        assert [c[:3] for c in rank["calls"] if c[0] == TROUBLE_STEP] == [
            (3, 3, "bf16-mixed"),
            (3, 3, "32-true"),
        ]
        assert rank["applied"] == list(range(STEPS)) and rank["nonfinite_applied"] == 0
        # float32 sharded parameters under autocast: float32 all-gathers (the retried batch's included).
        assert Counter(rank["collectives"]) == {
            ("all_gather", "float32", "float32"): 2 * UNITS * (STEPS + 1),
            ("reduce_scatter", "float32", "float32"): UNITS * (STEPS + 1),
        }
    # Each rank steps its own shard; the full parameters gathered from both equal the reference only when both
    # ranks applied the same updates, and the failed attempt left no trace (observed: bitwise equal).
    for name, want in lightnings_own_swap[0]["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], want, rtol=1e-6, atol=1e-7)
