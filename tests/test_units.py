"""What a unit is (passes/units.py), pinned on representative parameter names and modules."""

from __future__ import annotations

import pytest
import torch.nn as nn

from graphshard.activation_checkpointing import repeated_blocks as checkpointed_blocks
from graphshard.bench.workload import transformer_blocks
from graphshard.passes.units import block_of, named_blocks, repeated_blocks, unit_of


@pytest.mark.parametrize("name, block, unit", [
    # Hugging Face Llama: decoder layers are the blocks; embeddings, norm and head their modules
    ("model.layers.3.self_attn.q_proj.weight", "model.layers.3", "model.layers.3"),
    ("model.layers.11.mlp.down_proj.weight", "model.layers.11", "model.layers.11"),
    ("model.embed_tokens.weight", None, "model.embed_tokens"),
    ("model.norm.weight", None, "model.norm"),
    ("lm_head.weight", None, "lm_head"),
    # torch.nn.Transformer: both stacks' layers are blocks; the stacks' final norms are not
    ("encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.0", "encoder.layers.0"),
    ("decoder.layers.5.multihead_attn.out_proj.bias", "decoder.layers.5", "decoder.layers.5"),
    ("encoder.norm.weight", None, "encoder.norm"),
    # nested lists: the outermost index is the block
    ("blocks.2.experts.5.w1.weight", "blocks.2", "blocks.2"),
    # a parameter held directly in a ParameterList is its list's, not a block of its own
    ("experts.0", None, "experts"),
    # a parameter of the root module
    ("scale", None, ""),
])
def test_block_and_unit_of_a_parameter_name(name, block, unit):
    assert block_of(name) == block
    assert unit_of(name) == unit


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))  # nested list


class TiedLM(nn.Module):
    def __init__(self, n_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied: registered first as embed.weight


def test_blocks_of_a_model_are_its_outermost_list_entries_and_tied_weights_its_first_name():
    model = TiedLM()
    assert list(named_blocks(model)) == ["layers.0", "layers.1", "layers.2"]
    assert repeated_blocks(model) == list(model.layers)
    # the tied head is the embedding's weight: the unit of its first registration
    names = [name for name, _ in model.named_parameters()]
    assert "head.weight" not in names and unit_of("embed.weight") == "embed"


def test_transformer_has_both_stacks_as_blocks():
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=3,
                           dim_feedforward=16)
    assert list(named_blocks(model)) == [
        "encoder.layers.0", "encoder.layers.1",
        "decoder.layers.0", "decoder.layers.1", "decoder.layers.2"]


def test_checkpointing_and_the_bench_use_the_same_blocks():
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=2,
                           dim_feedforward=16)
    assert checkpointed_blocks(model) == transformer_blocks(model) == repeated_blocks(model)


def test_a_model_without_blocks_is_refused_with_a_message():
    with pytest.raises(ValueError, match="no repeated blocks"):
        repeated_blocks(nn.Linear(2, 2))
