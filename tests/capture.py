"""Capture graphshard's graphs for a training step, in one process, at any world size."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

import graphshard
from graphshard.backend import GraphshardCompiler
from graphshard.options import GraphshardOptions


def capture_step(model, inputs, loss_fn, *, strategy="full_shard", options=None, shard_kwargs=None):
    """Shard `model` (unless it already is), run one compiled forward+backward (no Inductor),
    return {(graph_kind, stage): GraphModule snapshot}."""
    if not graphshard.is_sharded(model):
        graphshard.shard(model, strategy=strategy, **(shard_kwargs or {}))
    graphs: dict[tuple[str, str], fx.GraphModule] = {}

    def observe(kind, stage, gm):
        graphs[(kind, stage)] = copy.deepcopy(gm)

    opts = GraphshardOptions.from_dict({**(options or {}), "compiler": "eager"})
    compiled = torch.compile(model, backend=GraphshardCompiler(opts, observe), fullgraph=True)
    loss = loss_fn(compiled(*inputs), *inputs)
    loss.backward()
    torch._dynamo.reset()
    return graphs


def call_nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
