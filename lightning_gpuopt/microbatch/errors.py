"""The errors the micro-batch engine ends a run with, each carrying what to do next."""

from __future__ import annotations

import torch

__all__ = [
    "LossWeightingError",
    "MicroBatchOOMError",
    "OptimizerStepOOMError",
    "RankOutOfMemoryError",
    "Refused",
    "WeightingCheckOutOfMemory",
]


class Refused(RuntimeError):
    """A training setup the engine cannot run; raised with the alternative named."""


class RankOutOfMemoryError(torch.OutOfMemoryError):
    """Another rank ran out of memory with nothing left to split: every rank stops with this error."""


class MicroBatchOOMError(torch.OutOfMemoryError):
    """Out of memory and nothing left to split: the message carries a memory breakdown and next steps."""


class LossWeightingError(ValueError):
    """No weighting of micro-batch losses reproduces the user's loss (or the given one does not, or the step's
    loss is not one number): the split is refused before it runs. A ``ValueError`` about the user's loss, not an
    out-of-memory error: code that catches OOM does not catch it, and the engine never retries it."""


class OptimizerStepOOMError(torch.OutOfMemoryError):
    """Out of memory inside ``optimizer.step`` (its state, its temporaries), where smaller micro-batches
    cannot help: the message names the optimizer state and the fixes. Every rank ends with it."""


class WeightingCheckOutOfMemory(torch.OutOfMemoryError):
    """The loss-weighting check ran out of memory on its two samples (rank 0's check, on every rank alike): the
    attempt loop retries the batch at a larger k like any OOM, and where no larger k is left, splits with the
    fallback weighting, saying in one line that it is unchecked and why."""
