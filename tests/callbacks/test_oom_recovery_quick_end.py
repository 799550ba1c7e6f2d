"""A quick, honest end: when no micro-batch can fit, OOMRecovery says so after a few attempts, with the minimum."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import MicroBatchOOMError, OOMRecovery
from lightning_gpuopt.memory import get_probe
from lightning_gpuopt.testing import SimulatedMemory
from tests.callbacks.oom_models import PlainWide, fit
from tests.helpers import TRAINER_QUIET

torchvision = pytest.importorskip("torchvision")
MiB = 2**20


class ResNet18(pl.LightningModule):
    """torchvision's ResNet-18 (BatchNorm) on 32x32 images with plain SGD: at 1x1 spatial size after layer4,
    BatchNorm cannot train on one sample."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torchvision.models.resnet18(num_classes=10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _images(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=n)


def test_an_infeasible_limit_ends_quickly_with_the_minimum_named():
    cb = OOMRecovery(verbose=False)
    trainer = pl.Trainer(max_steps=1, callbacks=[cb], **TRAINER_QUIET)
    with pytest.raises(
        MicroBatchOOMError, match=r"needs at least 2 sample\(s\) per micro-batch \(BatchNorm"
    ) as info:
        with SimulatedMemory(int(91.5 * MiB)):
            trainer.fit(ResNet18(), _images())
    assert 1 <= len(cb.failures) <= 4, [f.micro_batch_size for f in cb.failures]
    assert "parameters" in str(info.value) and "limit" in str(info.value)  # the breakdown


def test_min_micro_batch_size_bounds_the_split():
    model = PlainWide("adam")
    limit = _limit_for_micro_batch(model, 16)  # 16 samples per micro-batch fit, 32 do not
    cb = OOMRecovery(verbose=False, min_micro_batch_size=64)
    with pytest.raises(
        MicroBatchOOMError, match=r"at least 64 sample\(s\) per micro-batch \(min_micro_batch_size=64\)"
    ):
        fit(PlainWide("adam"), [cb], limit=limit, steps=2)
    assert min(f.micro_batch_size for f in cb.failures) >= 64


class LimitAt(pl.Callback):
    """Drops the SimulatedMemory limit at the start of one batch, after unlimited warm-up steps."""

    def __init__(self, batch_idx: int, limit: int) -> None:
        self.batch_idx, self.limit = batch_idx, limit

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx:
            get_probe().limit_bytes = self.limit


def _steady_peak(k: int, batch_size: int = 128) -> int:
    """The peak of steady steps (optimizer state created) at k micro-batches, unlimited."""
    cb = OOMRecovery(verbose=False, grow_back=False)
    cb.load_state_dict({"k": k})  # as if restored from a checkpoint at k
    return fit(PlainWide("adam"), [cb], steps=3, batch_size=batch_size).memory.peak


def test_recovery_converges_in_at_most_two_retries_at_a_feasible_limit():
    # As in benchmarks/oom_recovery.py: halfway between the steady peaks at k=1 and k=8, set after warm-up.
    limit = (_steady_peak(1) + _steady_peak(8)) // 2
    cb = OOMRecovery(verbose=False, grow_back=False)
    run = fit(PlainWide("adam"), [LimitAt(3, limit), cb], steps=6)
    assert run.trainer.global_step == 6
    assert 1 <= len(cb.failures) <= 2, [(f.k, f.micro_batch_size) for f in cb.failures]
    assert {f.step for f in cb.failures} == {3}


def test_an_error_below_every_size_that_ran_becomes_micro_batch_oom_error():
    class NeedsFour(PlainWide):
        def training_step(self, batch, batch_idx):
            if len(batch[0]) < 16:
                raise ValueError("this model needs 16 samples")
            return super().training_step(batch, batch_idx)

    # After unlimited steps of 64 samples, a limit between the steady peaks at 16 and at 8 samples per micro-batch.
    limit = (_steady_peak(4, batch_size=64) + _steady_peak(8, batch_size=64)) // 2
    cb = OOMRecovery(verbose=False, grow_back=False)
    with pytest.raises(
        MicroBatchOOMError, match=r"smaller than any that ran .*min_micro_batch_size=\d+"
    ) as info:
        fit(NeedsFour("adam"), [LimitAt(3, limit), cb], steps=6, batch_size=64)
    assert len(cb.failures) >= 1
    assert isinstance(info.value.__cause__, ValueError)


def _limit_for_micro_batch(model: pl.LightningModule, size: int) -> int:
    """A SimulatedMemory limit under which ``size`` samples per micro-batch fit and ``2 * size`` do not."""
    run = fit(model, [], steps=2, batch_size=size)
    small = run.memory.peak
    run = fit(type(model)("adam"), [], steps=2, batch_size=2 * size)
    return (small + run.memory.peak) // 2


class CudnnLimited(PlainWide):
    """Raises cuDNN's size error for micro-batches above ``largest`` samples (``largest=0``: always)."""

    def __init__(self, largest: int) -> None:
        super().__init__("adam")
        self.largest = largest

    def training_step(self, batch, batch_idx):
        if len(batch[0]) > self.largest:
            raise RuntimeError(f"cuDNN error: CUDNN_STATUS_NOT_SUPPORTED ({len(batch[0])} samples)")
        return super().training_step(batch, batch_idx)


def test_a_cudnn_size_error_shrinks_once_then_the_original_is_raised():
    cb = OOMRecovery(verbose=False, grow_back=False)
    run = fit(CudnnLimited(largest=64), [cb], steps=2)  # 128 samples: one shrink to 64 runs
    assert run.trainer.global_step == 2 and cb.k == 2 and len(cb.failures) == 1
    cb = OOMRecovery(verbose=False, grow_back=False)
    with pytest.raises(RuntimeError, match=r"CUDNN_STATUS_NOT_SUPPORTED \(128 samples\)"):
        fit(CudnnLimited(largest=0), [cb], steps=2)
    assert len(cb.failures) == 1  # shrunk once, then the first error
