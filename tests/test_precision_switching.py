"""PrecisionSwitch's decisions without a Trainer: the choice, the FSDP2 policy, switching down and up, the record."""

import pytest

from lightning_gpuopt.precision import LADDER, DeviceInfo, StabilityWatch
from lightning_gpuopt.precision_switching import (
    PrecisionChange,
    PrecisionSwitchOptions,
    SwitchRecord,
    check_ladder_runs,
    fallback_note,
    fallbacks,
    fsdp2_policy_plan,
    initial_precision,
    switch_verdict,
)

A100 = DeviceInfo("cuda", "A100", (8, 0), bf16=True)
V100 = DeviceInfo("cuda", "V100", (7, 0))


@pytest.mark.parametrize(
    ("initial", "info", "expected", "why"),
    [
        ("keep", V100, "32-true", "initial='keep' on V100 (sm_70)"),
        ("auto", A100, "bf16-mixed", "auto: "),
        ("16-mixed", A100, "16-mixed", "initial='16-mixed' on A100 (sm_80)"),
    ],
    ids=["keep", "auto", "named"],
)
def test_the_initial_precision_and_why(initial, info, expected, why):
    target, reason = initial_precision(initial, "32-true", info, cpu_bf16=False, fp8=False)
    assert target == expected and reason.startswith(why)


def test_a_precision_the_device_cannot_run_is_refused_naming_what_to_do():
    with pytest.raises(
        ValueError, match=r"`initial='bf16-mixed'`: this device cannot run it .*initial='auto'"
    ):
        initial_precision("bf16-mixed", "32-true", V100, cpu_bf16=False, fp8=False)
    with pytest.raises(ValueError, match=r"Leave it out \(ladder=\('16-mixed', '32-true'\)\)"):
        check_ladder_runs(LADDER, V100)


def test_fsdp2_runs_bf16_as_its_policy_unless_told_otherwise():
    plan = fsdp2_policy_plan("bf16-mixed", None, None, use_policy=True)
    assert plan.policy is not None and "fixed once the model is sharded" in plan.fixed
    assert fsdp2_policy_plan("bf16-mixed", None, None, use_policy=False).policy is None
    own = fsdp2_policy_plan("bf16-mixed", "theirs", None, use_policy=True)
    assert own.policy is None and "own mp_policy (theirs)" in own.fixed
    mine = fsdp2_policy_plan("bf16-mixed", None, "MyModel", use_policy=True)
    assert mine.policy is None and mine.fixed is None and mine.note.startswith("MyModel shards itself")
    assert fsdp2_policy_plan("32-true", None, None, use_policy=True) == type(plan)()


def test_switching_down_follows_the_ladder_and_ends_in_an_error_that_says_why():
    record = SwitchRecord(retry_after=10, precision="16-mixed", start="16-mixed")
    rungs = fallbacks("16-mixed", LADDER, A100, None)
    assert record.down_target("non-finite loss", rungs, LADDER, None) == "bf16-mixed"
    assert fallbacks("16-mixed", LADDER, A100, "a fixed policy") == ()  # FSDP2's policy: no fallback
    record.precision = "32-true"
    with pytest.raises(
        FloatingPointError, match=r"no more stable precision is left .*not a precision problem"
    ):
        record.down_target("non-finite loss", (), LADDER, None)
    with pytest.raises(FloatingPointError, match="no precision to fall back to: a fixed policy"):
        record.down_target("non-finite loss", (), LADDER, "a fixed policy")


def test_a_faster_precision_is_tried_again_after_its_wait_which_doubles_when_it_fails_again():
    record = SwitchRecord(retry_after=10, precision="16-mixed", start="16-mixed")
    record.switched(5, "bf16-mixed", "non-finite loss")
    assert record.retry_target(14, LADDER, A100) is None
    assert record.retry_target(15, LADDER, A100) == "16-mixed"
    record.switched(15, "16-mixed", "trying again")
    record.down_target("non-finite loss", ("bf16-mixed", "32-true"), LADDER, None)
    assert record.retry_interval == 20
    assert record.switches[0] == PrecisionChange(5, "16-mixed", "bf16-mixed", "non-finite loss")


def test_the_record_round_trips_as_plain_values():
    record = SwitchRecord(retry_after=10, precision="16-mixed", start="16-mixed", skipped_steps=3)
    record.switched(5, "bf16-mixed", "non-finite loss")
    again = SwitchRecord(retry_after=10)
    again.load_state_dict(record.state_dict())
    assert again == record
    assert "fit ended in bf16-mixed after 1 switch;" in again.summary()
    assert SwitchRecord().summary() is None


def test_an_attempt_switches_only_when_a_flag_is_bad_and_the_watch_agrees():
    watch = StabilityWatch(patience=1, min_scale=1.0)
    assert switch_verdict(watch, scaler=False, loss_bad=False, grads_bad=False, backoff=None) is None
    assert switch_verdict(watch, scaler=False, loss_bad=True, grads_bad=True, backoff=None) is not None


def test_the_setup_line_says_what_happens_on_persistent_non_finite_values():
    assert fallback_note(None, None, "16-mixed", ("32-true",)) == (
        "falls back to 32-true on persistent non-finite values"
    )
    assert fallback_note("LBFGS", None, "16-mixed", ()) == "no runtime fallback: LBFGS"
    assert "held back" in fallback_note(None, None, "32-true", ())


def test_options_are_checked_once_and_the_ladder_normalised():
    assert PrecisionSwitchOptions().ladder == LADDER
    assert PrecisionSwitchOptions(ladder=["16-mixed", "32-true"]).ladder == ("16-mixed", "32-true")
    with pytest.raises(TypeError, match="`rerun` must be a bool, got int"):
        PrecisionSwitchOptions(rerun=1)
