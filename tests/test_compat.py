"""Each private attribute of Lightning / torchmetrics the pack touches still exists: a release that moves one fails here."""

from __future__ import annotations

import lightning.pytorch as pl
import torchmetrics
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_gpuopt import _compat


def test_compiled_module_flag():
    module = BoringModel()
    assert _compat.is_compiled(module) is False
    assert hasattr(module, "_compiler_ctx"), "LightningModule._compiler_ctx moved: update _compat.is_compiled"


def test_should_accumulate_answers_inside_a_fit():
    answers = []

    class Ask(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            answers.append(_compat.should_accumulate(trainer))

    trainer = pl.Trainer(
        max_steps=2,
        accumulate_grad_batches=2,
        callbacks=[Ask()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    assert answers[:2] == [True, False]


def test_ddp_kwargs_and_tensor_parallel_size():
    assert "_ddp_kwargs" in vars(DDPStrategy(bucket_cap_mb=5)), "DDPStrategy._ddp_kwargs moved"
    assert _compat.ddp_kwargs(DDPStrategy(bucket_cap_mb=5))["bucket_cap_mb"] == 5
    strategy = ModelParallelStrategy(tensor_parallel_size=2)
    assert "_tensor_parallel_size" in vars(strategy), "ModelParallelStrategy._tensor_parallel_size moved"
    assert _compat.tensor_parallel_size(strategy) == 2


def test_metric_state_names():
    assert _compat.metric_state_names(torchmetrics.MeanMetric()) == ["mean_value", "weight"]
