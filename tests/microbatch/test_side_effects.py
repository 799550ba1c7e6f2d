"""attempt.py: one attempt's side effects, driven directly: BatchNorm statistics snapshot and restored, an attempt's
``self.log`` calls emitted once as if the batch had run whole, gradients of an accumulation window kept apart."""

from __future__ import annotations

import torch
from torch import nn

from lightning_gpuopt.microbatch.side_effects import (
    Attempt,
    SideEffects,
    batch_samples,
    emit_logs,
    merge_grads,
    restore_grads,
    split_output,
)


def test_a_failed_attempts_batch_norm_statistics_are_put_back():
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False))
    effects = SideEffects(module)
    assert effects.norms == [module[1]]  # a norm without running statistics has nothing to put back
    before = {name: buf.clone() for name, buf in module[1].named_buffers()}
    snapshot = effects.snapshot()
    module(torch.randn(8, 3))
    assert not torch.equal(module[1].running_mean, before["running_mean"])
    SideEffects.restore(snapshot)
    for name, buf in module[1].named_buffers():
        assert torch.equal(buf, before[name]), name
    assert effects.nbytes() == 4 * 4 * 2 + 8  # running mean and variance (float32), the batch count (int64)


def test_logs_are_emitted_once_weighted_by_the_micro_batches_share():
    attempt = Attempt()
    for value, weight in ((1.0, 0.75), (5.0, 0.25)):  # two micro-batches of 6 and 2 samples
        attempt.start()
        attempt.calls.append(("loss", torch.tensor(value), (), {"batch_size": 6}))
        attempt.calls.append(("seen", torch.tensor(value), (), {}))
        attempt.calls.append(("note", "text", (), {}))
        attempt.keep(weight)
    emitted = []
    emit_logs(
        lambda name, value, *a, **kw: emitted.append((name, value, kw)),
        attempt.logs,
        [0.75, 0.25],
        8,
        {"seen"},
    )
    by_name = {name: (value, kw) for name, value, kw in emitted}
    assert by_name["loss"][0].item() == 2.0 and by_name["loss"][1] == {"batch_size": 8}  # the whole batch's
    assert by_name["seen"][0].item() == 6.0  # summed
    assert by_name["note"][0] == "text" and len(emitted) == 3  # once each


def test_an_accumulation_windows_earlier_gradients_are_kept_apart_and_added_back():
    p = nn.Parameter(torch.zeros(2))
    earlier = torch.ones(2)
    p.grad = torch.full((2,), 5.0)  # a failed attempt's
    restore_grads([p], [earlier.clone()])
    assert torch.equal(p.grad, earlier)
    p.grad = torch.full((2,), 2.0)  # a kept attempt's
    merge_grads([p], [earlier.clone()])
    assert torch.equal(p.grad, torch.full((2,), 3.0))
    p.grad = torch.full((2,), 2.0)
    merge_grads([p], None)  # the first batch of its window: nothing kept apart
    assert torch.equal(p.grad, torch.full((2,), 2.0))


def test_a_step_output_and_a_batch_as_the_engine_reads_them():
    loss = torch.tensor(1.0)
    assert split_output({"loss": loss, "acc": 3}) == (loss, {"acc": 3}) and split_output(loss) == (loss, None)
    assert batch_samples(torch.zeros(5, 2)) == 5 and batch_samples(torch.tensor(3.0)) == 1
