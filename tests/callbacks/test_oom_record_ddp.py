"""The OOM record under DDP: two CPU processes over gloo, out of memory on rank 1 only.

Each rank keeps its own records and draws its own pictures; rank zero's report holds every rank's records and
its table compares the ranks.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest

from lightning_gpuopt import GPUOptReport, OOMRecovery
from lightning_gpuopt.report import summary_rows
from tests.callbacks.test_oom_recovery_ddp import LIMIT_AFTER, LIMITED_RANK, WideRegressor, ddp_fit


@pytest.mark.slow
def test_each_rank_records_its_own_ooms_and_the_table_compares_the_ranks(tmp_path):
    folder = tmp_path / "report"
    report = GPUOptReport(dirpath=str(folder), table=False)
    zero, one = ddp_fit(
        tmp_path, "run", WideRegressor("adam"), [OOMRecovery(verbose=False), report], rule="forward"
    )
    assert one["failures"] >= 1 and zero["failures"] == 0
    saved = json.loads((folder / "gpuopt_report.json").read_text())
    ooms = saved["ooms"]
    assert len(ooms) == one["failures"] and {r["rank"] for r in ooms} == {LIMITED_RANK}
    assert (
        all(r["step"] == LIMIT_AFTER and r["stage"] == "train" for r in ooms)
        and ooms[0]["phase"] == "forward"
    )
    assert all(
        abs(sum(r["categories"].values()) - r["allocated_bytes"]) <= 0.01 * r["allocated_bytes"] for r in ooms
    )
    assert ooms[0]["action"].startswith("micro-batch 128 → ")
    # Rank 1 drew its pictures, rank 0 drew none.
    assert (folder / f"oom_{LIMIT_AFTER}_rank1.png").is_file() and not list(folder.glob("oom_*_rank0*.png"))
    assert ooms[0]["picture"] == f"oom_{LIMIT_AFTER}_rank1.png"  # the gathered record names it
    assert [b["rank"] for b in saved["peak_breakdowns"]] == [0, 1]
    rows = dict(summary_rows(saved))
    assert rows["OOMs per rank"].startswith(f"0: none; 1: {len(ooms)}, up to ")


class EveryRankHearsItsError(pl.Callback):
    """Every process calls the callbacks' ``on_exception``, as under ``strategy="ddp"`` or torchrun (a spawned rank's
    error reaches only the launching process's callbacks)."""

    def setup(self, trainer, pl_module, stage):
        run = trainer.fit_loop.run

        def run_and_tell():
            try:
                return run()
            except BaseException as error:
                for callback in trainer.callbacks:
                    callback.on_exception(trainer, pl_module, error)
                raise

        trainer.fit_loop.run = run_and_tell


@pytest.mark.slow
def test_a_give_up_on_one_rank_leaves_that_ranks_records_beside_the_report(tmp_path, capsys):
    """Not even one sample fits on rank 1: every rank stops, nothing is gathered (a rank may be gone), and rank 1's
    records, written beside rank zero's report, are in what `gpuopt report` reads."""
    from lightning_gpuopt.cli import main
    from lightning_gpuopt.report import RANK_JSON_NAME, load_report

    folder = tmp_path / "report"
    report = GPUOptReport(dirpath=str(folder), table=False, plot=False)
    callbacks = [OOMRecovery(verbose=False), report, EveryRankHearsItsError()]
    with pytest.raises(Exception, match=r"ran out of memory|Out of memory"):
        ddp_fit(tmp_path, "fatal", WideRegressor("adam"), callbacks, rule="tiny")
    assert (folder / RANK_JSON_NAME.format(rank=LIMITED_RANK)).is_file()
    saved = load_report(folder)
    assert saved["run"]["ended_by"] == "error" and [p["rank"] for p in saved["run"]["rank_peaks"]] == [0, 1]
    ooms = saved["ooms"]
    assert ooms and {r["rank"] for r in ooms} == {LIMITED_RANK} and ooms[-1]["action"].startswith("gave up: ")
    main(["report", str(folder), "--no-plot"])
    listed = capsys.readouterr().out
    assert f"step {LIMIT_AFTER} rank {LIMITED_RANK} train" in listed and "gave up: " in listed
