"""Graphs the pass tests share: a hand-built gather graph, a captured small transformer, and
measures of a scheduled graph."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphshard.passes import meta_keys
from graphshard.tools.models import build_model
from graphshard.compiler.options import GraphshardOptions
from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import (
    ALL_GATHER, GraphEmitter, aten, is_collective, is_wait, node_order,
)
from graphshard.passes.lowering import lower_reduce_grad, lower_unshard
from graphshard.passes.markers import UnshardSpec


MB = 2**20


def gather_graph(world: int, params, use_order=None, backward=False, replicas=1,
                 rank=0) -> fx.GraphModule:
    """A graph that gathers each (name, full_shape, dtype) parameter's shard and uses it in one
    compute node (a matmul-like sum), in `use_order`; with backward=True also reduce-scatters a
    gradient per parameter (and all-reduces it across `replicas` groups: hybrid sharding).
    Shards are `rank`'s (torch.chunk's rows: the last ranks' may be short)."""
    graph, mode = fx.Graph(), FakeTensorMode()
    shards = {}
    for name, shape, dtype in params:
        node = graph.placeholder(name.replace(".", "_"))
        chunk = math.ceil(shape[0] / world)
        rows = min(chunk, max(0, shape[0] - rank * chunk))
        with mode:
            node.meta["val"] = torch.empty((rows, *shape[1:]), dtype=dtype)
        shards[name] = (node, shape, dtype)
    outputs = []
    for name in use_order or [p[0] for p in params]:
        shard, shape, dtype = shards[name]
        emit = GraphEmitter(graph, mode, {meta_keys.PARAMS: (name,), meta_keys.ROLE: "unshard"})
        groups = (("0",), (world,)) if replicas == 1 else (("0", "1"), (world, replicas))
        spec = UnshardSpec(shape[0], "0", world, None, True, *groups, True, None, name, 0, 0, "fake",
                           True)
        full = lower_unshard(emit, shard, spec)
        compute = GraphEmitter(graph, mode)
        out = compute(aten.mul.Tensor, full, 2.0)
        outputs.append(out)
        if backward:
            emit = GraphEmitter(graph, mode, {meta_keys.PARAMS: (name,), meta_keys.ROLE: "reduce_grad"})
            reduce = spec.reduce_spec(shard.meta["val"].shape[0], dtype)
            outputs.append(lower_reduce_grad(emit, out, reduce))
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def ctx(**options):
    return PassContext("forward", GraphshardOptions(**options))


def compute_nodes_between(gm, start, end):
    order = node_order(gm.graph)
    return [n for n in gm.graph.nodes if order[start] < order[n] < order[end]
            and n.op == "call_function" and n.meta.get(meta_keys.ROLE) is None]


def inflight_peak(gm) -> int:
    """Most gathered bytes in flight (issued, not yet waited on) while compute runs: the
    prefetched bytes the budget bounds."""
    peak = current = 0
    for node in gm.graph.nodes:
        if is_collective(node) and node.target is ALL_GATHER:
            current += node.meta["val"].numel() * node.meta["val"].element_size()
        elif is_wait(node) and node.args[0].target is ALL_GATHER:
            current -= node.meta["val"].numel() * node.meta["val"].element_size()
        elif node.op == "call_function" and node.meta.get(meta_keys.ROLE) is None:
            peak = max(peak, current)
    return peak


def small_transformer(**kw):
    return build_model("transformer", dim=64, n_layers=4, vocab_size=64, batch=8, seq_len=8, **kw)


def nbytes(node: fx.Node) -> int:
    return node.meta["val"].numel() * node.meta["val"].element_size()
