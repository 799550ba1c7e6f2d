"""The support table: one answer per feature × strategy × torch × compiled, read by everything, equal to the docs."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

from lightning_gpuopt import FSDP2Strategy
from lightning_gpuopt.support import Feature, StrategyKind, markdown_table, strategy_kind, supports
from tests.helpers import REPO

DOCS = REPO / "docs" / "support.md"


@pytest.mark.parametrize(("page", "reasons"), [("support.md", True), ("multi-gpu.md", False)])
def test_the_docs_table_is_the_support_module(page, reasons):
    text = (DOCS.parent / page).read_text()
    start, end = "<!-- support-table:start -->\n", "\n<!-- support-table:end -->"
    assert start in text and end in text, f"docs/{page} lost its table markers"
    documented = text.split(start, 1)[1].split(end, 1)[0]
    assert documented == markdown_table(reasons=reasons), (
        f"docs/{page} is stale: paste support.markdown_table(reasons={reasons}) between the markers"
    )


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [
        (SingleDeviceStrategy("cpu"), StrategyKind.SINGLE_DEVICE),
        (DDPStrategy(), StrategyKind.DDP),
        (FSDP2Strategy(), StrategyKind.FSDP2),
        (FSDPStrategy(), StrategyKind.FSDP1),
        (
            DeepSpeedStrategy.__new__(DeepSpeedStrategy),
            StrategyKind.DEEPSPEED,
        ),  # no deepspeed needed to classify
    ],
    ids=("single", "ddp", "fsdp2", "fsdp1", "deepspeed"),
)
def test_strategies_are_classified_by_type_not_by_name(strategy, kind):
    assert strategy_kind(strategy) is kind


def test_every_cell_has_an_answer_and_a_reason():
    for feature in Feature:
        for kind in StrategyKind:
            for compiled in (False, True):
                answer = supports(feature, kind, compiled=compiled)
                assert answer.reason, (feature, kind, compiled)


@pytest.mark.parametrize("feature", [Feature.OOM_RECOVERY, Feature.BATCH_SIZE_SEARCH])
def test_fsdp2_recovery_and_batch_size_search_depend_on_the_torch_version(feature):
    """Both stop a rank's step mid-way under FSDP2 (an OOM), which only FSDPModule.reset_iter_state undoes."""
    assert supports(feature, StrategyKind.FSDP2, torch="2.14.0").supported
    old = supports(feature, StrategyKind.FSDP2, torch="2.11.0")
    assert not old.supported and "2.11.0" in old.reason and "upgrade torch" in old.reason
    assert "reset_iter_state" in old.reason


def test_lightning_refuses_a_compiled_module_under_model_parallel_for_every_feature():
    for feature in Feature:
        answer = supports(feature, StrategyKind.FSDP2, compiled=True)
        assert not answer.supported and "ModelParallelStrategy" in answer.reason
    for feature in Feature:  # a compiled LightningModule runs every feature on one device and under DDP
        assert supports(feature, StrategyKind.DDP, compiled=True).supported
        assert supports(feature, StrategyKind.SINGLE_DEVICE, compiled=True).supported
