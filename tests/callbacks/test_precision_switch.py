from __future__ import annotations

import doctest
import logging
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LambdaCallback
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader

import lightning_gpuopt.callbacks.precision_switch as precision_switch_module
from lightning_gpuopt import OOMRecovery, PrecisionSwitch
from lightning_gpuopt.microbatch import MicroBatchEngine
from lightning_gpuopt.precision import PRECISION_INDEX, DeviceInfo, fp8_available
from tests.callbacks.oom_models import StepLog, Waves
from tests.callbacks.precision_models import AppliedSteps, Troubled, finite
from tests.helpers import TRAINER_QUIET, MetricsLogger, run_ranks

BATCH = 32
NEVER = (10**9, None)  # an overflow window that never opens


def fit(model, switch, steps=12, accumulate=1, fp16=True, callbacks=(), ckpt_path=None, **trainer_kwargs):
    """A seeded CPU fit; ``fp16``: real float16 autocast with a GradScaler (Lightning's 16-mixed turns into bf16 on CPU)."""
    pl.seed_everything(0, verbose=False)
    hook = AppliedSteps()
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        precision=None,
        plugins=[MixedPrecision("16-mixed", "cpu")] if fp16 else [],
        callbacks=[c for c in (switch, hook, *callbacks) if c is not None],
        **{**TRAINER_QUIET, **trainer_kwargs},
    )
    trainer.fit(model, DataLoader(Waves(length=1024), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, hook


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("PrecisionSwitch:")]


def changes(switch: PrecisionSwitch) -> list[tuple[int, str, str]]:
    return [(c.step, c.before, c.after) for c in switch.switches]


def ids_of_steps(steps) -> list[int]:
    return [i for step in steps for i in range(step * BATCH, (step + 1) * BATCH)]


@pytest.fixture
def on_device(monkeypatch):
    """Pretend the Trainer's device is ``info`` (the CPU still computes: real float16/bfloat16 autocast)."""

    def use(info: DeviceInfo) -> None:
        monkeypatch.setattr(precision_switch_module, "device_info", lambda device: info)

    return use


V100 = DeviceInfo("cuda", "Tesla V100", (7, 0), bf16=False)
A100 = DeviceInfo("cuda", "A100", (8, 0), bf16=True)
K80 = DeviceInfo("cuda", "Tesla K80", (3, 7), bf16=False)


def test_docstring_example_runs():
    result = doctest.testmod(precision_switch_module)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- acceptance: fp16 on CPU


def test_fp16_overflow_switches_down_and_the_batch_that_triggered_it_runs_again(caplog):
    model = Troubled(overflow=(5, None))
    switch, log = PrecisionSwitch(initial="keep"), StepLog()
    with caplog.at_level(logging.INFO):
        trainer, hook = fit(model, switch, callbacks=[log])

    assert model.calls[0][2:4] == ("16-mixed", "float16")  # real float16 autocast with a GradScaler
    # Step 5 overflows: the GradScaler skips it. Step 6 overflows again: the second non-finite loss in a row is
    # seen before the step (the watch is armed), so batch 6 runs again in bf16-mixed and is applied.
    assert changes(switch) == [(6, "16-mixed", "bf16-mixed")]
    assert trainer.precision == switch.precision == "bf16-mixed"
    assert [c[3] for c in model.calls if c[1] == 6] == ["float16", "bfloat16"]
    assert hook.nonfinite_applied == 0 and finite(model)
    assert hook.steps() == [0, 1, 2, 3, 4, *range(6, 12)]
    after = [ids for step, ids in hook.applied if step >= 6]
    assert [i for ids in after for i in ids] == ids_of_steps(
        range(6, 12)
    )  # every batch after the switch, once
    assert (switch.skipped_steps, switch.nonfinite_steps, switch.rerun_batches) == (1, 0, 1)
    assert trainer.global_step == 12 and log.steps == [(i, i + 1) for i in range(12)]
    assert torch.isfinite(torch.tensor(log.losses[6:])).all()  # the failed attempt's log is gone
    said = lines(caplog)
    assert said[0] == (
        "PrecisionSwitch: precision 16-mixed (initial='keep' on CPU); falls back to bf16-mixed → "
        "32-true on persistent non-finite values"
    )
    assert said[1] == (
        "PrecisionSwitch: precision 16-mixed → bf16-mixed at step 6: the loss was not finite in 2 "
        "steps in a row; batch 6 runs again in bf16-mixed"
    )
    assert said[2].startswith(
        "PrecisionSwitch: fit ended in bf16-mixed after 1 switch; 1 optimizer step(s) not applied"
    )


def test_with_accumulation_the_window_is_dropped_and_reported(caplog):
    model = Troubled(overflow=(3, None))  # the windows of steps 3 and 4 overflow
    switch = PrecisionSwitch(initial="keep")
    with caplog.at_level(logging.INFO):
        _, hook = fit(model, switch, steps=8, accumulate=2)
    assert changes(switch) == [(5, "16-mixed", "bf16-mixed")]  # at the next window boundary
    assert hook.nonfinite_applied == 0 and finite(model)
    assert hook.steps() == [0, 1, 2, 5, 6, 7]
    assert [i for step, ids in hook.applied if step >= 5 for i in ids] == ids_of_steps(range(10, 16))
    assert (switch.skipped_steps, switch.rerun_batches) == (2, 0)
    assert {c[1] for c in model.calls if c[2] == "bf16-mixed"} == set(range(10, 16))
    assert (
        "the window of step 4 (2 batches) was not applied (2 step(s) not applied in this fit)"
        in lines(caplog)[1]
    )


def test_rerun_false_drops_the_batch_and_leaves_the_engine_alone():
    engines = []
    probe = LambdaCallback(
        on_train_batch_start=lambda trainer, *args: engines.append(MicroBatchEngine.get(trainer))
    )
    model = Troubled(overflow=(5, None))
    switch = PrecisionSwitch(initial="keep", rerun=False)
    _, hook = fit(model, switch, callbacks=[probe])
    assert set(engines) == {None}
    assert changes(switch) == [(7, "16-mixed", "bf16-mixed")]  # decided after step 6 was skipped
    assert hook.steps() == [0, 1, 2, 3, 4, *range(7, 12)]
    assert (switch.skipped_steps, switch.rerun_batches) == (2, 0)


def test_the_engine_is_attached_for_a_rerun_and_released():
    engines = []
    probe = LambdaCallback(
        on_train_batch_start=lambda trainer, *args: engines.append(MicroBatchEngine.get(trainer))
    )
    trainer, _ = fit(Troubled(overflow=NEVER), PrecisionSwitch(initial="keep"), steps=2, callbacks=[probe])
    assert all(e is not None for e in engines)
    assert MicroBatchEngine.get(trainer) is None
    assert "step" not in vars(trainer.optimizers[0])  # the optimizer's own step again


def test_with_oom_recovery_the_engine_is_shared():
    model = Troubled(overflow=(5, None))
    switch, oom = PrecisionSwitch(initial="keep"), OOMRecovery()
    _, hook = fit(model, switch, callbacks=[oom])
    assert changes(switch) == [(6, "16-mixed", "bf16-mixed")] and switch.rerun_batches == 1
    assert hook.nonfinite_applied == 0 and oom.k == 1


def test_an_optimizer_that_unscales_in_its_own_step_is_watched_too():
    class Fused(Troubled):
        def configure_optimizers(self):
            return torch.optim.Adam(
                self.parameters(), lr=1e-3, fused=True
            )  # GradScaler passes found_inf to it

    model = Fused(overflow=(5, None))
    switch = PrecisionSwitch(initial="keep")
    fit(model, switch)
    assert changes(switch) == [(6, "16-mixed", "bf16-mixed")] and finite(model)
    assert switch.skipped_steps == 1 and switch.rerun_batches == 1


# ----------------------------------------------------------------------------- bf16 and fp32: held back


def test_bf16_trouble_falls_back_to_fp32_and_no_nonfinite_step_is_applied(caplog):
    model = Troubled(overflow=(4, None), bad_in="bf16")
    switch = PrecisionSwitch(initial="bf16-mixed")  # the Trainer says 32-true; the callback's choice wins
    with caplog.at_level(logging.INFO):
        _, hook = fit(model, switch, fp16=False)
    assert model.calls[0][2:4] == ("bf16-mixed", "bfloat16")
    assert changes(switch) == [(5, "bf16-mixed", "32-true")]
    assert hook.steps() == [0, 1, 2, 3, *range(5, 12)] and hook.nonfinite_applied == 0 and finite(model)
    assert (switch.skipped_steps, switch.nonfinite_steps, switch.rerun_batches) == (1, 1, 1)
    said = lines(caplog)
    assert said[0].startswith("PrecisionSwitch: precision 32-true → bf16-mixed (initial='bf16-mixed' on CPU)")
    assert "step 4 not applied: non-finite loss in bf16-mixed (1 in a row; patience 2)" in said[1]
    assert "bf16-mixed → 32-true at step 5" in said[2]


def test_an_isolated_nonfinite_step_in_fp32_is_held_back():
    model = Troubled(overflow=(4, 5), bad_in="always")
    switch = PrecisionSwitch()  # CPU: 32-true, nothing to fall back to, and no engine needed
    trainer, hook = fit(model, switch, fp16=False)
    assert trainer.precision == "32-true" and switch.switches == []
    assert hook.steps() == [0, 1, 2, 3, *range(5, 12)] and hook.nonfinite_applied == 0 and finite(model)
    assert (switch.skipped_steps, switch.nonfinite_steps) == (1, 1)


def test_in_64_true_a_finite_run_trains_and_a_nonfinite_step_is_held_back():
    """float64 gradients: their norms are taken in float64 (a float32 norm would narrow them and fail)."""
    pl.seed_everything(0, verbose=False)
    model, switch, hook = (
        Troubled(overflow=(4, 5), bad_in="always"),
        PrecisionSwitch(initial="keep"),
        AppliedSteps(),
    )
    trainer = pl.Trainer(max_steps=12, precision="64-true", callbacks=[switch, hook], **TRAINER_QUIET)
    trainer.fit(model, DataLoader(Waves(length=1024), batch_size=BATCH))
    assert trainer.precision == "64-true" and switch.switches == []
    assert hook.steps() == [0, 1, 2, 3, *range(5, 12)] and hook.nonfinite_applied == 0 and finite(model)
    assert next(model.parameters()).dtype == torch.float64


def test_persistent_nonfinite_steps_with_no_rung_left_raise():
    model = Troubled(overflow=(4, None), bad_in="always")
    with pytest.raises(
        FloatingPointError, match=r"not finite in 2 steps in a row in 32-true, and no more stable precision"
    ):
        fit(model, PrecisionSwitch(), fp16=False)
    assert finite(model)


# ----------------------------------------------------------------------------- every option counts


def test_gradscaler_calibration_is_not_trouble_but_min_scale_is():
    # Gradients that overflow float16 at the GradScaler's first scales, with a finite loss: it backs off.
    calm = PrecisionSwitch(initial="keep")
    _, hook = fit(Troubled(overflow=NEVER, grad_boost=1e4, lr=1e-6), calm, steps=14)
    assert calm.switches == [] and calm.skipped_steps >= 4 and hook.nonfinite_applied == 0
    strict = PrecisionSwitch(initial="keep", min_scale=4096.0)
    _, hook = fit(Troubled(overflow=NEVER, grad_boost=1e4, lr=1e-6), strict, steps=14)
    (change,) = strict.switches
    assert (change.before, change.after) == ("16-mixed", "bf16-mixed")
    assert change.reason.startswith("the loss scale fell to 2048, below min_scale=4096")
    assert strict.rerun_batches == 1 and hook.nonfinite_applied == 0


def test_patience():
    switch = PrecisionSwitch(initial="keep", patience=3)
    _, hook = fit(Troubled(overflow=(5, None)), switch)
    assert changes(switch) == [(7, "16-mixed", "bf16-mixed")] and hook.steps() == [
        0,
        1,
        2,
        3,
        4,
        *range(7, 12),
    ]


def test_a_custom_ladder_skips_bf16():
    switch = PrecisionSwitch(initial="keep", ladder=("16-mixed", "32-true"))
    fit(Troubled(overflow=(5, None)), switch)
    assert changes(switch) == [(6, "16-mixed", "32-true")]


def test_retry_after_tries_the_faster_precision_again(caplog):
    switch = PrecisionSwitch(initial="keep", retry_after=3)
    with caplog.at_level(logging.INFO):
        _, hook = fit(Troubled(overflow=(5, 7)), switch)
    assert changes(switch) == [(6, "16-mixed", "bf16-mixed"), (9, "bf16-mixed", "16-mixed")]  # after 6, 7, 8
    assert "trying the faster precision again after 3 stable steps" in lines(caplog)[2]
    assert hook.steps() == [0, 1, 2, 3, 4, *range(6, 12)]


def test_a_relapse_doubles_the_wait_before_the_next_retry():
    switch = PrecisionSwitch(initial="keep", retry_after=2)
    _, hook = fit(Troubled(overflow=(5, None)), switch)
    # down at 6, up at 8 (a fresh GradScaler), step 8 skipped, down again at 9 with batch 9 run again
    assert changes(switch) == [
        (6, "16-mixed", "bf16-mixed"),
        (8, "bf16-mixed", "16-mixed"),
        (9, "16-mixed", "bf16-mixed"),
    ]
    assert switch.state_dict()["retry_interval"] == 4
    assert hook.nonfinite_applied == 0


def test_verbose_false_says_nothing(caplog):
    with caplog.at_level(logging.INFO):
        fit(Troubled(overflow=(5, None)), PrecisionSwitch(initial="keep", verbose=False))
    assert lines(caplog) == []


def test_the_logger_gets_the_precision_index():
    logger = MetricsLogger()
    fit(Troubled(overflow=(5, None)), PrecisionSwitch(initial="keep"), logger=logger)
    logged = [(step, m["gpuopt/precision_index"]) for step, m in logger.rows if "gpuopt/precision_index" in m]
    assert logged == [(0, PRECISION_INDEX["16-mixed"]), (7, PRECISION_INDEX["bf16-mixed"])]


# ----------------------------------------------------------------------------- resume


def test_resume_after_a_switch_continues_in_the_switched_precision(tmp_path, caplog):
    first = PrecisionSwitch(initial="keep")
    trainer, _ = fit(Troubled(overflow=(5, None)), first, steps=8)
    assert first.precision == "bf16-mixed"
    trainer.save_checkpoint(tmp_path / "switched.ckpt")

    model, second = Troubled(overflow=(5, None)), PrecisionSwitch(initial="keep")
    with caplog.at_level(logging.INFO):
        trainer, hook = fit(model, second, ckpt_path=str(tmp_path / "switched.ckpt"))
    assert [c[2:4] for c in model.calls] == [
        ("bf16-mixed", "bfloat16")
    ] * 4  # steps 8-11, and no fp16 attempt
    assert hook.steps() == [8, 9, 10, 11] and trainer.global_step == 12
    assert changes(second) == [(6, "16-mixed", "bf16-mixed")] and second.skipped_steps == 1
    assert "PrecisionSwitch: precision 16-mixed → bf16-mixed (restored from the checkpoint)" in lines(caplog)


def test_resume_restores_the_precision_and_its_gradscaler_state(tmp_path):
    first = PrecisionSwitch(initial="keep")
    trainer, _ = fit(Troubled(overflow=NEVER), first, steps=3)
    trainer.precision_plugin.scaler.update(new_scale=1234.0)
    trainer.save_checkpoint(tmp_path / "fp16.ckpt")

    scales = []
    probe = LambdaCallback(
        on_train_start=lambda trainer, *a: scales.append(trainer.precision_plugin.scaler.get_scale())
    )
    second = PrecisionSwitch(initial="keep")  # the Trainer itself is set up in 32-true
    trainer, _ = fit(
        Troubled(overflow=NEVER),
        second,
        steps=5,
        fp16=False,
        callbacks=[probe],
        ckpt_path=str(tmp_path / "fp16.ckpt"),
    )
    assert trainer.precision == "16-mixed" and scales == [1234.0]


# ----------------------------------------------------------------------------- setup-time choice


@pytest.mark.parametrize(
    ("info", "kwargs", "precision", "autocast"),
    [
        (V100, {}, "16-mixed", "float16"),
        (A100, {}, "bf16-mixed", "bfloat16"),
        (K80, {}, "32-true", None),
        (DeviceInfo("cpu", "CPU", bf16=True), {}, "32-true", None),
        (DeviceInfo("cpu", "CPU", bf16=True), {"cpu_bf16": True}, "bf16-mixed", "bfloat16"),
    ],
    ids=["V100", "A100", "K80", "CPU", "CPU-cpu_bf16"],
)
def test_auto_chooses_by_device_before_the_strategy_wraps(
    on_device, info, kwargs, precision, autocast, caplog
):
    on_device(info)
    model = Troubled(overflow=NEVER)
    with caplog.at_level(logging.INFO):
        trainer, _ = fit(model, PrecisionSwitch(**kwargs), steps=2, fp16=False)
    assert trainer.precision == precision and model.calls[0][2:4] == (precision, autocast)
    assert info.label in lines(caplog)[0] and "auto:" in lines(caplog)[0]


def test_keep_keeps_the_trainers_precision(on_device):
    on_device(A100)
    trainer, _ = fit(Troubled(overflow=NEVER), PrecisionSwitch(initial="keep"), steps=2, fp16=True)
    assert trainer.precision == "16-mixed"


@pytest.mark.parametrize(
    ("info", "initial", "tf32", "during"),
    [
        (A100, "32-true", True, "tf32"),
        (A100, "32-true", False, "none"),
        (V100, "32-true", True, "none"),
        (A100, "auto", True, "none"),
    ],
    ids=["ampere-fp32", "told-not-to", "volta", "ampere-bf16"],
)
def test_tf32_for_fp32_on_ampere_restored_at_teardown(on_device, initial, info, tf32, during):
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9: the legacy flag is covered in tests/test_precision.py")
    on_device(info)
    seen = []
    probe = LambdaCallback(
        on_train_batch_start=lambda *a: seen.append(torch.backends.cuda.matmul.fp32_precision)
    )
    before = torch.backends.cuda.matmul.fp32_precision
    fit(
        Troubled(overflow=NEVER),
        PrecisionSwitch(initial=initial, tf32=tf32),
        steps=2,
        fp16=False,
        callbacks=[probe],
    )
    assert seen == [during, during]
    assert torch.backends.cuda.matmul.fp32_precision == before == "none"


def test_a_ladder_or_initial_the_device_cannot_run_raises_in_setup(on_device):
    on_device(V100)
    with pytest.raises(
        ValueError,
        match=r"names 'bf16-mixed', which this device cannot run: Tesla V100 \(sm_70\) "
        r"has no native bfloat16.*ladder=\('16-mixed', '32-true'\)",
    ):
        fit(
            Troubled(), PrecisionSwitch(initial="keep", ladder=("16-mixed", "bf16-mixed", "32-true")), steps=1
        )
    with pytest.raises(
        ValueError, match=r"`initial='bf16-mixed'`: this device cannot run it.*initial='auto'"
    ):
        fit(Troubled(), PrecisionSwitch(initial="bf16-mixed"), steps=1)
    # the default ladder leaves out what the device cannot run: V100 falls back from 16-mixed to 32-true
    switch = PrecisionSwitch(initial="keep")
    fit(Troubled(overflow=(3, None)), switch, steps=5)
    assert changes(switch) == [(4, "16-mixed", "32-true")]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial": "fp16"}, ValueError, r"`initial` must be one of \('auto', 'keep', '16-mixed'"),
        ({"ladder": ["16-mixed", "fp8"]}, ValueError, "`ladder` names must be among"),
        (
            {"ladder": ["32-true", "bf16-mixed"]},
            ValueError,
            "from the fastest precision to the most stable one",
        ),
        ({"ladder": "32-true"}, TypeError, "sequence of precision names"),
        ({"patience": 0}, ValueError, "`patience` must be a positive int"),
        ({"patience": True}, ValueError, "`patience` must be a positive int"),
        ({"min_scale": 0}, ValueError, r"`min_scale` must be a number > 0, got 0"),
        ({"retry_after": 0}, ValueError, "`retry_after` must be a positive int"),
        ({"retry_after": 2.5}, ValueError, "`retry_after` must be a positive int"),
        ({"rerun": "yes"}, TypeError, "`rerun` must be a bool, got str"),
        ({"tf32": 1}, TypeError, "`tf32` must be a bool, got int"),
        ({"cpu_bf16": None}, TypeError, "`cpu_bf16` must be a bool"),
        ({"verbose": "no"}, TypeError, "`verbose` must be a bool"),
    ],
    ids=lambda v: str(v) if not isinstance(v, type) else v.__name__,
)
def test_invalid_arguments_raise_in_init(kwargs, error, match):
    with pytest.raises(error, match=match):
        PrecisionSwitch(**kwargs)


def test_fp8_needs_transformer_engine():
    if fp8_available():
        pytest.skip("transformer-engine is installed here")
    with pytest.raises(ImportError, match=r"pip install transformer-engine\[pytorch\]"):
        PrecisionSwitch(fp8=True)


def test_one_precision_switch_per_trainer():
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `PrecisionSwitch`"):
        fit(Troubled(), PrecisionSwitch(), steps=1, callbacks=[PrecisionSwitch()])


class _Manual(Troubled):
    def __init__(self):
        super().__init__(overflow=NEVER)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()


def test_manual_optimization_gets_the_setup_time_choice_only(on_device, caplog):
    on_device(V100)
    steps_wrapped = []
    probe = LambdaCallback(
        on_train_batch_start=lambda trainer, *a: steps_wrapped.append("step" in vars(trainer.optimizers[0]))
    )
    model = _Manual()
    with caplog.at_level(logging.INFO):
        trainer, _ = fit(model, PrecisionSwitch(), steps=2, fp16=False, callbacks=[probe])
    assert trainer.precision == "16-mixed" and steps_wrapped == [False, False]
    assert "no runtime fallback: manual optimization" in lines(caplog)[0]


class _FakeTrainer:
    """Just enough Trainer for setup/teardown under strategies that cannot run on a CPU (FSDP needs CUDA)."""

    def __init__(self, strategy, callbacks):
        self.strategy, self.callbacks = strategy, callbacks

    @property
    def precision(self):
        return self.strategy.precision_plugin.precision


def test_under_fsdp_only_the_setup_time_choice_applies(on_device, caplog):
    on_device(A100)
    switch = PrecisionSwitch()
    strategy = FSDPStrategy(parallel_devices=[torch.device("cpu")])
    trainer = _FakeTrainer(strategy, [switch])
    with caplog.at_level(logging.INFO):
        switch.setup(trainer, BoringModel(), "fit")
        switch.on_fit_start(trainer, BoringModel())
    assert (
        isinstance(strategy.precision_plugin, FSDPPrecision)
        and strategy.precision_plugin.precision == "bf16-mixed"
    )
    assert lines(caplog) == [
        "PrecisionSwitch: precision 32-true → bf16-mixed (auto: A100 (sm_80) runs bfloat16 natively); "
        "no runtime fallback: FSDPStrategy fixes the precision when it wraps the model, so only the setup-time choice applies"
    ]
    assert not switch._watching
    switch.teardown(trainer, BoringModel(), "fit")


def test_model_parallel_cannot_take_fp16_and_keeps_its_precision(on_device, caplog):
    on_device(V100)
    switch = PrecisionSwitch()
    strategy = ModelParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    with caplog.at_level(logging.INFO):
        switch.setup(_FakeTrainer(strategy, [switch]), BoringModel(), "fit")
    assert type(strategy.precision_plugin) is Precision
    assert "kept 32-true: ModelParallelStrategy cannot take 16-mixed" in lines(caplog)[0]


def test_an_lr_scheduler_keeps_working_and_gets_its_step_back():
    class Scheduled(Troubled):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    model = Scheduled(overflow=(5, None))
    switch = PrecisionSwitch(initial="keep")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, hook = fit(model, switch)
    assert not [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert changes(switch) == [(6, "16-mixed", "bf16-mixed")] and hook.nonfinite_applied == 0
    optimizer = trainer.optimizers[0]
    assert getattr(optimizer.step, "_wrapped_by_lr_sched", False)  # the scheduler's wrapper, not ours
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)


# ----------------------------------------------------------------------------- DDP, 2 CPU processes


SCRIPT = Path(__file__).with_name("ddp_precision_run.py")


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2], ids=["A1", "A2"])
def test_ddp_overflow_on_one_rank_switches_both_at_the_same_step(tmp_path, accumulate):
    ranks = run_ranks(SCRIPT, tmp_path, accumulate, result="rank{rank}.json")
    expected = [[6, "16-mixed", "bf16-mixed"]] if accumulate == 1 else [[5, "16-mixed", "bf16-mixed"]]
    for rank in ranks:
        assert [s[:3] for s in rank["state"]["switches"]] == expected
        assert rank["nonfinite_applied"] == 0 and rank["finite"]
        assert rank["precision"] == "bf16-mixed"
    assert ranks[0]["params"] == ranks[1]["params"]  # the same steps applied on both ranks
    assert ranks[0]["applied"] == ranks[1]["applied"]
    assert [c for c in ranks[1]["troubled_calls"]] and not ranks[0][
        "troubled_calls"
    ]  # only rank 1 overflowed


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_auto_matches_the_real_device_table():
    from lightning_gpuopt.precision import choose_precision, device_info

    expected = choose_precision(device_info("cuda:0")).precision
    switch = PrecisionSwitch()
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cuda",
        devices=1,
        callbacks=[switch],
        **{k: v for k, v in TRAINER_QUIET.items() if k not in ("accelerator", "devices")},
    )
    trainer.fit(Troubled(overflow=NEVER), DataLoader(Waves(length=1024), batch_size=BATCH))
    major, _ = torch.cuda.get_device_capability(0)
    assert (
        trainer.precision
        == expected
        == ("bf16-mixed" if major >= 8 else "16-mixed" if major >= 7 else "32-true")
    )


@pytest.mark.cuda
def test_fp16_overflow_on_cuda_switches_and_never_applies_a_nonfinite_step():
    switch, hook = PrecisionSwitch(initial="16-mixed"), AppliedSteps()
    trainer = pl.Trainer(
        max_steps=12,
        accelerator="cuda",
        devices=1,
        callbacks=[switch, hook],
        **{k: v for k, v in TRAINER_QUIET.items() if k not in ("accelerator", "devices")},
    )
    model = Troubled(overflow=(5, None))
    trainer.fit(model, DataLoader(Waves(length=1024), batch_size=BATCH))
    assert changes(switch)[0][:2] == (6, "16-mixed") and hook.nonfinite_applied == 0 and finite(model)
