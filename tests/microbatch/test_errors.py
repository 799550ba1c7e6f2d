"""errors.py: what each error the engine ends a run with is, for code that catches it: out-of-memory errors are
``torch.OutOfMemoryError`` (and the pack's one OOM check says so), a refusal about the user's loss is a
``ValueError``, and a setup the engine cannot run is neither."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.memory import is_oom_error
from lightning_gpuopt.microbatch.errors import (
    LossWeightingError,
    MicroBatchOOMError,
    OptimizerStepOOMError,
    RankOutOfMemoryError,
    Refused,
    WeightingCheckOutOfMemory,
)

OUT_OF_MEMORY = [MicroBatchOOMError, OptimizerStepOOMError, RankOutOfMemoryError, WeightingCheckOutOfMemory]


@pytest.mark.parametrize("error", OUT_OF_MEMORY, ids=[e.__name__ for e in OUT_OF_MEMORY])
def test_the_out_of_memory_endings_are_out_of_memory_errors(error):
    assert issubclass(error, torch.OutOfMemoryError) and is_oom_error(error("no memory left"))


@pytest.mark.parametrize("error", [LossWeightingError, Refused], ids=["LossWeightingError", "Refused"])
def test_a_refusal_is_no_out_of_memory_error(error):
    assert not issubclass(error, torch.OutOfMemoryError) and not is_oom_error(error("refused"))
    with pytest.raises(error):  # code that catches OOM lets it pass
        try:
            raise error("refused")
        except torch.OutOfMemoryError:
            pytest.fail("caught as an out-of-memory error")


def test_a_loss_weighting_refusal_is_a_value_error_and_a_setup_refusal_a_runtime_error():
    assert issubclass(LossWeightingError, ValueError) and not issubclass(LossWeightingError, RuntimeError)
    assert issubclass(Refused, RuntimeError) and not issubclass(Refused, ValueError)
