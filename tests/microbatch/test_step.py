"""step.py: the one wrapper of ``optimizer.step``, driven directly with a stand-in Trainer (its optimizers, strategy,
step and precision plugin) and optimizers that run out of memory where a test says: guards hold a step back, an
OOM inside the step is retried once only while nothing was written, else ``OptimizerStepOOMError``; every rank's
vote after the step stops them all when one could not step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_gpuopt.decisions import decisions
from lightning_gpuopt.microbatch.errors import OptimizerStepOOMError
from lightning_gpuopt.microbatch.step import OptimizerStepHook
from lightning_gpuopt.votes import Status, Vote


class FailingSGD(torch.optim.SGD):
    """SGD with momentum whose first ``fail`` steps run out of memory: after creating the momentum state (a new
    tensor, as Adam's first step does) or, with ``write``, after writing a parameter."""

    def __init__(self, params, fail: int = 1, write: bool = False) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.fail, self.write, self.calls, self.seen_state = fail, write, 0, []

    def step(self, closure=None):
        self.calls += 1
        self.seen_state.append(sum(len(s) for s in self.state.values()))
        if self.calls <= self.fail:
            p = self.param_groups[0]["params"][0]
            self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            if self.write:
                with torch.no_grad():
                    p.add_(1.0)  # a new _version: the step began writing
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().step(closure)


def _trainer(optimizer) -> SimpleNamespace:
    strategy = SimpleNamespace(optimizer_step=lambda optimizer, closure, *a, **kw: optimizer.step(closure))
    return SimpleNamespace(
        optimizers=[optimizer], strategy=strategy, global_step=3, precision_plugin=SimpleNamespace()
    )


def _parameter() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    return p


def _with_recovery(optimizer, votes=None):
    trainer = _trainer(optimizer)
    hook = OptimizerStepHook.attach(trainer, "engine")
    hook.recovery = lambda: lambda status, k: votes or [Vote(status, k)]
    return trainer, hook


def test_a_guard_holds_the_step_back_after_the_closure_ran_and_later_guards_are_not_asked():
    p = _parameter()
    optimizer = torch.optim.SGD([p], lr=0.1)
    hook = OptimizerStepHook.attach(_trainer(optimizer), "switch")
    asked = []

    def hold(opt, loss):
        asked.append(("hold", loss.item()))
        return True

    hook.add_guard(hold)
    hook.add_guard(hold)  # once
    hook.add_guard(lambda opt, loss: asked.append("later") or False)
    assert len(hook.guards) == 2
    assert optimizer.step(lambda: torch.tensor(2.5)).item() == 2.5
    assert asked == [("hold", 2.5)] and torch.equal(p, torch.ones(4))  # held back: unchanged
    hook.remove_guard(hold)
    optimizer.step(lambda: torch.tensor(1.0))
    assert asked[-1] == "later" and torch.equal(p, torch.full((4,), 0.9))


def test_without_recovery_an_oom_in_the_step_propagates_unchanged():
    optimizer = FailingSGD([_parameter()])
    OptimizerStepHook.attach(_trainer(optimizer), "switch")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as caught:
        optimizer.step()
    assert type(caught.value) is torch.OutOfMemoryError and optimizer.calls == 1


def test_an_oom_before_the_step_wrote_anything_is_retried_once_without_its_half_made_state():
    p = _parameter()
    optimizer = FailingSGD([p])
    trainer, hook = _with_recovery(optimizer)
    optimizer.step()
    assert optimizer.calls == 2 and optimizer.seen_state == [
        0,
        0,
    ]  # the retry started without the partial state
    assert torch.equal(p, torch.full((4,), 0.9)) and hook.retried_steps == 1
    [decision] = decisions(trainer)
    assert (
        decision.kind == "oom"
        and "optimizer step 3 ran out of memory before it wrote anything" in decision.message
    )


def test_an_oom_after_the_step_wrote_or_in_its_retry_ends_the_run():
    optimizer = FailingSGD([_parameter()], write=True)
    _with_recovery(optimizer)
    with pytest.raises(
        OptimizerStepOOMError, match="after it had begun writing its state or the parameters, so it"
    ):
        optimizer.step()
    assert optimizer.calls == 1  # not retried
    twice = FailingSGD([_parameter()], fail=2)
    _with_recovery(twice)
    with pytest.raises(
        OptimizerStepOOMError, match=r"before it wrote anything: .*; retried once after freeing memory"
    ):
        twice.step()
    assert twice.calls == 2


@pytest.mark.parametrize(
    ("other", "error", "text"),
    [
        (
            Status.OOM | Status.FATAL,
            OptimizerStepOOMError,
            r"Rank\(s\) 1 ran out of memory in the optimizer step",
        ),
        (Status.FATAL, RuntimeError, r"Rank\(s\) 1 failed in the optimizer step"),
    ],
    ids=["oom", "other error"],
)
def test_a_rank_that_could_not_step_stops_every_rank_at_the_vote_after_the_step(other, error, text):
    optimizer = torch.optim.SGD([_parameter()], lr=0.1)
    trainer, _ = _with_recovery(optimizer, votes=[Vote(0, 0), Vote(int(other), 0)])
    with pytest.raises(error, match=text):
        trainer.strategy.optimizer_step(optimizer, None)
    fine = torch.optim.SGD([_parameter()], lr=0.1)
    trainer, _ = _with_recovery(fine, votes=[Vote(0, 0), Vote(0, 0)])
    trainer.strategy.optimizer_step(fine, None)


def test_the_last_user_to_release_unwraps_the_optimizer_and_the_strategy():
    optimizer = torch.optim.SGD([_parameter()], lr=0.1)
    trainer = _trainer(optimizer)
    hook = OptimizerStepHook.attach(trainer, "engine")
    assert OptimizerStepHook.attach(trainer, "switch") is hook is OptimizerStepHook.get(trainer)
    assert "step" in vars(optimizer) and "optimizer_step" in vars(trainer.strategy)
    hook.release("engine")
    assert "step" in vars(optimizer)  # the switch still uses it
    hook.release("switch")
    assert "step" not in vars(optimizer) and OptimizerStepHook.get(trainer) is None
