"""A checkpoint written by an earlier version of the pack resumes exactly (tests/fixtures/README.md).

The fixture was written at commit 6b38dc6 by tests/resume_child.py, SIGKILLed after its step 2 with OOMRecovery at
k = 3. Resumed by this version, the run must go on with the next batch, the same k (no new OOM, search or check)
and the random streams of the checkpoint, and end with the parameters of this version's uninterrupted run.
"""

from __future__ import annotations

import json
import shutil

import torch

from tests import resume_child
from tests.helpers import REPO

FIXTURE = REPO / "tests" / "fixtures" / "resume_child_6b38dc6.ckpt"
ARGS = ["--hidden", "512", "--batch-size", "16", "--workers", "2", "--oom-limit", "325885", "--oom-from", "1"]


def _ids(path) -> dict[tuple[int, int], list[int]]:
    lines = path.read_text().split()
    return {(int(e), int(b)): ids for e, b, ids in zip(lines[::3], lines[1::3], lines[2::3])}


def test_a_checkpoint_of_6b38dc6_resumes_exactly(tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    resume_child.main([str(reference), *ARGS])
    (run / "ckpt").mkdir(parents=True)
    shutil.copy(FIXTURE, run / "ckpt" / "last.ckpt")
    resume_child.main([str(run), *ARGS, "--resume"])

    expected = _ids(reference / "ids_rank0.txt")
    resumed = _ids(run / "ids_rank0.txt")
    assert resumed == {key: ids for key, ids in expected.items() if key >= (0, 2)}
    changes = [
        d["message"]
        for d in json.loads((run / "decisions_rank0.json").read_text())
        if d["kind"] in ("oom", "micro-batches", "batch size", "loss weighting")
    ]
    assert changes == ["restored from checkpoint: k 1 -> 3"]
    params, reference_params = (torch.load(root / "params.pt") for root in (run, reference))
    for name, value in reference_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-12, msg=name)
