"""``None`` from ``training_step`` under DDP: Lightning's own error, on every rank, and no rank left waiting.

Two CPU processes over gloo (``ddp_skip_run.py``), split in two micro-batches; only rank 1's step returns
``None``, at its second batch. The ranks' vote carries the skip, so rank 0 (whose step returned a loss) stops
at the same batch with the same error instead of waiting in the next collective (a hang would end the test at
``run_ranks``' timeout).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_ranks

LIGHTNINGS_ERROR = "Skipping the `training_step` by returning None in distributed training is not supported."


@pytest.mark.slow
def test_none_under_ddp_gets_lightnings_own_error_on_every_rank(tmp_path):
    ranks = run_ranks(Path(__file__).with_name("ddp_skip_run.py"), tmp_path, expect_failure=True)
    for rank, raised in enumerate(ranks):
        kind, message = raised["error"]
        assert (kind, raised["type"], raised["step"]) == ("RuntimeError", "builtins", 1), rank
        assert message.startswith(LIGHTNINGS_ERROR) and "\n" not in message, rank
