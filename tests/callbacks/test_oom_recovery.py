from __future__ import annotations

import functools
import logging

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import BatchSizeFinder, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import GPUOptReport, GPUOptWarning, MicroBatchOOMError, OOMRecovery, TokenCount
from lightning_gpuopt.microbatch import unsupported_strategy
from lightning_gpuopt.support import Feature
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import Run, StepLog, WideRegressor, fit, optimizer_step_ids, step_marks
from tests.helpers import TRAINER_QUIET


def _precision_kwargs(precision: str) -> dict:
    if precision == "16-mixed-cpu":  # real fp16 autocast with a GradScaler on CPU
        from lightning.pytorch.plugins import MixedPrecision

        return {
            "precision": None,
            "plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        }
    return {"precision": precision}


@functools.cache
def _calibration(precision: str = "64-true") -> tuple[int, int, int]:
    """Memory figures of a steady-state full-batch step (Adam), measured, not assumed."""
    run = fit(WideRegressor("adam"), [OOMRecovery()], steps=3, **_precision_kwargs(precision))
    return step_marks(run.model)


def _limit(phase: str, precision: str = "64-true") -> int:
    start, after_forward, forward_peak = _calibration(precision)
    if phase == "forward":  # the full batch cannot finish its forward
        return start + int(0.7 * (forward_peak - start))
    # the forward fits, the backward of the full batch does not
    return forward_peak + int(0.25 * (after_forward - start))


def _reference(optimizer: str, accumulate: int, precision: str = "64-true", **kwargs):
    log = StepLog()
    run = fit(
        WideRegressor(optimizer, clip=True, scheduler=True),
        [log],
        accumulate=accumulate,
        precision=precision,
        gradient_clip_val=0.5,
        **kwargs,
    )
    return run, log


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize(
    ("optimizer", "accumulate"),
    [("sgd", 1), ("adam", 1), ("sgd", 3), ("adam", 3)],
    ids=["sgd-A1", "adam-A1", "sgd-A3", "adam-A3"],
)
def test_recovered_run_equals_the_run_that_never_ran_out_of_memory(phase, optimizer, accumulate):
    ref, ref_log = _reference(optimizer, accumulate)
    oom = OOMRecovery()
    log = StepLog()
    run = fit(
        WideRegressor(optimizer, clip=True, scheduler=True),
        [oom, log],
        limit=_limit(phase),
        accumulate=accumulate,
        gradient_clip_val=0.5,
    )

    assert oom.failures, "the limit must force an OOM, or the test proves nothing"
    assert oom.failures[0].phase == phase and oom.failures[0].k == 1
    assert oom.k > 1
    assert run.memory.peak_bytes <= _limit(phase)
    for got, want in zip(run.params(), ref.params()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert log.steps == ref_log.steps  # batch_idx and global_step sequences
    assert run.trainer.global_step == ref.trainer.global_step == 20
    assert optimizer_step_ids(run.model, accumulate) == optimizer_step_ids(ref.model, accumulate)
    # One sample-weighted value logged per batch, equal to the run without OOM.
    torch.testing.assert_close(torch.tensor(log.losses), torch.tensor(ref_log.losses), rtol=1e-9, atol=0)


def test_without_the_callback_the_same_limit_is_fatal():
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory \(simulated\)"):
        fit(WideRegressor("adam"), [], limit=_limit("forward"))


def test_fp32_difference_stays_at_the_micro_batching_noise_floor():
    """fp32: recovery differs from the reference only as much as plain k=2 micro-batching does."""
    ref, _ = _reference("adam", 1, precision="32-true")
    forced = OOMRecovery()
    forced.load_state_dict({"k": 2})  # k=2 from the start, no OOM: the rounding floor of splitting
    floor_run = fit(
        WideRegressor("adam", clip=True, scheduler=True), [forced], precision="32-true", gradient_clip_val=0.5
    )
    oom = OOMRecovery()
    run = fit(
        WideRegressor("adam", clip=True, scheduler=True),
        [oom],
        limit=_limit("forward") // 2 + 1,
        precision="32-true",
        gradient_clip_val=0.5,
    )
    assert oom.failures and forced.failures == []
    floor = max((a - b).abs().max().item() for a, b in zip(floor_run.params(), ref.params()))
    diff = max((a - b).abs().max().item() for a, b in zip(run.params(), ref.params()))
    assert 0 < floor < 1e-4
    # The recovered run used k >= 2 (more splits, more rounding): allow 20x the k=2 floor.
    assert diff <= 20 * floor, (diff, floor)


def test_dict_output_and_extra_keys_survive_a_retry():
    class DictOut(WideRegressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return {"loss": loss, "preds_ids": batch[0]}

    class Outputs(pl.Callback):
        def __init__(self):
            self.ids = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ids.append(outputs["preds_ids"].tolist())

    outs = Outputs()
    oom = OOMRecovery()
    fit(DictOut("sgd"), [oom, outs], limit=_limit("forward"), steps=3)
    assert oom.failures
    assert outs.ids == [list(range(s * 128, (s + 1) * 128)) for s in range(3)]


def test_each_oom_change_is_announced_once_with_the_numbers(caplog):
    with caplog.at_level(logging.INFO):
        oom = OOMRecovery()
        fit(WideRegressor("adam"), [oom], limit=_limit("backward"), steps=3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OOM at step")]
    assert len(lines) == len(oom.failures) >= 1
    assert lines[0].startswith("OOM at step 0 (backward): micro-batch 128 -> ")
    assert "(k 1 -> " in lines[0] and lines[0].endswith("optimizer batch 128 kept")


def test_micro_batch_size_goes_to_the_logger(tmp_path):
    class Collect(Logger):
        name, version = "collect", 0

        def __init__(self):
            super().__init__()
            self.rows = []

        @property
        def experiment(self):
            return None

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

    logger = Collect()
    oom = OOMRecovery()
    report = GPUOptReport(str(tmp_path), plot=False, table=False)  # the one source of gpuopt/micro_batch_size
    fit(
        WideRegressor("adam"),
        [oom, report],
        limit=_limit("forward"),
        steps=3,
        logger=logger,
        log_every_n_steps=1,
    )
    sizes = [
        (step, m["gpuopt/micro_batch_size"]) for step, m in logger.rows if "gpuopt/micro_batch_size" in m
    ]
    assert sizes == [(step, float(-(-128 // oom.k))) for step in range(3)]  # ceil(128 / k), once a step


# ----------------------------------------------------------------------------- loss weighting


class Padded(Dataset):
    """Token sequences of very different lengths, padded: a token-mean loss weighs them unequally."""

    def __init__(self, n: int = 64, length: int = 24, vocab: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (n, length), generator=g)
        self.lengths = torch.cat([torch.full((n // 2,), length), torch.full((n - n // 2,), 3)])

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = self.tokens[i].clone()
        labels[self.lengths[i] :] = -100
        return {"input_ids": self.tokens[i], "labels": labels}


class TinyLM(pl.LightningModule):
    def __init__(self, vocab: int = 16, width: int = 512) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def training_step(self, batch, batch_idx):
        logits = self.head(torch.tanh(self.embed(batch["input_ids"])))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _lm_run(callbacks, limit=None):
    pl.seed_everything(0, verbose=False)
    model = TinyLM()
    trainer = pl.Trainer(max_steps=6, precision="64-true", callbacks=callbacks, **TRAINER_QUIET)
    # The long sequences all sit in the first half of each batch, so micro-batches differ in tokens.
    loader = DataLoader(Padded(), batch_size=64, shuffle=False)
    with SimulatedMemory(limit) as memory:
        trainer.fit(model, loader)
    return model, memory


@functools.cache
def _lm_limit() -> int:
    _, memory = _lm_run([OOMRecovery(loss_reduction="tokens")])
    return int(memory.peak_bytes * 0.6)


def test_token_weighting_keeps_a_token_mean_loss_exact():
    ref, _ = _lm_run([])
    tokens = OOMRecovery(loss_reduction="tokens")
    got, _ = _lm_run([tokens], limit=_lm_limit())
    assert tokens.failures
    for a, b in zip(got.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # Sample shares would be wrong here: the test could fail. The check flags them (warned, not refused here).
    samples = OOMRecovery(loss_reduction="mean", on_mismatch="warn")
    with pytest.warns(
        GPUOptWarning, match=r"the given weighting, sample shares, does not reproduce your loss"
    ):
        wrong, _ = _lm_run([samples], limit=_lm_limit())
    assert samples.failures
    assert max((a - b).abs().max().item() for a, b in zip(wrong.parameters(), ref.parameters())) > 1e-6


def test_default_weighting_finds_the_token_mean_after_a_real_oom():
    ref, _ = _lm_run([])
    auto = OOMRecovery()
    got, _ = _lm_run([auto], limit=_lm_limit())
    assert auto.failures and auto.loss_weighting.decided.description == "tokens (labels != -100)"
    for a, b in zip(got.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_weight_fn_counts_like_the_token_preset():
    ref, _ = _lm_run([])
    custom = OOMRecovery(weight_fn=TokenCount("labels", ignore_index=-100))
    got, _ = _lm_run([custom], limit=_lm_limit())
    assert custom.failures
    for a, b in zip(got.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_token_count_names_a_missing_key():
    with pytest.raises(ValueError, match=r"counts tokens in batch\['mask'\]"):
        TokenCount("mask")({"labels": torch.zeros(2)})


def test_sum_reduction_adds_micro_batch_losses():
    class SumLoss(WideRegressor):
        def training_step(self, batch, batch_idx):
            _, x, y = batch
            loss = F.mse_loss(self.net(x), y, reduction="sum")
            self.log("train_loss", loss)
            return loss

    oom = OOMRecovery(loss_reduction="sum", sum_log_keys=["train_loss"])
    log, ref_log = StepLog(), StepLog()
    ref = fit(SumLoss("adam"), [ref_log], steps=5)
    run = fit(SumLoss("adam"), [oom, log], limit=_limit("forward"), steps=5)
    assert oom.failures
    for a, b in zip(run.params(), ref.params()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.tensor(log.losses), torch.tensor(ref_log.losses), rtol=1e-9, atol=0)


# ----------------------------------------------------------------------------- side effects


def test_metric_updated_in_training_step_counts_every_sample_once():
    class WithMetric(WideRegressor):
        def __init__(self):
            super().__init__("adam")
            self.mse = torchmetrics.MeanSquaredError()
            self.count = torchmetrics.SumMetric()

        def training_step(self, batch, batch_idx):
            ids, x, y = batch
            pred = self.net(x)
            self.mse.update(pred.detach(), y)
            self.count.update(torch.tensor(float(len(ids)), dtype=torch.float64))
            return F.mse_loss(pred, y)

    ref = fit(WithMetric(), [], steps=6)
    oom = OOMRecovery()
    run = fit(WithMetric(), [oom], limit=_limit("backward"), steps=6)
    assert oom.failures
    assert int(run.model.count.compute()) == int(ref.model.count.compute()) == 6 * 128
    assert run.model.mse.total == ref.model.mse.total == 6 * 128
    # torchmetrics keeps float32 states under 64-true: summing per micro-batch rounds at float32.
    torch.testing.assert_close(run.model.mse.compute(), ref.model.mse.compute(), rtol=1e-6, atol=0)


def test_batchnorm_statistics_are_not_updated_by_a_failed_attempt():
    class WithNorm(WideRegressor):
        def __init__(self):
            super().__init__("sgd")
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 2048), nn.BatchNorm1d(2048), nn.Tanh(), nn.Linear(2048, 1))

    oom = OOMRecovery()
    run = fit(WithNorm(), [oom], limit=_limit("forward") * 2, steps=1)
    assert oom.failures
    # Every attempt runs k micro-batches through BatchNorm; only the successful one may count.
    assert int(run.model.net[1].num_batches_tracked) == oom.k


def test_split_hook_of_the_module_is_used():
    calls = []

    class OwnSplit(WideRegressor):
        def split_batch(self, batch, k):
            calls.append(k)
            ids, x, y = batch
            return [(i, a, b) for i, a, b in zip(ids.chunk(k), x.chunk(k), y.chunk(k))]

    ref = fit(WideRegressor("sgd"), [], steps=3)
    run = fit(OwnSplit("sgd"), [OOMRecovery()], limit=_limit("forward"), steps=3)
    assert calls and all(k > 1 for k in calls)
    for a, b in zip(run.params(), ref.params()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- giving up clearly


def test_unsplittable_batch_raises_a_clear_error():
    with pytest.raises(MicroBatchOOMError, match=r"declared unsplittable") as info:
        fit(WideRegressor("adam"), [OOMRecovery(unsplittable=True)], limit=_limit("forward"))
    assert "Lower `batch_size`" in str(info.value)


def test_unsplittable_predicate_is_asked_per_batch():
    seen = []

    def coupled(batch):
        seen.append(len(batch[0]))
        return True

    with pytest.raises(MicroBatchOOMError, match="declared unsplittable"):
        fit(WideRegressor("adam"), [OOMRecovery(unsplittable=coupled)], limit=_limit("forward"))
    assert seen and seen[0] == 128


def test_out_of_memory_at_one_sample_explains_the_memory():
    calibration = fit(WideRegressor("adam"), [OOMRecovery()], steps=1)
    _, first_step_start, _, _ = calibration.model.marks[0]
    with pytest.raises(MicroBatchOOMError) as info:  # one sample's activations (~32 KiB) do not fit
        fit(WideRegressor("adam"), [OOMRecovery()], limit=first_step_start + 8_000, steps=3)
    text = str(info.value)
    # The failures show at once that one sample cannot fit beside the gradients: no futile tries down to 1.
    assert "no smaller micro-batch can fit" in text and "at least 1 sample(s) per micro-batch" in text
    for part in (
        "parameters ",
        "gradients ",
        "optimizer state ",
        "per sample",
        "limit ",
        "Next steps:",
        "sharded strategy",
    ):
        assert part in text
    assert isinstance(info.value, torch.OutOfMemoryError)


def test_max_micro_batches_caps_the_split():
    with pytest.raises(MicroBatchOOMError, match=r"max_micro_batches=2 reached"):
        fit(WideRegressor("adam"), [OOMRecovery(max_micro_batches=2)], limit=_limit("forward") // 2 + 1)


# ----------------------------------------------------------------------------- refused setups


class _Manual(WideRegressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _TwoOptimizers(WideRegressor):
    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.1),
            torch.optim.SGD(self.net[2].parameters(), lr=0.1),
        ]


class _LBFGS(WideRegressor):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.parametrize(
    ("make_model", "extra_callbacks", "message"),
    [
        (_Manual, [], r"needs automatic optimization"),
        (_TwoOptimizers, [], r"exactly one optimizer, got 2|multiple optimizers"),
        (_LBFGS, [], r"closure optimizers such as LBFGS"),
    ],
    ids=["manual-optimization", "two-optimizers", "lbfgs"],
)
def test_unsupported_setups_are_refused_with_the_alternative(make_model, extra_callbacks, message):
    with pytest.raises(Exception, match=message):
        fit(make_model(), [OOMRecovery(), *extra_callbacks], steps=2)


def test_batch_size_finder_in_the_same_trainer_is_refused():
    cb = OOMRecovery()
    trainer = pl.Trainer(max_steps=1, callbacks=[cb, BatchSizeFinder()], **TRAINER_QUIET)
    with pytest.raises(
        RuntimeError,
        match=r"cannot run beside Lightning's BatchSizeFinder.*without changing the optimizer batch",
    ):
        cb.setup(trainer, WideRegressor(), "fit")


def test_tensor_parallelism_and_fsdp1_are_refused_naming_the_alternative():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    cb = OOMRecovery()
    trainer = pl.Trainer(max_steps=1, strategy=ModelParallelStrategy(tensor_parallel_size=2), **TRAINER_QUIET)
    with pytest.raises(
        RuntimeError,
        match=r"OOMRecovery: micro-batching under ModelParallelStrategy supports FSDP2 data parallelism only, got tensor_parallel_size=2 .* Use tensor_parallel_size=1",
    ):
        cb.setup(trainer, WideRegressor(), "fit")
    reason = unsupported_strategy(FSDPStrategy(), Feature.OOM_RECOVERY)
    assert (
        "supports single-device, DDP and FSDP2 (ModelParallelStrategy) training, got FSDPStrategy" in reason
    )
    assert "FSDP2Strategy for a sharded model" in reason


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"loss_reduction": "avg"},
            ValueError,
            r"`loss_reduction` must be one of \('auto', 'mean', 'tokens', 'sum'\), got 'avg'",
        ),
        ({"weight_fn": 3}, TypeError, r"`weight_fn` must be a callable"),
        (
            {"weight_fn": len, "loss_reduction": "sum"},
            ValueError,
            r"cannot be combined with loss_reduction='sum'",
        ),
        ({"unsplittable": "yes"}, TypeError, r"`unsplittable` must be a bool or a callable"),
        ({"sum_log_keys": "loss"}, TypeError, r"`sum_log_keys` must be a collection of names"),
        ({"max_micro_batches": 0}, ValueError, r"`max_micro_batches` must be a positive int or None, got 0"),
        ({"headroom": 0}, ValueError, r"`headroom` must be in \(0, 1\], got 0"),
        ({"headroom": 1.5}, ValueError, r"`headroom` must be in \(0, 1\], got 1.5"),
        ({"grow_back": "yes"}, ValueError, r"`grow_back` must be True or False, got 'yes'"),
        ({"grow_back_after": 0}, ValueError, r"`grow_back_after` must be a positive int \(steps\), got 0"),
        (
            {"checkpoint_modules": "Linear"},
            TypeError,
            r"`checkpoint_modules` must be a list of module classes",
        ),
        ({"checkpoint_modules": [3]}, TypeError, r"`checkpoint_modules` must be a list of module classes"),
    ],
)
def test_bad_arguments_fail_in_init(kwargs, error, message):
    with pytest.raises(error, match=message):
        OOMRecovery(**kwargs)


# ----------------------------------------------------------------------------- resume


def test_resume_from_a_checkpoint_taken_after_a_change_starts_with_that_k(tmp_path):
    limit = _limit("forward")
    first = OOMRecovery()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    fit(WideRegressor("adam"), [first, ckpt], limit=limit, steps=4, enable_checkpointing=True)
    assert first.failures and first.k > 1

    second = OOMRecovery()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_steps=8,
        precision="64-true",
        callbacks=[second],
        **{**TRAINER_QUIET, "enable_checkpointing": False},
    )
    from tests.callbacks.oom_models import Waves

    with SimulatedMemory(limit):
        trainer.fit(
            WideRegressor("adam"), DataLoader(Waves(), batch_size=128), ckpt_path=str(tmp_path / "last.ckpt")
        )
    assert trainer.global_step == 8
    assert second.k == first.k
    assert second.failures == []  # it started with the split it had: no OOM to rediscover
    loaded = torch.load(tmp_path / "last.ckpt", weights_only=True)
    (state,) = [v for key, v in loaded["callbacks"].items() if key.startswith("OOMRecovery")]
    assert state["oom_count"] == len(first.failures)
    # k is the engine's, saved once under its own key (and nowhere else).
    assert loaded["callbacks"]["MicroBatchEngine"]["k"] == first.k
    assert sum("k" in v for v in loaded["callbacks"].values()) == 1


def test_a_checkpoint_written_before_the_engine_saved_its_state_still_resumes_with_its_k(tmp_path):
    limit = _limit("forward")
    first = OOMRecovery()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    fit(WideRegressor("adam"), [first, ckpt], limit=limit, steps=4, enable_checkpointing=True)
    assert first.k > 1
    # Rewrite the checkpoint as the previous release wrote it: k in OOMRecovery's state (same state_key).
    loaded = torch.load(tmp_path / "last.ckpt", weights_only=True)
    engine_state = loaded["callbacks"].pop("MicroBatchEngine")
    (key,) = [key for key in loaded["callbacks"] if key.startswith("OOMRecovery")]
    assert key == OOMRecovery().state_key  # stable: old checkpoints find their state
    loaded["callbacks"][key].update(k=engine_state["k"], eval_k=[], checkpointing=False)
    torch.save(loaded, tmp_path / "old.ckpt")

    second = OOMRecovery()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_steps=6,
        precision="64-true",
        callbacks=[second],
        **{**TRAINER_QUIET, "enable_checkpointing": False},
    )
    from tests.callbacks.oom_models import Waves

    with SimulatedMemory(limit):
        trainer.fit(
            WideRegressor("adam"), DataLoader(Waves(), batch_size=128), ckpt_path=str(tmp_path / "old.ckpt")
        )
    assert second.k == first.k and second.failures == []


# ----------------------------------------------------------------------------- mixed precision


def _relative_distance(a: Run, b: Run) -> float:
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(a.params(), b.params())) ** 0.5
    den = sum((x.double() ** 2).sum() for x in b.params()) ** 0.5
    return float(num / den)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed-cpu"])
def test_mixed_precision_recovers_and_stays_on_the_reference_path(precision):
    ref = fit(WideRegressor("adam"), [], steps=10, **_precision_kwargs(precision))
    oom = OOMRecovery()
    run = fit(
        WideRegressor("adam"),
        [oom],
        steps=10,
        limit=_limit("forward", precision),
        **_precision_kwargs(precision),
    )
    assert oom.failures and oom.k > 1
    assert all(torch.isfinite(p).all() for p in run.params())
    # Half-precision rounding differs with the split; the runs must still follow the same path.
    assert _relative_distance(run, ref) < 1e-2
    if precision == "16-mixed-cpu":
        ref_scaler = ref.trainer.precision_plugin.scaler
        run_scaler = run.trainer.precision_plugin.scaler
        assert run_scaler.get_scale() == ref_scaler.get_scale()  # no step skipped that the reference took
