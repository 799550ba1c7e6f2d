"""The pure rules of the loss weighting (microbatch/loss_weighting_rules.py): candidates, the choice, ties, tolerance,
HF head detection, the two samples the check runs on; and LossWeighting's arguments and checkpoint state."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_gpuopt.batch_split import batch_size_of
from lightning_gpuopt.microbatch.loss_weighting import CheckSite, LossWeighting
from lightning_gpuopt.microbatch.loss_weighting_rules import (
    Candidate,
    HFHead,
    Weighting,
    candidates,
    check_pair,
    choose,
    hf_head,
    piece_of,
    tolerance,
)


def _batch(lengths: list[int], width: int = 6) -> dict[str, torch.Tensor]:
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    labels = torch.ones(len(lengths), width, dtype=torch.long).masked_fill(mask == 0, -100)
    return {"input_ids": torch.ones_like(labels), "attention_mask": mask, "labels": labels}


def _token_mean(per_sample_loss: list[float], lengths: list[int], shift: int = 0) -> float:
    counts = [n - shift for n in lengths]
    return sum(v * c for v, c in zip(per_sample_loss, counts)) / sum(counts)


def test_the_token_mean_is_found_and_sample_shares_are_not():
    short, long = _batch([1, 2]), _batch([6, 5, 6])
    losses = [1.0, 2.0]  # each part's token mean
    piece = _token_mean(losses, [3, 17])  # the piece's token mean: tokens of both parts
    result = choose(piece, losses, [short, long], candidates(short), 1e-6)
    assert result.chosen.kind is Weighting.TOKENS and not result.tied
    assert result.errors["sample shares"] > 1e-2


def test_the_shifted_token_mean_of_a_causal_lm_is_found():
    parts = [_batch([2, 3]), _batch([6, 6, 5])]
    losses = [1.0, 3.0]
    piece = (1.0 * 3 + 3.0 * 14) / 17  # labels[:, 1:]: (1 + 2) and (5 + 5 + 4) tokens
    assert choose(piece, losses, parts, candidates(parts[0]), 1e-6).chosen.kind is Weighting.TOKENS_SHIFTED


def test_a_loss_nothing_reproduces_is_a_mismatch():
    parts = [_batch([2]), _batch([6, 6, 5])]
    result = choose(7.0, [1.0, 3.0], parts, candidates(parts[0]), 1e-6)
    assert result.chosen is None and result.mismatch > 0.1
    assert result.mismatch == min(result.errors.values())  # the refusal reports the nearest candidate


def test_a_tie_goes_to_the_hf_head_else_to_sample_shares_with_the_tie_reported():
    parts = [_batch([2]), _batch([6, 6, 5])]
    losses = [2.0, 2.0]  # equal parts' losses: every mean candidate reproduces the piece's loss
    by_head = choose(2.0, losses, parts, candidates(parts[0]), 1e-6, head=HFHead.CAUSAL_LM)
    assert by_head.tied and by_head.chosen.kind is Weighting.TOKENS_SHIFTED
    plain = choose(2.0, losses, parts, candidates(parts[0]), 1e-6)
    assert plain.tied and plain.chosen.kind is Weighting.SAMPLES


def test_candidates_that_count_alike_on_every_sample_are_no_tie():
    parts = [_batch([6]), _batch([6, 6, 6])]  # full length: samples and tokens count alike
    result = choose(2.0, [1.0, 7 / 3], parts, candidates(parts[0])[:2], 1e-6)
    assert result.chosen.kind is Weighting.SAMPLES and not result.tied


def test_tolerance_per_precision():
    assert tolerance("64-true") == 1e-6
    assert tolerance("32-true") == tolerance(None) == 2e-5
    assert tolerance("16-mixed") == 1e-2
    assert tolerance("bf16-true") == 4e-2
    assert tolerance("64-true", torch.bfloat16) == 4e-2


def test_hf_head_from_class_names_without_importing_transformers():
    def fake(name: str) -> type:
        base = type("PreTrainedModel", (nn.Module,), {})
        return type(name, (base,), {})

    assert hf_head(nn.Sequential(nn.Linear(2, 2), fake("GPT2LMHeadModel")())) is HFHead.CAUSAL_LM
    assert hf_head(fake("LlamaForCausalLM")()) is HFHead.CAUSAL_LM
    assert hf_head(fake("BertForMaskedLM")()) is HFHead.MASKED_LM
    assert hf_head(fake("BertForTokenClassification")()) is HFHead.TOKEN_CLASSIFICATION
    assert hf_head(fake("BertForSequenceClassification")()) is HFHead.SEQUENCE_CLASSIFICATION
    assert hf_head(fake("BertModel")()) is None
    assert hf_head(nn.Linear(2, 2)) is None


def test_the_package_does_not_import_transformers():
    import lightning_gpuopt.microbatch.loss_weighting_rules as lw

    with open(lw.__file__) as f:
        source = f.read()
    assert "import transformers" not in source and "from transformers" not in source


def test_weights_of_a_sum_and_an_empty_count():
    chunks = [_batch([2]), _batch([3])]
    assert Candidate(Weighting.SUM, "sum").weights(chunks) == [1.0, 1.0]
    empty = [{"labels": torch.full((1, 3), -100)}] * 2
    with pytest.raises(ValueError, match="sum to 0"):
        Candidate(Weighting.TOKENS, "tokens", "labels").weights(empty)


def test_bad_arguments_and_checkpoint_state():
    with pytest.raises(ValueError, match="`loss_reduction` must be one of"):
        LossWeighting("avg")
    with pytest.raises(ValueError, match="`on_mismatch` must be one of"):
        LossWeighting(on_mismatch="ignore")
    restored = LossWeighting()
    restored.load_state_dict(
        {"checked": True, "kind": "tokens-shifted", "description": "d", "key": "labels", "ignore_index": -100}
    )
    assert restored.decided.kind is Weighting.TOKENS_SHIFTED
    assert restored.state_dict()["kind"] == "tokens-shifted"


def test_the_check_runs_on_the_shortest_and_the_longest_sample_that_count_something():
    # Token counts 3, 1, 6, 2, 5 (labels); shifted by one: 2, 0, 5, 1, 4. Sample 1 counts nothing shifted.
    batch = _batch([3, 1, 6, 2, 5])
    assert check_pair(batch, candidates(batch)) == (3, 2)
    assert batch_size_of(piece_of(batch, candidates(batch))) == 2
    assert piece_of(batch, candidates(batch))["labels"].ne(-100).sum(1).tolist() == [2, 6]


def test_the_pair_separates_candidates_that_differ_on_the_batch():
    # Labels count 1, 2, 4, 3 tokens (shifted: 0, 1, 3, 2, so sample 0 is out); the attention mask 2, 4, 4, 6.
    # The shortest and longest by the shifted count, samples 1 and 2, hold 4 mask tokens each: mask tokens
    # and samples would tie on them, though they differ on the batch. Samples 2 and 3 tell all four apart.
    labels = torch.tensor(
        [[1, -100, -100, -100, -100, -100]] + [[1] * 2 + [-100] * 4] + [[1] * 4 + [-100] * 2] * 2
    )
    labels[3, 3] = -100
    mask = (torch.arange(6)[None, :] < torch.tensor([2, 4, 4, 6])[:, None]).long()
    batch = {"input_ids": torch.ones_like(labels), "attention_mask": mask, "labels": labels}
    options = candidates(batch)
    i, j = check_pair(batch, options)
    shares = []
    for option in options[:-1]:  # all but the sum
        a, b = (option.count({k: v[n : n + 1] for k, v in batch.items()}) for n in (i, j))
        shares.append(a / (a + b))
    assert all(abs(x - y) > 1e-9 for n, x in enumerate(shares) for y in shares[n + 1 :]), (i, j, shares)


def test_a_batch_without_tokens_checks_its_first_two_samples():
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    assert check_pair(batch, candidates(batch)) == (0, 1)


def test_a_tie_without_sample_shares_among_the_candidates_keeps_the_first_and_says_tied():
    """Tokens and shifted tokens both reproduce equal parts' losses and count the samples differently: the first
    given is kept, as a tie."""
    parts = [_batch([2]), _batch([6, 6, 5])]
    tokens = [c for c in candidates(parts[0]) if c.kind in (Weighting.TOKENS, Weighting.TOKENS_SHIFTED)]
    for options in (tokens, tokens[::-1]):
        result = choose(2.0, [2.0, 2.0], parts, options, 1e-6)
        assert result.tied and not result.alike and result.chosen is options[0]


def test_counts_that_cannot_be_read_or_sum_to_nothing_per_sample_are_not_alike():
    """Two weightings count "alike" only where both count something on every single sample: a ``weight_fn`` that
    counts the parts but fails on one sample, or counts nothing on one, ties like any other."""
    parts = [_batch([2, 3]), _batch([6, 6, 5])]
    tokens = [c for c in candidates(parts[0]) if c.kind is Weighting.TOKENS]

    def fails_on_one(batch):
        if len(batch["labels"]) == 1:
            raise ValueError("needs two samples")
        return len(batch["labels"])

    for count_fn in (fails_on_one, lambda batch: 0 if len(batch["labels"]) == 1 else len(batch["labels"])):
        custom = Candidate(Weighting.CUSTOM, "weight_fn", count_fn=count_fn)
        for options in ([*tokens, custom], [custom, *tokens]):
            result = choose(2.0, [2.0, 2.0], parts, options, 1e-6)
            assert result.errors["weight_fn"] < 1e-12, "the parts are counted"
            assert result.tied and not result.alike and result.chosen is options[0]


def test_the_candidates_of_a_batch_with_an_attention_mask():
    batch = _batch([2, 5])
    assert [c.kind.value for c in candidates(batch)] == [
        "samples",
        "tokens",
        "tokens-shifted",
        "attention-mask tokens",
        "sum",
    ]
    by_mask = candidates(batch, token_key="attention_mask", ignore_index=0)
    assert [c.kind.value for c in by_mask] == ["samples", "tokens", "tokens-shifted", "sum"]  # counted once


def test_per_sample_counts_of_each_token_weighting():
    batch = _batch([2, 5, 6])
    by_kind = {c.kind: c.per_sample(batch) for c in candidates(batch)}
    assert by_kind[Weighting.TOKENS].tolist() == [2, 5, 6]
    assert by_kind[Weighting.TOKENS_SHIFTED].tolist() == [1, 4, 5]  # labels[:, 1:]
    assert by_kind[Weighting.MASK_TOKENS].tolist() == [2, 5, 6]
    assert by_kind[Weighting.SAMPLES] is None and by_kind[Weighting.SUM] is None


def test_selected_tokens_match_within_the_tolerance_relative_to_the_loss():
    from lightning_gpuopt.microbatch.loss_weighting_rules import selected_tokens_match

    piece = 10 * 17 / 5  # parts 10 and 40 over 1 and 4 selected tokens
    for off, expected in ((0.5e-6, True), (2e-6, False)):  # relative to the loss: 0.5 and 2 tolerances
        assert selected_tokens_match(piece * (1 + off), [10.0, 40.0], [1, 4], 1e-6) is expected
    assert not selected_tokens_match(40.0, [0.0, 40.0], [0, 4], 1e-6)  # a part that selected nothing: no mean


def test_a_batch_with_two_samples_that_count_something_checks_those_two():
    batch = _batch([1, 3, 5])  # sample 0 counts nothing shifted by one
    assert check_pair(batch, candidates(batch)) == (1, 2)


def test_the_pair_is_ranked_by_the_count_that_varies_most():
    # Labels count 2, 6, 4 tokens (shifted 1, 5, 3: the widest spread); the attention mask 8, 7, 8 (the
    # narrowest). By the shifted count the pair is samples 0 and 1; by the mask it would be 1 and 2.
    labels = torch.ones(3, 8, dtype=torch.long)
    for i, length in enumerate([2, 6, 4]):
        labels[i, length:] = -100
    mask = (torch.arange(8)[None, :] < torch.tensor([8, 7, 8])[:, None]).long()
    batch = {"input_ids": torch.ones_like(labels), "attention_mask": mask, "labels": labels}
    assert check_pair(batch, candidates(batch)) == (0, 1)


def test_weights_of_a_batch_with_one_token_in_all():
    tokens = Candidate(Weighting.TOKENS, "tokens", "labels")
    one = torch.full((2, 4), -100)
    one[1, 0] = 3
    assert tokens.weights([{"labels": one[:1]}, {"labels": one[1:]}]) == [0.0, 1.0]


def test_the_mismatch_is_the_chosen_candidates_own():
    from lightning_gpuopt.microbatch.loss_weighting_rules import CheckResult

    samples, tokens = candidates(_batch([2, 3]))[:2]
    result = CheckResult(tokens, {samples.description: 0.01, tokens.description: 0.05}, 0.1)
    assert result.mismatch == 0.05
    assert CheckResult(None, {samples.description: 0.01, tokens.description: 0.05}, 0.001).mismatch == 0.01


def test_counts_that_sum_to_one_per_sample_can_count_alike():
    """Proportional counts are alike whatever their totals: half a unit per sample (a total of one on two
    samples) counts like sample shares."""
    parts = [_batch([2, 3]), _batch([6, 6, 5])]
    samples = candidates(parts[0])[0]
    halves = Candidate(
        Weighting.CUSTOM, "weight_fn (halves)", count_fn=lambda batch: 0.5 * len(batch["labels"])
    )
    for options in ([halves, samples], [samples, halves]):
        result = choose(2.0, [2.0, 2.0], [_batch([2]), _batch([5])], options, 1e-6)
        assert set(result.alike) == {samples.description, halves.description} and not result.tied


def _shares_apart(a: torch.Tensor, b: torch.Tensor, i: int, j: int) -> float:
    return abs(float(a[i] / (a[i] + a[j])) - float(b[i] / (b[i] + b[j])))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.integers(2, 70).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(1, 8), min_size=n, max_size=n),
            st.lists(st.integers(1, 8), min_size=n, max_size=n),
        )
    )
)
def test_the_pair_tells_apart_every_two_candidates_that_any_pair_tells_apart(lengths):
    """Over batches of 2 to 70 samples with labels and an attention mask of any lengths: the check's two samples
    count something under every candidate, come shortest first, and separate every two candidates that weight
    the batch differently, whenever two samples of the batch can."""
    labels_len, mask_len = lengths
    n = len(labels_len)
    labels = torch.ones(n, 8, dtype=torch.long)
    for i, length in enumerate(labels_len):
        labels[i, length:] = -100
    mask = (torch.arange(8)[None, :] < torch.tensor(mask_len)[:, None]).long()
    batch = {"input_ids": torch.ones_like(labels), "attention_mask": mask, "labels": labels}
    options = candidates(batch)
    rows = [c.per_sample(batch).double() for c in options if c.per_sample(batch) is not None]
    valid = [i for i in range(n) if all(r[i] > 0 for r in rows)]
    i, j = check_pair(batch, options)
    if len(valid) < 2:
        assert (i, j) == (0, 1)
        return
    assert i in valid and j in valid and i != j
    kinds = [torch.ones(n, dtype=torch.float64), *rows]
    differing = [
        (a, b)
        for x, a in enumerate(kinds)
        for b in kinds[x + 1 :]
        if not torch.allclose(a[valid] / a[valid].sum(), b[valid] / b[valid].sum(), rtol=0, atol=1e-12)
    ]
    if not differing:
        return

    def separates(p: int, q: int) -> bool:
        return all(_shares_apart(a, b, p, q) > 1e-12 for a, b in differing)

    if len(valid) <= 64 and any(separates(p, q) for x, p in enumerate(valid) for q in valid[x + 1 :]):
        assert separates(i, j), (i, j)
    spread = [float(r[valid].std() / r[valid].mean()) for r in rows]
    counts = rows[max(range(len(rows)), key=lambda r: spread[r])]
    assert counts[i] <= counts[j]  # the one counted least first
    short = min(valid, key=lambda v: float(counts[v]))  # ties: the first
    long = max(reversed(valid), key=lambda v: float(counts[v]))  # ties: the last
    if counts[short] < counts[long] and separates(short, long):
        assert (float(counts[i]), float(counts[j])) == (float(counts[short]), float(counts[long]))


def _fake_hf(name: str) -> nn.Module:
    return type(name, (type("PreTrainedModel", (nn.Module,), {}),), {})()


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        ("GPT2LMHeadModel", [1 / 6, 5 / 6]),  # tokens, labels shifted by one
        ("BertForMaskedLM", [2 / 9, 7 / 9]),  # tokens
        ("BertForTokenClassification", [2 / 9, 7 / 9]),
        ("BertForSequenceClassification", [1 / 3, 2 / 3]),  # one label per sample: sample shares
        (None, [1 / 3, 2 / 3]),
    ],
)
def test_before_any_check_the_weighting_follows_the_hugging_face_head(head, expected):
    """Evaluation chunks (and a split the check cannot run on) use the fallback: the head's own reduction."""
    module = _fake_hf(head) if head else nn.Linear(2, 2)
    site = CheckSite(SimpleNamespace(lightning_module=module, precision="32-true"), contextlib.nullcontext)
    chunks = [
        {"labels": torch.tensor([[1, 2, -100, -100]])},
        {"labels": torch.tensor([[1, 2, 3, 4], [5, 6, 7, -100]])},
    ]
    assert LossWeighting().weights(chunks, site) == pytest.approx(expected)


def test_a_given_weight_fn_is_named_by_its_name_else_its_repr():
    def tokens(batch):
        return 1

    class Count:
        def __call__(self, batch):
            return 1

        def __repr__(self) -> str:
            return "Count()"

    assert LossWeighting(weight_fn=tokens).decided.description == "weight_fn (tokens)"
    assert LossWeighting(weight_fn=Count()).decided.description == "weight_fn (Count())"


_IDS = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])


@pytest.mark.parametrize(
    ("batch", "found"),
    [
        (
            (_IDS, _IDS.masked_fill(_IDS == 0, -100)),
            ["tokens (batch[1] != -100)", "tokens (batch[1] != -100, shifted by one)"],
        ),
        (
            [_IDS, (_IDS != 0).long(), torch.tensor([0, 1])],
            ["tokens (batch[1] != 0)"],
        ),  # ids, a 0/1 mask, targets
        ((_IDS, (_IDS != 0)), ["tokens (batch[1] != 0)"]),  # a boolean mask
        (
            (torch.randn(2, 3, 4, 4), torch.randint(0, 5, (2, 4, 4))),
            [],
        ),  # a segmentation map: no ignore index
        ((torch.randn(2, 8), torch.tensor([[0], [1]])), []),  # binary labels, one per sample
        ((_IDS, torch.tensor([[0, 1], [1, 0]])), []),  # 0/1, but shaped like no other integer entry
        ({"input_ids": _IDS, "mask": (_IDS != 0).long()}, []),  # a dict's entries are found by name only
    ],
    ids=["labels", "mask", "bool-mask", "segmentation", "binary-labels", "unshaped-0-1", "dict-by-name"],
)
def test_tuple_batches_offer_their_tokens_and_nothing_else_does(batch, found):
    descriptions = [c.description for c in candidates(batch)]
    assert descriptions == ["sample shares", *found, "sum (micro-batch losses added)"]
