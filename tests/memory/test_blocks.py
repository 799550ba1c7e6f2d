"""The repeated-block rule, shared by FSDP2's units and the depth extrapolation: blocks are modules that run."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_gpuopt.memory.blocks import block_list, repeated_blocks, runs_forward
from lightning_gpuopt.strategy import shard_units


def tiny_t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2
    )
    return transformers.T5ForConditionalGeneration(config)


def demo_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=100)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            demo_transformer,
            [f"transformer.{part}.layers.{i}" for part in ("encoder", "decoder") for i in (0, 1)],
        ),
        (tiny_t5, ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
    ],
    ids=["nn.Transformer", "t5"],
)
def test_an_encoder_decoder_gets_its_encoder_and_decoder_layers_never_their_module_lists(make, expected):
    """The rule picked the two ModuleLists before: fully_shard refuses a container without a forward."""
    model = make()
    names = {id(m): name for name, m in model.named_modules()}
    units = shard_units(model)
    assert [names[id(u)] for u in units] == expected
    assert all(runs_forward(u) for u in units)


def test_a_tied_embedding_is_not_a_block():
    """GPT-2's token embedding is tied to its head: sharding it apart would split the tied weight."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_head=8, n_embd=512, vocab_size=8000, n_positions=512)
    model = transformers.GPT2LMHeadModel(config)  # wpe holds 1.5 %: with wte, two sibling embeddings
    assert {type(b).__name__ for b in repeated_blocks(model)} == {"GPT2Block"}


def test_the_depth_extrapolation_cuts_the_list_of_the_same_blocks():
    layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4))
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(*layers))
    assert block_list(model) is None  # blocks in a Sequential: traced whole, as before
    holder = nn.Module()
    holder.stem, holder.layers = nn.Linear(16, 16), layers
    assert block_list(holder) == ("layers", layers)
    holder.layers = nn.ModuleList([*layers[:3], nn.Linear(16, 16)])  # not one run: nothing to cut
    assert block_list(holder) is None


def test_a_module_list_of_module_lists_is_looked_inside():
    inner = [nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]) for _ in range(2)]
    model = nn.Module()
    model.stages = nn.ModuleList(inner)
    assert [type(u) for u in repeated_blocks(model)] == [nn.Linear] * 4
    assert not any(isinstance(u, (nn.ModuleList, nn.ModuleDict)) for u in repeated_blocks(model))
