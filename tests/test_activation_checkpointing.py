"""Activation checkpointing (non-reentrant, and selective) under graphshard: parameters used in
recomputed regions are gathered again there; numerics equal the unsharded model."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import graphshard
from graphshard.backend import GraphshardCompiler
from graphshard.launch import run_local
from graphshard.options import GraphshardOptions
from passes.graph_utils import ALL_GATHER, REDUCE_SCATTER

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


def _data():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 4, 5, generator=gen), torch.randint(0, 3, (BATCH, 4), generator=gen)


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))


def test_recomputed_region_gathers_again(fake_pg):
    torch.manual_seed(0)
    model = CheckpointedNet("full")
    graphshard.shard(model)
    graphs = {}
    compiler = GraphshardCompiler(
        GraphshardOptions(compiler="eager"),
        observer=lambda kind, stage, gm: graphs.__setitem__(kind, copy.deepcopy(gm))
        if stage == "lowered" else None)
    x, y = _data()
    _loss(torch.compile(model, backend=compiler, fullgraph=True)(x), y).backward()
    # Every block weight is needed again in backward (a bias is not: its gradient is a sum).
    block_params = {name for name, _ in model.named_parameters()
                    if name.startswith("blocks.") and name.endswith("weight")}
    gathered_in_backward = {n.meta["graphshard_params"][0]
                            for n in graphs["backward"].graph.nodes if n.target is ALL_GATHER}
    assert block_params <= gathered_in_backward
    scatters = [n for n in graphs["backward"].graph.nodes if n.target is REDUCE_SCATTER]
    assert len(scatters) == len(list(model.parameters()))  # one reduction per parameter
    torch._dynamo.reset()


def _train(rank, world, configs):
    x, y = _data()
    per = BATCH // world
    results = []
    for mode, compiled in configs:
        torch.manual_seed(0)
        model = CheckpointedNet(mode)
        if world > 1:
            graphshard.shard(model)
            x_local, y_local = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        else:
            x_local, y_local = x, y
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        fn = torch.compile(model, backend="graphshard", options={"compiler": "eager"},
                           fullgraph=True) if compiled else model
        losses = []
        for _ in range(STEPS):
            loss = _loss(fn(x_local), y_local)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if world > 1:
                torch.distributed.all_reduce(loss)
            losses.append(loss.item() / world)
        results.append((losses, {n: p.full_tensor() if world > 1 else p.detach().clone()
                                 for n, p in model.named_parameters()}))
        torch._dynamo.reset()
    return results


def test_checkpointed_training_matches_unsharded():
    configs = [("full", False), ("full", True), ("sac", False), ("sac", True)]
    reference = {mode: _train(0, 1, [(mode, False)])[0] for mode in ("full", "sac")}
    for rank_results in run_local(_train, 2, configs):
        for (mode, compiled), (losses, params) in zip(configs, rank_results):
            ref_losses, ref_params = reference[mode]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (mode, compiled)
            for name, ref in ref_params.items():
                assert (params[name] - ref).abs().max().item() < 1e-5, (mode, compiled, name)
