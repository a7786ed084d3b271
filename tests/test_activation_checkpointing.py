"""Activation checkpointing (non-reentrant, and selective) under graphshard: parameters used in
recomputed regions are gathered again there; numerics equal the unsharded model."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import graphshard
from graphshard.passes import meta_keys
from graphshard.tools.launch import run_local
from graphshard.passes.graph_utils import ALL_GATHER, REDUCE_SCATTER
from tests.capture import GraphCapture
from tests.workers import EAGER, Training, reference, train

STEPS, BATCH, LR = 2, 8, 1e-2


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)  # 3*dim rows: uneven at world size 2 for dim 5
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class CheckpointedNet(nn.Module):
    """Every block runs under torch.utils.checkpoint: plain ("full") or selective ("sac",
    saving matmul outputs and recomputing the rest)."""

    def __init__(self, mode: str, dim: int = 5, n_blocks: int = 2):
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.mode == "sac":
                context = functools.partial(create_selective_checkpoint_contexts,
                                            [torch.ops.aten.mm.default, torch.ops.aten.addmm.default])
                h = checkpoint(block, h, use_reentrant=False, context_fn=context)
            else:
                h = checkpoint(block, h, use_reentrant=False)
        return self.out(h)


def _data(step: int = 0):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 4, 5, generator=gen), torch.randint(0, 3, (BATCH, 4), generator=gen)


def _loss(out, x, y):
    return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))


def test_recomputed_region_gathers_again(fake_pg):
    torch.manual_seed(0)
    model = CheckpointedNet("full")
    graphshard.shard(model)
    capture = GraphCapture(stages=("lowered",))
    x, y = _data()
    _loss(capture.compile(model)(x), x, y).backward()
    backward = capture.graphs[("backward", "lowered")]
    # Every block weight is needed again in backward (a bias is not: its gradient is a sum),
    # and gathered again, except the last block's: the default keeps the tail of forward.
    block_params = {name for name, _ in model.named_parameters()
                    if name.startswith("blocks.") and name.endswith("weight")}
    last_block = {name for name in block_params if name.startswith("blocks.1.")}
    gathered_in_backward = {n.meta[meta_keys.PARAMS][0]
                            for n in backward.graph.nodes if n.target is ALL_GATHER}
    assert block_params - last_block <= gathered_in_backward
    assert not last_block & gathered_in_backward
    scatters = [n for n in backward.graph.nodes if n.target is REDUCE_SCATTER]
    assert len(scatters) == len(list(model.parameters()))  # one reduction per parameter
    torch._dynamo.reset()


def _training(mode: str, compile: dict | None) -> Training:
    return Training(model=functools.partial(CheckpointedNet, mode), data=_data, loss=_loss,
                    optimizer=functools.partial(torch.optim.AdamW, lr=LR), steps=STEPS,
                    compile=compile)


def test_checkpointed_training_matches_unsharded():
    configs = [("full", None), ("full", EAGER), ("sac", None), ("sac", EAGER)]
    expected = {mode: reference(_training(mode, None)) for mode in ("full", "sac")}
    for rank_results in run_local(train, 2, [_training(*config) for config in configs]):
        for (mode, compile), result in zip(configs, rank_results):
            ref = expected[mode]
            assert max(abs(a - b) for a, b in zip(result.losses, ref.losses)) < 1e-5, (mode, compile)
            for name, p in ref.params.items():
                assert (result.params[name] - p).abs().max().item() < 1e-5, (mode, compile, name)


def test_applying_again_replaces_the_mode_instead_of_nesting():
    model = CheckpointedNet("none")  # plain blocks: their forward gets wrapped
    originals = [block.forward for block in model.blocks]
    graphshard.apply_activation_checkpointing(model, "full")
    graphshard.apply_activation_checkpointing(model, "selective")
    for block, original in zip(model.blocks, originals):
        assert block.forward.args == (graphshard.activation_checkpointing.selective_context,
                                      original)


def _loss_and_saved_tensors(model, x):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(input_ids=x, labels=x).loss
    return loss, len(saved)


def test_every_transformers_layer_is_switched_and_every_cache_turned_off():
    # An encoder-decoder has two stacks of blocks (the largest-list rule would pick one), and
    # transformers' causal LMs cache by default: a cache write inside a checkpointed block
    # would happen again in the recompute.
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=2,
                      num_decoder_layers=3, num_heads=2, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model, reference = T5ForConditionalGeneration(config), T5ForConditionalGeneration(config)
    reference.load_state_dict(model.state_dict())
    assert model.config.use_cache
    graphshard.apply_activation_checkpointing(model, "full")
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert len(layers) == 5 and all(layer.gradient_checkpointing for layer in layers)
    assert not model.config.use_cache
    x = torch.randint(0, 32, (2, 5))
    model.train(), reference.train()
    loss, saved = _loss_and_saved_tensors(model, x)
    expected, saved_without = _loss_and_saved_tensors(reference, x)
    assert saved < saved_without / 2  # the blocks' activations are recomputed, not saved
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
