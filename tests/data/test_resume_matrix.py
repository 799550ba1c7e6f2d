"""Exact resume across its space: kill points in every epoch, loader workers (0, 1, 2, persistent or not, changed
between the legs), validation (off, at epoch end, mid-epoch), accumulation with the kill inside a window, a
schedule (per step, reading ``estimated_stepping_batches``, or per epoch), and three ways to die (an exception
where SIGKILL would strike, SIGTERM, a real SIGKILL), once or several times in one run.

Each cell runs tests/resume_child.py (64-true, dropout, random augmentation from torch, Python and NumPy): the
uninterrupted run, then the run stopped by the cell's faults and resumed from ``last.ckpt`` after each. The resumed
batches must be the uninterrupted run's at the same (epoch, batch_idx), each epoch must start (its
``on_train_epoch_start``) where that run's did, every sample once per epoch, and the parameters equal to rounding. The default suite runs a pairwise covering array of the factors (every pair of levels of
any two factors in some cell), the issue's 40-sample case, and one real SIGKILL; the slow suite adds a
derandomised Hypothesis sweep over the whole space, several faults in one run included.
"""

from __future__ import annotations

import collections
import itertools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_gpuopt.data.token_batches import TokenBatchSampler
from tests import resume_child
from tests.helpers import assert_same_training, parameters_of

LENGTH, EPOCHS = 40, 3
BATCHES = LENGTH // resume_child.BATCH  # per epoch
CHILD = Path(resume_child.__file__)


@dataclass(frozen=True)
class Cell:
    """One point of the space: the run's settings, and the faults that interrupt it (one per leg)."""

    workers: int = 0
    resume_workers: int | None = None  # the resumed legs' workers (None: the same)
    persistent: bool = False
    validation: str = "off"  # "off", "epoch" (at each epoch's end) or "mid" (every 4 batches too)
    accumulate: int = 1
    schedule: str = "none"  # "none", "onecycle" (per step, reads `estimated_stepping_batches`) or "epoch"
    faults: tuple[tuple[str, int], ...] = (("crash", 14),)  # (kind, batch over the whole run)
    max_tokens: int | None = None  # batches by tokens (TokenBatchSampler) instead of BATCH samples

    def args(self, workers: int) -> list[str]:
        out = ["--length", str(LENGTH), "--epochs", str(EPOCHS), "--workers", str(workers), "--record-epochs"]
        out += ["--accumulate", str(self.accumulate)]
        out += ["--persistent"] * self.persistent
        out += {"none": [], "onecycle": ["--onecycle"], "epoch": ["--epoch-schedule"]}[self.schedule]
        out += {"off": [], "epoch": ["--val"], "mid": ["--val-every", "4"]}[self.validation]
        out += [] if self.max_tokens is None else ["--max-tokens", str(self.max_tokens)]
        return out

    def reference_key(self) -> tuple[str, ...]:
        # The uninterrupted run's order does not depend on the workers (map-style data): one reference for all.
        return tuple(self.args(0))

    def __str__(self) -> str:
        resume = "" if self.resume_workers in (None, self.workers) else f"->{self.resume_workers}"
        faults = "+".join(f"{kind}@{batch}" for kind, batch in self.faults)
        return (
            f"{'' if self.max_tokens is None else f'tokens{self.max_tokens}-'}"
            f"w{self.workers}{resume}{'p' if self.persistent else ''}-val_{self.validation}-A{self.accumulate}"
            f"{'' if self.schedule == 'none' else '-' + self.schedule}-{faults}"
        )


def _leg(root: Path, args: list[str], fault: tuple[str, int] | None, resume: bool) -> None:
    argv = [str(root), *args, *(["--resume"] if resume else [])]
    if fault is None:
        resume_child.main(argv)
        return
    kind, batch = fault
    if kind == "crash":
        with pytest.raises(resume_child.Crash):
            resume_child.main([*argv, "--crash-batch", str(batch)])
    elif kind == "term":  # stops cleanly at the next optimizer-step boundary
        resume_child.main([*argv, "--term-batch", str(batch)])
    elif kind == "kill":
        done = subprocess.run(
            [sys.executable, str(CHILD), *argv, "--kill-batch", str(batch)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
        )
        assert done.returncode == -9, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        raise ValueError(kind)


def _ids(path: Path) -> dict[tuple[int, int], list[int]]:
    lines = path.read_text().split()
    return {
        (int(e), int(b)): [] if ids == "-" else [int(i) for i in ids.split(",")]
        for e, b, ids in zip(lines[::3], lines[1::3], lines[2::3])
    }


def _params(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "params.pt")


_REFERENCES: dict[tuple[str, ...], Path] = {}


def _reference(cell: Cell, base: Path) -> Path:
    key = cell.reference_key()
    if key not in _REFERENCES or not (_REFERENCES[key] / "params.pt").exists():
        root = base / f"ref{len(_REFERENCES)}"
        root.mkdir(parents=True)
        resume_child.main([str(root), *cell.args(0)])
        _REFERENCES[key] = root
    return _REFERENCES[key]


def check_cell(cell: Cell, base: Path, tmp: Path) -> None:
    """Run ``cell`` (each fault ends one leg; the last leg runs to the end) and compare with the reference."""
    reference = _reference(cell, base)
    run = tmp / "run"
    run.mkdir(parents=True)
    legs = []
    for n, fault in enumerate([*cell.faults, None]):
        workers = cell.workers if n == 0 or cell.resume_workers is None else cell.resume_workers
        _leg(run, cell.args(workers), fault, resume=n > 0)
        leg = run / f"leg{n}.txt"
        if (run / "ids_rank0.txt").exists():  # a leg resumed after the run's last step trains nothing
            (run / "ids_rank0.txt").rename(leg)
        legs.append(_ids(leg) if leg.exists() else {})
    merged: list[tuple[tuple[int, int], list[int]]] = []
    for n, this in enumerate(legs):
        # A leg's batches count up to where the next leg that trains starts again (after its last checkpoint).
        following = next((leg for leg in legs[n + 1 :] if leg), None)
        cut = min(following) if following else (1 << 30, 0)
        merged += [(key, ids) for key, ids in sorted(this.items()) if key < cut]
    expected = sorted(_ids(reference / "ids_rank0.txt").items())
    # An epoch's start is its batch -1: `on_train_epoch_start` runs where the uninterrupted run ran it.
    assert [key for key, _ in merged] == [key for key, _ in expected], (
        f"{cell}: batches or epoch starts elsewhere"
    )
    wrong = [key for (key, ids), (_, want) in zip(merged, expected) if ids != want]
    assert not wrong, (
        f"{cell}: {len(wrong)} of {len(expected)} batches differ from the uninterrupted run's, first at (epoch, batch_idx) {wrong[0]}"
    )
    for epoch in range(EPOCHS):
        seen = collections.Counter(i for (e, _), ids in merged if e == epoch for i in ids)
        assert seen == collections.Counter(range(LENGTH)), (
            f"{cell}: epoch {epoch} does not see each sample once"
        )
    pl.seed_everything(0, verbose=False)
    theta0 = parameters_of(resume_child.DropoutRegressor())  # only Δθ's scale: the measure is relative
    # 64-true with the exact order and RNG streams: the case's floor is 0 (equal to rounding, elementwise).
    assert_same_training(
        {n: p.double() for n, p in theta0.items()},
        _params(run),
        _params(reference),
        floor=0.0,
        elementwise=True,
    )


def _pairwise(factors: dict[str, list]) -> list[dict]:
    """A small covering array: every pair of levels of any two factors appears in some row (greedy, fixed)."""
    names = list(factors)
    columns = list(itertools.combinations(range(len(names)), 2))

    def pairs(row: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
        return {(i, row[i], j, row[j]) for i, j in columns}

    candidates = list(itertools.product(*(range(len(factors[n])) for n in names)))
    uncovered = set().union(*(pairs(row) for row in candidates))
    rows = []
    while uncovered:
        best = max(candidates, key=lambda row: len(pairs(row) & uncovered))  # the first best: deterministic
        uncovered -= pairs(best)
        rows.append({n: factors[n][best[i]] for i, n in enumerate(names)})
    return rows


#: Where a fault falls: epoch 0, epoch 1 and 2, the last batch of an epoch and the first of the next, inside an
#: accumulation window of A = 3 (windows are batches 0-2, 3-5, 6-8 and 9 of each epoch).
KILL_POINTS = [14, 9, 10, 19, 20, 25, 4, 28, 17, 11, 22, 7]

FACTORS = {
    "workers": [0, 1, 2],
    "resume_workers": [0, 1, 2],
    "persistent": [False, True],
    "validation": ["off", "epoch", "mid"],
    "accumulate": [1, 3],
    "schedule": ["none", "onecycle", "epoch"],
    "fault": ["crash", "term"],
}


def _covering_cells() -> list[Cell]:
    cells = []
    for n, row in enumerate(_pairwise(FACTORS)):
        fault = row.pop("fault")
        cells.append(Cell(**row, faults=((fault, KILL_POINTS[n % len(KILL_POINTS)]),)))
    return cells


COVERING = _covering_cells()

#: The issue's case: 40 samples, batch 4, killed at step 14 (epoch 1, 4 batches in), 1 and 2 workers.
ISSUE_CELLS = [Cell(workers=w, persistent=p, faults=(("crash", 14),)) for w in (1, 2) for p in (False, True)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return tmp_path_factory.mktemp("references")


def test_the_covering_array_covers_every_pair():
    # A pair left out would be a cell of the space no test runs.
    rows = [
        {**{k: getattr(c, k) for k in FACTORS if k != "fault"}, "fault": c.faults[0][0]} for c in COVERING
    ]
    for a, b in itertools.combinations(FACTORS, 2):
        assert {(r[a], r[b]) for r in rows} == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(COVERING) <= 16  # ~1.5 s a cell


#: Several faults in one run, each leg resumed from a checkpoint the previous resumed leg wrote. The first fault of
#: each falls where the last checkpoint is an epoch's last batch: the next leg starts an epoch from a resume.
SEVERAL_FAULTS = [
    Cell(faults=(("crash", 10), ("crash", 20))),
    Cell(workers=0, resume_workers=1, faults=(("crash", 10), ("crash", 15))),
    Cell(
        workers=1, resume_workers=2, schedule="epoch", validation="epoch", faults=(("term", 9), ("crash", 25))
    ),
]


@pytest.mark.parametrize("cell", ISSUE_CELLS + COVERING + SEVERAL_FAULTS, ids=str)
def test_resume_continues_the_uninterrupted_order_in_every_cell(cell, references, tmp_path):
    check_cell(cell, references, tmp_path)


#: Batches by tokens: 40 samples of 1 to 13 tokens, at most 24 padded tokens a batch (15 batches an epoch).
TOKENS = 24
TOKEN_BATCHES = TokenBatchSampler(resume_child.Augmented(LENGTH).lengths, TOKENS).batches_per_epoch


@pytest.mark.parametrize(
    "cell",
    [
        Cell(
            workers=workers, max_tokens=TOKENS, accumulate=accumulate, faults=((kind, 2 * TOKEN_BATCHES + 5),)
        )
        for workers, accumulate, kind in [(0, 1, "crash"), (2, 1, "term"), (2, 3, "crash")]
    ],
    ids=str,
)
def test_token_batches_resume_mid_epoch_2_in_the_uninterrupted_order(cell, references, tmp_path):
    check_cell(cell, references, tmp_path)


@pytest.mark.slow
def test_a_real_sigkill_in_epoch_2_inside_an_accumulation_window_with_workers(references, tmp_path):
    check_cell(
        Cell(workers=2, accumulate=3, validation="epoch", faults=(("kill", 23),)), references, tmp_path
    )


@pytest.mark.slow
@settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    workers=st.sampled_from([0, 1, 2]),
    resume_workers=st.sampled_from([0, 1, 2]),
    persistent=st.booleans(),
    validation=st.sampled_from(["off", "epoch", "mid"]),
    accumulate=st.sampled_from([1, 2, 3]),
    schedule=st.sampled_from(["none", "onecycle", "epoch"]),
    faults=st.lists(
        st.tuples(st.sampled_from(["crash", "term"]), st.integers(0, EPOCHS * BATCHES - 1)),
        min_size=1,
        max_size=3,
    ),
)
def test_resume_is_exact_across_the_whole_space(
    references,
    tmp_path_factory,
    workers,
    resume_workers,
    persistent,
    validation,
    accumulate,
    schedule,
    faults,
):
    # Each fault ends a leg; a later fault must fall after the batch the previous leg resumes from, or it would
    # strike before training restarts: keep them increasing and a window apart.
    points: list[tuple[str, int]] = []
    for kind, batch in sorted(faults, key=lambda f: f[1]):
        if not points or batch > points[-1][1] + accumulate:
            points.append((kind, batch))
    cell = Cell(workers, resume_workers, persistent, validation, accumulate, schedule, tuple(points))
    check_cell(cell, references, tmp_path_factory.mktemp("cell"))
