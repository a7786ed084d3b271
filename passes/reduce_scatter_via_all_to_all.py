"""Rewrite reduce-scatter as all-to-all + a local sum, for backends whose reduce-scatter is slow.

gloo implements reduce_scatter as an all-reduce of the whole buffer and keeps one chunk: twice the
bytes on the wire that a reduce-scatter needs. all_to_all_single moves exactly the chunks each
rank must reduce ((N-1)/N of the buffer), and the reduction is a sum over N rows done locally.
Measured with gloo at world size 2 (this machine): 3 MiB 4.9 ms -> 2.3 ms, 12 MiB 15.2 -> 8.1 ms.

At group size 2, where each rank's own chunk is the first or the last of the buffer, that chunk
stays out of the exchange: the all-to-all sends the rest of the buffer, a view, and the local
sum adds the own chunk from the buffer, so gloo no longer copies it to itself. Which chunk is
the rank's is looked up when the graph runs (`exchange_with_peers`, and `sum_received` for
the local sum: compiler/ops.py), so every rank compiles one graph. ATen runs the local sum: a
generated kernel would be compiled for every bucket size, for a sum over memory. In larger
groups the middle ranks' own chunks would need a copy to leave out, and they set the step's
pace: every rank exchanges its whole buffer there.

Runs last, after scheduling: the all-to-all is issued where the reduce-scatter was, and the
local sum happens where its wait was, so the schedule is unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphshard.passes import meta_keys
from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import (
    ALL_TO_ALL,
    REDUCE_SCATTER,
    WAIT,
    GraphEmitter,
    aten,
    call_nodes,
    fake_mode_of,
    finalize_graph,
    wait_of,
)

EXCHANGE_WITH_PEERS = torch.ops.graphshard.exchange_with_peers.default
SUM_RECEIVED = torch.ops.graphshard.sum_received.default


def reduce_scatter_via_all_to_all(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    fake_mode = fake_mode_of(gm)
    keep_own_chunk = ctx is not None and ctx.own_chunk_local
    for scatter in call_nodes(gm, REDUCE_SCATTER):
        source, reduce_op, group_size, group_name = scatter.args
        if reduce_op != "sum":
            continue
        wait = wait_of(scatter)
        meta = {k: v for k, v in scatter.meta.items() if k.startswith(meta_keys.PREFIX)}
        meta[meta_keys.LOWERED_FROM] = "reduce_scatter"
        emit = GraphEmitter(gm.graph, fake_mode, meta)
        numel = source.meta["val"].numel()
        chunk = numel // group_size
        own_local = keep_own_chunk and group_size == 2
        with gm.graph.inserting_before(scatter):
            flat = emit(aten.reshape.default, source, [-1])
            if own_local:
                exchanged = emit(EXCHANGE_WITH_PEERS, flat, group_size, group_name, True)
            else:
                exchanged = emit(ALL_TO_ALL, flat, [chunk] * group_size, [chunk] * group_size,
                                 group_name)
        with gm.graph.inserting_before(wait):
            received = emit(WAIT, exchanged)
            if own_local:
                summed = emit(SUM_RECEIVED, received, group_size - 1, flat, group_name)
            else:
                summed = emit(SUM_RECEIVED, received, group_size, None, None)
            result = emit(aten.view.default, summed, list(wait.meta["val"].shape))
        wait.replace_all_uses_with(result)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(scatter)
    return finalize_graph(gm)
