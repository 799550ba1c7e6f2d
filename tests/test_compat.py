"""Each private attribute of Lightning, torch and torchmetrics the pack touches still exists: a release that
moves one fails here."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_gpuopt import _compat
from tests.helpers import TRAINER_QUIET


def _fit_boring(**options) -> pl.Trainer:
    """Lightning's BoringModel fit quietly on the CPU with ``options``."""
    trainer = pl.Trainer(**{**TRAINER_QUIET, **options})
    trainer.fit(BoringModel())
    return trainer


def test_compiled_module_flag():
    module = BoringModel()
    assert _compat.is_compiled(module) is False
    assert hasattr(module, "_compiler_ctx"), "LightningModule._compiler_ctx moved: update _compat.is_compiled"


def test_should_accumulate_answers_inside_a_fit():
    answers = []

    class Ask(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            answers.append(_compat.should_accumulate(trainer))

    _fit_boring(max_steps=2, accumulate_grad_batches=2, callbacks=[Ask()])
    assert answers[:2] == [True, False]


def test_logger_step_is_the_step_lightning_logs_the_batch_under():
    class Logged(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss", out["loss"])
            return out

    class Record(pl.loggers.logger.DummyLogger):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []

        def log_metrics(self, metrics, step=None):
            if "loss" in metrics:
                self.steps.append(step)

    class Ask(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not _compat.should_accumulate(trainer):
                self.steps.append(_compat.logger_step(trainer))

    logger, ask = Record(), Ask()
    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        callbacks=[ask],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Logged())
    assert logger.steps == ask.steps == [0, 1, 2, 3], (
        "trainer.fit_loop.epoch_loop._batches_that_stepped moved"
    )


def test_saves_distributed_checkpoint():
    assert "_save_distributed_checkpoint" in vars(ModelParallelStrategy()), "ModelParallelStrategy moved it"
    assert _compat.saves_distributed_checkpoint(ModelParallelStrategy())
    assert not _compat.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False))
    from lightning.pytorch.strategies import FSDPStrategy

    assert "_state_dict_type" in vars(FSDPStrategy()), "FSDPStrategy._state_dict_type moved"
    assert _compat.saves_distributed_checkpoint(FSDPStrategy(state_dict_type="sharded"))
    assert not _compat.saves_distributed_checkpoint(FSDPStrategy())


def test_ddp_kwargs_and_tensor_parallel_size():
    assert "_ddp_kwargs" in vars(DDPStrategy(bucket_cap_mb=5)), "DDPStrategy._ddp_kwargs moved"
    assert _compat.ddp_kwargs(DDPStrategy(bucket_cap_mb=5))["bucket_cap_mb"] == 5
    strategy = ModelParallelStrategy(tensor_parallel_size=2)
    assert "_tensor_parallel_size" in vars(strategy), "ModelParallelStrategy._tensor_parallel_size moved"
    assert _compat.tensor_parallel_size(strategy) == 2


def test_metric_state_names():
    assert _compat.metric_state_names(torchmetrics.MeanMetric()) == ["mean_value", "weight"]


def test_metric_counters():
    metric = torchmetrics.MeanMetric()
    metric.update(1.0)
    assert _compat.metric_counters(metric) == {"_update_count": 1, "_computed": None}


def test_cluster_environment():
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    from lightning.fabric.plugins.environments import LightningEnvironment

    assert isinstance(_compat.cluster_environment(trainer), LightningEnvironment)


def test_mark_checkpoint_saved_stops_model_checkpoint_saving_again(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=tmp_path)
    assert hasattr(callback, "_last_global_step_saved") and hasattr(callback, "_last_checkpoint_saved"), (
        "ModelCheckpoint's skip bookkeeping moved: update _compat.mark_checkpoint_saved"
    )
    _compat.mark_checkpoint_saved(callback, 7, "last.ckpt")
    assert (callback._last_global_step_saved, callback.last_model_path) == (7, "last.ckpt")


def test_validation_due_skip_next_validation_and_run_validation():
    seen = {"due": [], "validations": []}

    class Ask(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            _compat.run_validation(trainer, epoch=0)  # one validation, before any training batch
            assert trainer.training

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["due"].append(_compat.validation_due(trainer))
            if batch_idx == 1:
                _compat.skip_next_validation(trainer)

        def on_validation_end(self, trainer, pl_module):
            seen["validations"].append((trainer.current_epoch, trainer.global_step))

    _fit_boring(
        max_epochs=1, limit_train_batches=4, limit_val_batches=2, val_check_interval=2, callbacks=[Ask()]
    )
    assert seen["due"] == [False, True, False, True]
    assert seen["validations"] == [(0, 0), (0, 4)]  # the one run at the start; the one at step 2 skipped


def test_logger_version_and_set_logger_version(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="x")
    assert _compat.logger_version(logger) is None, "CSVLogger._version moved: update _compat"
    _compat.set_logger_version(logger, "run-1")
    assert logger.version == "run-1" and logger.log_dir == str(tmp_path / "x" / "run-1")


def test_continue_csv_metrics_appends_to_the_folders_file(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    first = CSVLogger(tmp_path, name="x", version="v")
    first.log_metrics({"a": 1.0}, step=0)
    first.save()
    second = CSVLogger(tmp_path, name="x", version="v")
    _compat.continue_csv_metrics(second)
    second.log_metrics({"a": 2.0, "b": 3.0}, step=1)
    second.save()
    lines = (tmp_path / "x" / "v" / "metrics.csv").read_text().splitlines()
    assert lines == ["a,b,step", "1.0,,0", "2.0,3.0,1"]


def test_drop_train_loader():
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert hasattr(trainer.fit_loop, "_combined_loader"), "fit_loop._combined_loader moved: update _compat"
    trainer.fit_loop._combined_loader = object()
    _compat.drop_train_loader(trainer.fit_loop)
    assert trainer.fit_loop._combined_loader is None


def test_reset_grad_scaler_forgets_the_optimizer_step():
    import torch

    scaler = torch.amp.GradScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    _compat.reset_grad_scaler(scaler, optimizer)
    scaler.unscale_(optimizer)  # would raise "unscale_() has already been called" without the reset


def test_lr_scheduler_mark_and_tensor_version():
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert _compat.lr_scheduler_mark(optimizer.step) is False
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert _compat.lr_scheduler_mark(optimizer.step), "the LR scheduler's _wrapped_by_lr_sched mark moved"

    def step():
        return None

    _compat.set_lr_scheduler_mark(step)
    assert _compat.lr_scheduler_mark(step)
    t = torch.zeros(2)
    before = _compat.tensor_version(t)
    t.add_(1)
    assert _compat.tensor_version(t) == before + 1


def test_ddp_and_fsdp2_internals_on_one_process():
    """DDP's comm hooks, FSDP2's parameter groups, collectives and unsharded parameters, DTensor's local tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(nn.Linear(2, 2))
        assert _compat.ddp_comm_hook_set(DDPStrategy(), ddp) is False
        ddp.register_comm_hook(None, lambda state, bucket: None)
        assert _compat.ddp_comm_hook_set(DDPStrategy(), ddp), "DistributedDataParallel._comm_hooks moved"
        hooked = DDPStrategy(ddp_comm_hook=lambda state, bucket: None)
        assert _compat.ddp_comm_hook_set(hooked, None), "DDPStrategy._ddp_comm_hook moved"

        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        groups = _compat.fsdp_param_groups(model)
        assert len(groups) == 2, "FSDPState._fsdp_param_group(s) moved"
        all_gather, reduce_scatter = _compat.fsdp_collectives(groups[0])
        assert all_gather is not None and reduce_scatter is not None
        _compat.set_fsdp_collectives(groups[0], "gather", "scatter")
        assert _compat.fsdp_collectives(groups[0]) == ("gather", "scatter")
        _compat.set_fsdp_collectives(groups[0], all_gather, reduce_scatter)
        model(torch.ones(2, 4)).sum().backward()
        assert all(_compat.fsdp_unsharded_param(p) is not None for g in groups for p in g.fsdp_params), (
            "FSDPParam._unsharded_param moved"
        )
        weight = model[0].weight
        assert type(_compat.local_tensor(weight)) is torch.Tensor, "DTensor._local_tensor moved"
        assert _compat.local_shard(weight).shape == (4, 4) and _compat.local_shard(torch.ones(1)).shape == (
            1,
        )
    finally:
        dist.destroy_process_group()


# --- torch's privates the memory layer reads -----------------------------------------------------------


def test_storage_id_tells_storages_apart_on_meta_too():
    import torch

    a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert _compat.storage_id(a.untyped_storage()) == _compat.storage_id(a[1:].untyped_storage())
    assert _compat.storage_id(a.untyped_storage()) != _compat.storage_id(b.untyped_storage())


def test_op_schema_and_the_scalar_read_op():
    import torch

    assert [r.alias_info is not None for r in _compat.op_schema(torch.ops.aten.view.default).returns] == [
        True
    ]
    assert _compat.scalar_read_op() is torch.ops.aten._local_scalar_dense.default


def test_module_tables_are_the_modules_own_dicts():
    import torch

    net = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    tables = _compat.module_tables(net[0])
    assert set(tables["parameters"]) == {"weight", "bias"} and "running_mean" in tables["buffers"]
    assert list(_compat.module_tables(net)["modules"]) == ["0"]


def test_first_items_cuts_a_module_list_and_puts_it_back():
    import torch

    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
    with _compat.first_items(layers, 2):
        assert len(layers) == 2
    assert len(layers) == 4


def test_disable_current_modes_leaves_no_mode_active():
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    with TorchDispatchMode():
        assert _get_current_dispatch_mode() is not None
        with _compat.disable_current_modes():
            assert _get_current_dispatch_mode() is None


def test_clear_cublas_workspaces_reads_torchs_function():
    import torch

    assert hasattr(torch._C, "_cuda_clearCublasWorkspaces"), "moved: update _compat.clear_cublas_workspaces"
    _compat.clear_cublas_workspaces()


def test_saved_tensors_reads_what_a_node_holds_without_unpacking():
    x = torch.randn(4, 3, requires_grad=True)
    y = (x * 2).sin()
    assert [t.shape for t in _compat.saved_tensors(y.grad_fn)] == [torch.Size([4, 3])]
    unpacked = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: ("held", t), lambda p: unpacked.append(p) or p[1]
    ):
        z = (x * 3).sin()
    held = _compat.saved_tensors(z.grad_fn)
    assert held[0][0] == "held" and not unpacked, "the pack hook's object, and no unpack (a recompute) called"
    y.sum().backward()
    assert _compat.saved_tensors(y.grad_fn) == []  # released by the backward
    assert any(name.startswith("_raw_saved_") for name in dir(z.grad_fn)), (
        "autograd nodes' _raw_saved_* moved"
    )


def test_thread_frames_has_this_thread():
    import threading

    assert threading.get_ident() in _compat.thread_frames()


@pytest.mark.skipif(
    not torch.backends.cuda.is_built(), reason="a torch built without CUDA has no CUDA allocator"
)
def test_the_cuda_allocator_privates_exist():
    # Read only on CUDA, but a CUDA build of torch has them on any machine.
    assert callable(torch._C._cuda_attach_out_of_memory_observer), (
        "torch._C._cuda_attach_out_of_memory_observer moved"
    )
    assert callable(torch.cuda.memory._record_memory_history), (
        "torch.cuda.memory._record_memory_history moved"
    )
    assert callable(torch.cuda.memory._dump_snapshot), "torch.cuda.memory._dump_snapshot moved"


def test_batch_norm_types_cover_every_batch_norm():
    kinds = _compat.batch_norm_types()
    for module in (
        nn.BatchNorm1d(2),
        nn.BatchNorm2d(2),
        nn.BatchNorm3d(2),
        nn.SyncBatchNorm(2),
        nn.LazyBatchNorm1d(),
    ):
        assert isinstance(module, kinds)
    assert not isinstance(nn.LayerNorm(2), kinds)


def test_foreach_norm_is_each_tensors_norm():
    tensors = [torch.tensor([3.0, 4.0]), torch.ones(4, dtype=torch.bfloat16)]
    norms = _compat.foreach_norm(tensors, torch.float32)
    assert [float(n) for n in norms] == [5.0, 2.0] and all(n.dtype == torch.float32 for n in norms)


def test_optimizer_unscales_itself_is_the_fused_optimizers_mark():
    params = [nn.Parameter(torch.ones(2))]
    assert not _compat.optimizer_unscales_itself(torch.optim.SGD(params, lr=0.1))
    fused = torch.optim.AdamW(params, lr=0.1)
    fused._step_supports_amp_scaling = True  # what AdamW(fused=True) sets on CUDA
    assert _compat.optimizer_unscales_itself(fused)


def test_dataloader_iterator_base_is_every_loaders_iterator():
    from torch.utils.data import DataLoader

    assert isinstance(iter(DataLoader(list(range(4)), batch_size=2)), _compat.dataloader_iterator_base())


def test_parser_option_strings_lists_every_option():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--alpha", "-a")
    assert {"--alpha", "-a", "--help", "-h"} <= set(_compat.parser_option_strings(parser))


def test_end_restart_at_epoch_end_lets_the_next_epoch_start_as_one(tmp_path):
    """Resumed from a checkpoint of an epoch's last batch, the next epoch is counted as started and its
    `on_train_epoch_start` runs (Lightning 2.6 skips both without the call)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers import IndexedData40, RecordingRegressor

    class Starts(pl.Callback):
        def __init__(self, fix: bool) -> None:
            self.fix, self.applied, self.starts = fix, None, []

        def on_train_start(self, trainer, pl_module):
            if self.fix:
                self.applied = _compat.end_restart_at_epoch_end(trainer)

        def on_train_epoch_start(self, trainer, pl_module):
            self.starts.append((trainer.current_epoch, trainer.fit_loop.epoch_progress.current.ready))

    def fit(callbacks, ckpt_path=None, epochs=1):
        quiet = {**TRAINER_QUIET, "enable_checkpointing": True}  # the first fit writes checkpoints
        trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, default_root_dir=tmp_path, **quiet)
        trainer.fit(RecordingRegressor(), IndexedData40(batch_size=4, num_workers=0), ckpt_path=ckpt_path)
        return trainer

    every_step = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=0, save_last=True
    )
    fit([every_step])  # epoch 0: its last checkpoint is written at its last batch
    last = tmp_path / "ckpt" / "last.ckpt"
    without, with_ = Starts(fix=False), Starts(fix=True)
    fit([without], last, epochs=2)
    fit([with_], last, epochs=2)
    assert without.starts == []  # Lightning's own: epoch 1 never starts as an epoch
    assert with_.applied and with_.starts == [(1, 2)]  # epoch 1's hook ran, with epoch 1 counted as ready
