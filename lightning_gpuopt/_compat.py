"""The private Lightning, torch and torchmetrics attributes the pack touches, one function each.

When a release moves one of them, ``tests/test_compat.py`` fails here, by name, instead of somewhere deep
inside a training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "attach_cuda_oom_observer",
    "batch_norm_types",
    "clear_cublas_workspaces",
    "cluster_environment",
    "continue_csv_metrics",
    "dataloader_iterator_base",
    "ddp_comm_hook_set",
    "ddp_kwargs",
    "disable_current_modes",
    "drop_train_loader",
    "dump_cuda_memory_snapshot",
    "end_restart_at_epoch_end",
    "first_items",
    "foreach_norm",
    "fsdp_collectives",
    "fsdp_param_groups",
    "fsdp_unsharded_param",
    "is_compiled",
    "local_shard",
    "local_tensor",
    "logger_step",
    "logger_version",
    "lr_scheduler_mark",
    "mark_checkpoint_saved",
    "metric_counters",
    "metric_state_names",
    "module_tables",
    "op_schema",
    "optimizer_unscales_itself",
    "parser_option_strings",
    "record_cuda_memory_history",
    "reset_grad_scaler",
    "run_validation",
    "saved_tensors",
    "saves_distributed_checkpoint",
    "scalar_read_op",
    "set_fsdp_collectives",
    "set_logger_version",
    "set_lr_scheduler_mark",
    "should_accumulate",
    "skip_next_validation",
    "storage_id",
    "tensor_parallel_size",
    "tensor_version",
    "thread_frames",
    "validation_due",
]


def is_compiled(module: Any) -> bool:
    """Whether Lightning was handed ``torch.compile(module)`` (it records the compiler in ``_compiler_ctx``)."""
    return getattr(module, "_compiler_ctx", None) is not None


def should_accumulate(trainer: Any) -> bool:
    """Whether the optimizer does not step after the current training batch (Lightning's own rule)."""
    return trainer.fit_loop._should_accumulate()


def logger_step(trainer: Any) -> int:
    """The step number Lightning gives the current training batch's rows in the loggers (the batches that stepped
    the optimizer before it; ``self.log`` values of the batch are logged under it)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel``."""
    return dict(getattr(strategy, "_ddp_kwargs", {}) or {})


def tensor_parallel_size(strategy: Any) -> int:
    """``ModelParallelStrategy``'s tensor-parallel size (1 when not set or ``"auto"``)."""
    size = getattr(strategy, "_tensor_parallel_size", 1)
    return size if isinstance(size, int) else 1


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether an ``FSDPStrategy`` or ``ModelParallelStrategy`` writes its checkpoint sharded (through
    ``torch.distributed.checkpoint``) rather than whole: ``_state_dict_type == "sharded"``, or
    ``_save_distributed_checkpoint``."""
    if hasattr(strategy, "_save_distributed_checkpoint"):
        return bool(strategy._save_distributed_checkpoint)
    return getattr(strategy, "_state_dict_type", "full") == "sharded"


def metric_state_names(metric: Any) -> list[str]:
    """The names of a torchmetrics ``Metric``'s states (``add_state``), in ``_defaults``."""
    return list(metric._defaults)


def reset_grad_scaler(scaler: Any, optimizer: Any) -> None:
    """Forget what a ``torch.amp.GradScaler`` recorded for ``optimizer`` in this step (unscaled, stepped).

    After a step that raised, the scaler would otherwise refuse the next one ("unscale_() has already been
    called on this optimizer since the last update()").
    """
    states = scaler._per_optimizer_states
    if id(optimizer) in states:
        del states[id(optimizer)]


def metric_counters(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s bookkeeping besides its states (updates counted, the cached result), by
    attribute name: copied and restored with the states so that a dropped attempt leaves no trace."""
    return {"_update_count": metric._update_count, "_computed": metric._computed}


def cluster_environment(trainer: Any) -> Any:
    """The Trainer's cluster environment (SLURM, torchelastic, ...), as Lightning detected it."""
    return trainer._accelerator_connector.cluster_environment


def mark_checkpoint_saved(callback: Any, step: int, path: str) -> None:
    """Tell a ``ModelCheckpoint`` that ``path`` was saved at ``step``, so it saves nothing more at this step
    (Lightning's own skip rule) nor again at train end (``save_last``)."""
    callback._last_global_step_saved = step
    callback._last_checkpoint_saved = path
    callback.last_model_path = path


def end_restart_at_epoch_end(trainer: Any) -> bool:
    """After ``fit`` resumed from a checkpoint written at an epoch's last batch, let the next epoch start as one.

    Lightning 2.6 marks that epoch done when it resets the fit loop, but keeps the loop's "restarted mid-epoch"
    stage into the next epoch: that epoch then never counts as started and its ``on_train_epoch_start`` hooks are
    skipped, and a checkpoint written in it resumes in another epoch. Call it after the reset (``on_train_start``).
    Returns whether it applied.
    """
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    if not (
        fit_loop.restarted_mid_epoch
        and epoch_loop.restarted_on_train_batch_end
        and epoch_loop.batch_progress.is_last_batch
    ):
        return False
    fit_loop.reset_restart_stage()
    return True


def validation_due(trainer: Any) -> bool:
    """Whether Lightning runs validation after the current training batch (its own rule, ``should_stop`` aside:
    call it before setting ``trainer.should_stop``, which makes every batch one)."""
    fit_loop = trainer.fit_loop
    return bool(fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher))


def skip_next_validation(trainer: Any) -> None:
    """Make the training loop skip the validation it would run after the current batch (a stop asks for one)."""
    trainer.fit_loop.epoch_loop._skip_next_val = True


def run_validation(trainer: Any, epoch: int) -> None:
    """Run the fit's validation now, as the training loop runs one after a batch of ``epoch`` (from a ``fit``
    hook; ``trainer.current_epoch`` reads ``epoch`` meanwhile: a resume counts a stopped epoch's last batch as
    the epoch's end before the first hook)."""
    loop = trainer.fit_loop.epoch_loop
    connector = trainer._logger_connector
    progress = trainer.fit_loop.epoch_progress.current
    first_loop_iter, completed = connector._first_loop_iter, progress.completed
    loop.val_loop.restarting = False  # a whole validation, not the rest of one
    progress.completed = epoch
    trainer.validating = True
    try:
        loop.val_loop.run()
    finally:
        trainer.training = True
        progress.completed = completed
        connector._first_loop_iter = first_loop_iter


def logger_version(logger: Any) -> Any:
    """The version a ``CSVLogger``/``TensorBoardLogger`` was given (``None``: it takes the next free
    ``version_N`` when first asked), without making it pick one."""
    return logger._version


def set_logger_version(logger: Any, version: str) -> None:
    """Give a ``CSVLogger``/``TensorBoardLogger`` its version (its folder's name) before it picks one."""
    logger._version = version


def continue_csv_metrics(logger: Any) -> None:
    """Make a ``CSVLogger`` append to the ``metrics.csv`` its folder holds instead of deleting it.

    Lightning's ``ExperimentWriter`` deletes the file when it is created over a folder that is not empty, and
    writes its header from the keys it has seen itself; the writer made here starts from the file's header.
    """
    import csv

    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    class _Continued(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            pass  # the folder is this run's: its metrics.csv is continued

    writer = _Continued(log_dir=logger.log_dir)
    if writer._fs.isfile(writer.metrics_file_path):
        with writer._fs.open(writer.metrics_file_path, "r", newline="") as file:
            writer.metrics_keys = list(next(csv.reader(file), []))
    logger._experiment = writer


def reload_val_loader(trainer: Any) -> None:
    """Build the fit's validation loader again at its next run (its datamodule's settings changed)."""
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def drop_train_loader(fit_loop: Any) -> None:
    """Make the fit loop rebuild the training DataLoader at the next epoch's start (new ``num_workers``)."""
    if hasattr(fit_loop, "_combined_loader"):
        fit_loop._combined_loader = None


def ddp_comm_hook_set(strategy: Any, ddp: Any) -> bool:
    """Whether a DDP communication hook is registered: on Lightning's ``DDPStrategy`` (``ddp_comm_hook=``, applied
    when the model is wrapped) or on the ``DistributedDataParallel`` module itself."""
    return getattr(strategy, "_ddp_comm_hook", None) is not None or bool(getattr(ddp, "_comm_hooks", None))


def fsdp_param_groups(root: Any) -> list[Any]:
    """FSDP2's parameter groups (``FSDPParamGroup``) of every ``fully_shard`` module inside ``root``, once each."""
    groups: list[Any] = []
    for sub in root.modules():
        state = sub._get_fsdp_state() if hasattr(sub, "_get_fsdp_state") else None
        if state is None:
            continue
        own = getattr(state, "_fsdp_param_groups", None)
        if own is None:  # torch before per-parameter meshes: one group per state
            own = [state._fsdp_param_group] if getattr(state, "_fsdp_param_group", None) is not None else []
        groups.extend(g for g in own if all(g is not seen for seen in groups))
    return groups


def fsdp_collectives(group: Any) -> tuple[Any, Any]:
    """An FSDP2 parameter group's all-gather and reduce-scatter, the callables FSDP calls for its collectives."""
    return group._all_gather_comm, group._reduce_scatter_comm


def set_fsdp_collectives(group: Any, all_gather: Any, reduce_scatter: Any) -> None:
    """Give an FSDP2 parameter group its all-gather and reduce-scatter (see :func:`fsdp_collectives`)."""
    group._all_gather_comm, group._reduce_scatter_comm = all_gather, reduce_scatter


def fsdp_unsharded_param(fsdp_param: Any) -> Any:
    """The unsharded parameter FSDP2 gathers for a forward or backward (``None`` before the first)."""
    return getattr(fsdp_param, "_unsharded_param", None)


def local_tensor(t: Any) -> Any:
    """A DTensor's local tensor (FSDP2's parameters, gradients and optimizer state, the object itself), else ``t``."""
    return getattr(t, "_local_tensor", t)


def local_shard(t: Any) -> Any:
    """The part of ``t`` this rank holds: a DTensor's local shard, else ``t`` itself. A view of the shard's storage:
    writing into it writes the DTensor."""
    to_local = getattr(t, "to_local", None)
    if not callable(to_local):
        return t
    import torch

    with torch.no_grad():
        return to_local()


def tensor_version(t: Any) -> int:
    """How often ``t`` was written in place (autograd's version counter)."""
    return t._version


def lr_scheduler_mark(step: Any) -> bool:
    """Whether ``optimizer.step`` carries the mark an LR scheduler puts on the ``step`` it wrapped."""
    return bool(getattr(step, "_wrapped_by_lr_sched", False))


def set_lr_scheduler_mark(step: Any) -> None:
    """Put the LR scheduler's mark on a ``step`` wrapper, so a scheduler created later does not warn about it."""
    step._wrapped_by_lr_sched = True


# --- torch (the memory layer: fake tensors, dispatch modes, the allocator) ------------------------------


def storage_id(storage: Any) -> int:
    """A storage's ``StorageImpl`` address (``_cdata``): tells storages apart, also on ``meta`` and fake tensors."""
    return storage._cdata


def op_schema(func: Any) -> Any:
    """An ATen operator overload's schema (``_schema``): its arguments and returns, with their alias info."""
    return func._schema


def scalar_read_op() -> Any:
    """``aten._local_scalar_dense.default``: the operator behind ``.item()``, which a fake tensor cannot answer."""
    import torch

    return torch.ops.aten._local_scalar_dense.default


def module_tables(module: Any) -> dict[str, dict[str, Any]]:
    """A module's own tables, by kind (``"parameters"``, ``"buffers"``, ``"modules"``): the dicts
    ``_parameters``, ``_buffers`` and ``_modules``, to swap and restore entries in place."""
    return {"parameters": module._parameters, "buffers": module._buffers, "modules": module._modules}


@contextlib.contextmanager
def first_items(container: Any, k: int) -> Iterator[None]:
    """Within the block, a ``ModuleList``/``Sequential`` holds only its first ``k`` items (its ``_modules``)."""
    saved = container._modules
    container._modules = {key: saved[key] for key in list(saved)[:k]}
    try:
        yield
    finally:
        container._modules = saved


def disable_current_modes() -> Any:
    """torch's context manager that runs code below every active dispatch mode (``_disable_current_modes``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def clear_cublas_workspaces() -> None:
    """Release the cuBLAS workspaces torch keeps per handle and stream (``torch._C._cuda_clearCublasWorkspaces``,
    when this torch has it): they are live allocations, which ``empty_cache`` cannot return."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def saved_tensors(node: Any) -> list[Any]:
    """What an autograd node saved for its backward, as it is held, without unpacking it.

    Reads the node's ``_raw_saved_*`` attributes (``torch._C._autograd.SavedTensor``; a list or tuple of them
    for ``cat``, ``stack`` or a custom Function) and their ``data``: the saved tensor itself, or what a
    ``saved_tensors_hooks`` pack hook returned (activation checkpointing's holder, an offloaded copy), without
    calling the unpack hook (which would recompute a checkpointed block). ``None`` entries (released by a
    backward that ran) are left out; the caller keeps the tensors among the rest.
    """
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = tuple(name for name in dir(node) if name.startswith("_raw_saved_"))
        _SAVED_NAMES[type(node)] = names
    out: list[Any] = []
    for name in names:
        try:
            raw = getattr(node, name)
        except RuntimeError:  # released after its backward ran
            continue
        for saved in raw if isinstance(raw, (list, tuple)) else (raw,):
            try:
                data = saved.data
            except (RuntimeError, AttributeError):
                continue
            if data is not None:
                out.append(data)
    return out


def attach_cuda_oom_observer(observer: Any) -> None:
    """Have ``observer(device, requested_bytes, limit_bytes, free_bytes)`` called by the CUDA caching allocator
    each time an allocation fails, before it raises (``torch._C._cuda_attach_out_of_memory_observer``). It has no
    detach: attach once per process."""
    import torch

    torch._C._cuda_attach_out_of_memory_observer(observer)


def record_cuda_memory_history(max_entries: int | None) -> None:
    """Record the CUDA allocator's allocations and frees, with their Python stacks (C++ stacks cost far more per
    allocation), in a ring buffer of ``max_entries`` events (``torch.cuda.memory._record_memory_history``);
    ``None`` stops recording."""
    import torch

    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the CUDA allocator's snapshot (segments, blocks, and the recorded history) as the pickle that
    pytorch.org/memory_viz opens (``torch.cuda.memory._dump_snapshot``)."""
    import torch

    torch.cuda.memory._dump_snapshot(path)


def thread_frames() -> dict[int, Any]:
    """The innermost Python frame of every thread, by thread id (``sys._current_frames``)."""
    import sys

    return sys._current_frames()


def batch_norm_types() -> tuple[type, ...]:
    """The base of every BatchNorm module (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, the lazy ones): torch's private
    ``_BatchNorm``, which ``isinstance`` checks need; the public classes as a fallback should it move."""
    from torch import nn

    base = getattr(nn.modules.batchnorm, "_BatchNorm", None)
    return (base,) if base is not None else (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def foreach_norm(tensors: list[Any], dtype: Any) -> list[Any]:
    """The L2 norm of each tensor in one fused kernel per device and dtype (``torch._foreach_norm``)."""
    import torch

    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def optimizer_unscales_itself(optimizer: Any) -> bool:
    """Whether an optimizer unscales AMP gradients inside its own ``step`` (fused Adam/AdamW mark themselves
    ``_step_supports_amp_scaling``); GradScaler then passes ``found_inf`` for it to skip on."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def dataloader_iterator_base() -> type:
    """The base class of every DataLoader iterator (single- and multi-process), whose ``__next__`` yields each
    batch: torch's private ``_BaseDataLoaderIter``."""
    from torch.utils.data import dataloader

    return dataloader._BaseDataLoaderIter


def parser_option_strings(parser: Any) -> list[str]:
    """Every option string an ``argparse`` parser (jsonargparse's too) accepts, from its private ``_actions``."""
    return [option for action in parser._actions for option in action.option_strings]
