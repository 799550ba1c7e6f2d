"""FSDP2Strategy() with its defaults on encoder-decoders, 2 CPU ranks (gloo), and `gpuopt plan` naming the same units.

The repeated-block rule picked an encoder's and a decoder's ModuleLists as units, and ``fully_shard`` stopped
with "does not support containers that do not implement forward: ModuleList" (issue 26). Each run is a script
(``fsdp2_defaults_run.py``: Lightning's launcher starts rank 1 by running it again).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from lightning_gpuopt.cli import main
from tests.helpers import run_ranks

SCRIPT = Path(__file__).with_name("fsdp2_defaults_run.py")
MODELS = {"demo": "DemoTransformer", "t5": "TinyT5"}
EXPECTED = {
    "demo": Counter({"TransformerEncoderLayer": 2, "TransformerDecoderLayer": 2}),
    "t5": Counter({"T5Block": 4}),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def run(request, tmp_path_factory) -> tuple[str, list[dict]]:
    if request.param == "t5":
        pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp(request.param)
    return request.param, run_ranks(SCRIPT, out, request.param, timeout=300)


def test_both_ranks_train_with_the_encoder_and_decoder_layers_as_units(run):
    model, (zero, one) = run
    assert zero["steps"] == one["steps"] == 3 and zero["strategy"] == "FSDP2Strategy"
    assert zero["units"] == one["units"]
    assert Counter(kind for _, kind in zero["units"]) == EXPECTED[model]
    assert (
        zero["micro_batch_size"] == one["micro_batch_size"] >= 1
    )  # MemoryAwareBatchSize searched and agreed


@pytest.mark.usefixtures("cli_argv")
def test_gpuopt_plan_names_the_units_the_strategy_sharded(run, capsys):
    model, (zero, _) = run
    klass = f"tests.strategy.fsdp2_defaults_run.{MODELS[model]}"
    data = "tests.strategy.fsdp2_defaults_run.Tokens"
    common = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--gpuopt.device_memory", "1GB"]
    main(["plan", "--model", klass, "--data", data, *common])
    note = next(line for line in capsys.readouterr().out.splitlines() if "full sharding gathers" in line)
    one_kind = re.search(r"gathers one (\w+) at a time \((\d+) units\)", note)
    if one_kind:
        planned = Counter({one_kind[1]: int(one_kind[2])})
    else:
        planned = Counter({kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", note.split("units:")[1])})
    assert planned == Counter(kind for _, kind in zero["units"]), note
