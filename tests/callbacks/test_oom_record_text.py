"""No OOM record text is cut: the record's texts, whatever their length, reach every place that shows them whole.

Swept with Hypothesis (derandomised) over what a record's texts can be (the action, the error, module names with
and without spaces, the snapshot's name) and the widths the picture's words are laid out in.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_gpuopt.oom_record import stop_reason
from lightning_gpuopt.report import format_oom, oom_listing, oom_rows
from lightning_gpuopt.report_plot import OOM_TEXT_WIDTH, _oom_text

MiB = 2**20
WORD = st.text(string.ascii_letters + string.digits + "._-()[]=/→", min_size=1, max_size=70)
SENTENCE = st.lists(WORD, min_size=1, max_size=60).map(" ".join)


def _record(action: str, message: str, modules: list[str], snapshot: str | None, split: bool) -> dict:
    categories = {"parameters": 3 * MiB, "gradients": 0, "optimizer_state": 6 * MiB, "activations": 20 * MiB}
    categories["other"] = 9 * MiB
    record = {
        "step": 3, "rank": 0, "stage": "train", "phase": "forward", "requested_bytes": MiB,
        "allocated_bytes": sum(categories.values()), "reserved_bytes": 40 * MiB, "limit_bytes": 40 * MiB,
        "categories": categories, "action": action, "message": message, "snapshot": snapshot,
        "modules": {"how": "measured at the OOM", "top": [{"module": m, "bytes": MiB} for m in modules]},
        "k": 1, "batch_size": 64, "micro_batch_size": 64,
    }  # fmt: skip
    if split:
        record["held_before_step"] = {"parameters": 3 * MiB, "optimizer_state": 6 * MiB, "other": 8 * MiB}
        record["held_before_step_bytes"] = 17 * MiB
        record["allocated_during_step_bytes"] = record["allocated_bytes"] - 17 * MiB
    return record


def _squeezed(text: str) -> str:
    return "".join(text.split())


@settings(derandomize=True, max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    action=SENTENCE,
    message=SENTENCE,
    modules=st.lists(st.one_of(WORD, SENTENCE), max_size=5),
    snapshot=st.one_of(st.none(), WORD),
    split=st.booleans(),
    width=st.integers(min_value=30, max_value=90),
)
def test_no_record_text_is_cut_in_the_picture_the_listing_or_the_table(
    action, message, modules, snapshot, split, width
):
    record = _record(action, message, modules, snapshot, split)
    words = _oom_text(record, None, width)
    assert all(len(line) <= width for line in words.splitlines()), words
    # Every text is there whole (its lines may break anywhere between its characters, never drop one).
    for text in (action, *modules, record["modules"]["how"], snapshot or ""):
        assert _squeezed(text) in _squeezed(words)
    full = format_oom(record, 0)
    for text in (action, message, *modules):
        assert text in full
    report = {"ooms": [record], "run": {"world_size": 1}}
    assert action in "\n".join(oom_listing(report))
    assert action in dict(oom_rows(report))["  last OOM"]
    assert "…" not in words + full


@pytest.mark.parametrize("length", [40, 159, 160, 161, 400, 2000])
def test_the_action_of_a_give_up_keeps_the_errors_first_sentence_whole(length):
    words = " ".join(f"w{i}" for i in range(length))[:length].strip()
    assert stop_reason(RuntimeError(f"{words}. Next steps: more.")) == f"gave up: {words}"


def test_the_pictures_words_fit_its_width_by_default():
    record = _record("x " * 200, "m", ["a" * 300, "b.c " * 40], "s" * 90, split=True)
    lines = _oom_text(record, None).splitlines()
    assert len(lines) > 10 and all(len(line) <= OOM_TEXT_WIDTH for line in lines)
