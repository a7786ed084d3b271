"""Rewrite reduce-scatter as all-to-all + a local sum, for backends whose reduce-scatter is slow.

gloo implements reduce_scatter as an all-reduce of the whole buffer and keeps one chunk: twice the
bytes on the wire that a reduce-scatter needs. all_to_all_single moves exactly the chunks each
rank must reduce ((N-1)/N of the buffer), and the reduction is a sum over N rows done locally.
Measured with gloo at world size 2 (this machine): 3 MiB 4.9 ms -> 2.3 ms, 12 MiB 15.2 -> 8.1 ms.

Where the rank's place in the group is known (`ctx.group_ranks`) and its own chunk is the first
or the last of the buffer (every rank at world size 2; ranks 0 and N - 1 beyond), that chunk stays
out of the exchange: the all-to-all sends the rest of the buffer, a view, and the local sum adds
the own chunk from the send buffer, so gloo no longer copies it to itself.

Runs last, after scheduling: the all-to-all is issued where the reduce-scatter was, and the
local sum happens where its wait was, so the schedule is unchanged.
"""

from __future__ import annotations

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


def reduce_scatter_via_all_to_all(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    fake_mode = fake_mode_of(gm)
    group_ranks = ctx.group_ranks if ctx else {}
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
        rank = group_ranks.get(group_name)
        own_local = group_size > 1 and rank in (0, group_size - 1)
        splits = [0 if own_local and r == rank else chunk for r in range(group_size)]
        with gm.graph.inserting_before(scatter):
            flat = emit(aten.reshape.default, source, [-1])
            send = flat
            if own_local:  # the chunks for the other ranks: all but the first, or all but the last
                others = (chunk, numel) if rank == 0 else (0, numel - chunk)
                send = emit(aten.slice.Tensor, flat, 0, *others)
            exchanged = emit(ALL_TO_ALL, send, splits, splits, group_name)
        if own_local:
            exchanged.meta[meta_keys.OWN_CHUNK_LOCAL] = True
        with gm.graph.inserting_before(wait):
            received = emit(WAIT, exchanged)
            rows = emit(aten.view.default, received, [group_size - 1 if own_local else group_size, chunk])
            summed = emit(aten.sum.dim_IntList, rows, [0])
            if own_local:
                own = emit(aten.slice.Tensor, flat, 0, rank * chunk, (rank + 1) * chunk)
                summed = emit(aten.add.Tensor, summed, own)
            result = emit(aten.view.default, summed, list(wait.meta["val"].shape))
        wait.replace_all_uses_with(result)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(scatter)
    return finalize_graph(gm)
