"""Modules and instruments for the PrecisionSwitch tests: real CPU autocast, chosen trouble (data: oom_models.Waves)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

#: Multiplying the input by this overflows float16 (max 65504) but neither bfloat16 nor float32.
HUGE = 1e5


class Troubled(pl.LightningModule):
    """A small MLP whose trouble is chosen: the same function in every precision, until it is not.

    Args:
        overflow: ``(first, last)`` optimizer steps (``last`` excluded, ``None``: to the end) in which the
            first layer's input is scaled by :data:`HUGE` (and its output scaled back): float16 autocast
            overflows to inf, bfloat16 and float32 compute the same function as before.
        bad_in: ``"bf16"``: the loss is NaN whenever bfloat16 autocast is on (from ``overflow[0]`` on);
            ``"always"``: the loss is NaN in every precision in the ``overflow`` steps.
        rank: only this global rank is troubled (``None``: every rank).
        grad_boost: multiply the loss by this inside the graph but divide the logged value: larger
            gradients with a finite loss (they overflow float16 when scaled by the GradScaler).

    Records per ``training_step`` call: (global_step, batch_idx, precision, autocast dtype or None, ids).
    """

    def __init__(
        self,
        overflow: tuple[int, int | None] = (5, None),
        bad_in: str | None = None,
        rank: int | None = None,
        grad_boost: float = 1.0,
        lr: float = 0.05,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.overflow = overflow
        self.bad_in = bad_in
        self.rank = rank
        self.grad_boost = grad_boost
        self.lr = lr
        self.calls: list[tuple[int, int, str, str | None, list[int]]] = []

    def troubled(self) -> bool:
        first, last = self.overflow
        step = self.trainer.global_step
        in_window = step >= first and (last is None or step < last)
        return in_window and (self.rank is None or self.global_rank == self.rank)

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        self.calls.append(
            (
                self.trainer.global_step,
                batch_idx,
                self.trainer.precision,
                str(autocast).replace("torch.", "") if autocast else None,
                ids.tolist(),
            )
        )
        trouble = self.troubled()
        big = HUGE if trouble and self.bad_in is None else 1.0
        out = self.net[2](self.net[1](self.net[0](x * big) / big))
        loss = F.mse_loss(out.float(), y)
        if trouble and (self.bad_in == "always" or (self.bad_in == "bf16" and autocast == torch.bfloat16)):
            loss = loss * float("nan")
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss * self.grad_boost

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class AppliedSteps(pl.Callback):
    """The test hook: sees every optimizer step that is really applied (a torch step pre-hook).

    Counts applied steps with a non-finite gradient, and records (global_step, sample ids of the
    window) per applied step.
    """

    def __init__(self) -> None:
        self.applied: list[tuple[int, list[int]]] = []
        self.nonfinite_applied = 0
        self._trainer = None
        self._handle = None
        self._window: list[int] = []

    def on_fit_start(self, trainer, pl_module):
        self._trainer = trainer
        self._handle = trainer.optimizers[0].register_step_pre_hook(self._pre_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._window = []
        self._window.extend(batch[0].tolist())

    def _pre_step(self, optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.nonfinite_applied += 1
        self.applied.append((self._trainer.global_step, list(self._window)))

    def on_fit_end(self, trainer, pl_module):
        self._handle.remove()

    def steps(self) -> list[int]:
        return [step for step, _ in self.applied]

    def ids(self) -> list[int]:
        return [i for _, ids in self.applied for i in ids]


def finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())
