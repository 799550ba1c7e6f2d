"""setup_checks.py: the training setups and strategies the engine refuses, each with the alternative named, driven
with stand-in Trainers (their optimizers and strategy) and unlaunched Lightning strategies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_gpuopt.microbatch.errors import Refused
from lightning_gpuopt.microbatch.setup_checks import check_strategy, check_supported


class Manual(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _trainer(module, optimizers=None, strategy=None) -> SimpleNamespace:
    if optimizers is None:
        optimizers = [torch.optim.SGD(module.parameters(), lr=0.1)]
    return SimpleNamespace(optimizers=optimizers, strategy=strategy or SingleDeviceStrategy("cpu"))


def _ddp(model, **kwargs) -> DDPStrategy:
    strategy = DDPStrategy(**kwargs)
    strategy.model = model
    return strategy


def test_one_first_order_optimizer_under_automatic_optimization_on_one_device_runs():
    module = BoringModel()
    check_supported(_trainer(module), module)


@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("manual", r"^Micro-batching needs automatic optimization, but the LightningModule sets"),
        (
            "two optimizers",
            r"^Micro-batching supports exactly one optimizer, got 2\. Combine the parameter groups",
        ),
        (
            "LBFGS",
            r"^Micro-batching cannot run closure optimizers such as LBFGS .* Use a first-order optimizer",
        ),
    ],
    ids=["manual", "two optimizers", "LBFGS"],
)
def test_what_micro_batching_cannot_run_is_refused_naming_what_to_do(case, text):
    module = Manual() if case == "manual" else BoringModel()
    optimizers = {
        "manual": None,
        "two optimizers": [torch.optim.SGD(module.parameters(), lr=0.1)] * 2,
        "LBFGS": [torch.optim.LBFGS(module.parameters())],
    }[case]
    with pytest.raises(Refused, match=text):
        check_supported(_trainer(module, optimizers), module)


def test_ddp_settings_that_would_communicate_inside_an_attempt_are_refused():
    module = BoringModel()
    check_strategy(_ddp(torch.nn.Linear(2, 2)), module)  # plain DDP runs
    with pytest.raises(Refused, match=r"`static_graph=True`.* Use DDPStrategy\(static_graph=False\)"):
        check_strategy(_ddp(SimpleNamespace(static_graph=True)), module)
    with pytest.raises(Refused, match=r"a DDP communication hook \(`ddp_comm_hook`\) would never run"):
        check_strategy(_ddp(torch.nn.Linear(2, 2), ddp_comm_hook=lambda state, bucket: None), module)
    synced = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.SyncBatchNorm(2))
    with pytest.raises(
        Refused, match=r"^Micro-batching under DDP cannot run SyncBatchNorm.*sync_batchnorm=False"
    ):
        check_strategy(_ddp(synced), synced)
