"""Rewrite all-gather as all-to-all of N copies of the local shard, for backends whose all-gather
copies its output.

gloo's all_gather_into_tensor receives into a fresh flat buffer of its own and then copies every
chunk into the output tensor: a full-size allocation and copy per gather, on the same two cores
that compute. all_to_all_single receives straight into its output, which has the all-gather's
layout (rank r's chunk at position r) when every rank sends its shard to every rank. The price is
a send buffer of N copies of the shard (the output's size), written by Inductor with the bucket's
copy-in and freed when the exchange completes. Where the shard is a bucket's concatenation, the
send buffer concatenates its parts N times instead: one buffer, not a shard-sized one beside
it. Measured with gloo at world size 2 on this machine, 3 MiB gathered: all-gather 2.8 ms,
copy + all-to-all 1.8 ms.

Runs after scheduling: the exchange is issued where the all-gather was and waited where its wait
was, so the schedule is unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import ALL_GATHER, ALL_TO_ALL, GraphEmitter, aten, call_nodes, fake_mode_of, finalize_graph


def all_gather_via_all_to_all(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    fake_mode = fake_mode_of(gm)
    for gather in call_nodes(gm, ALL_GATHER):
        shard, group_size, group_name = gather.args
        rows = shard.meta["val"].shape[0]
        meta = {k: v for k, v in gather.meta.items() if k.startswith("graphshard_")}
        meta["graphshard_lowered_from"] = "all_gather"
        emit = GraphEmitter(gm.graph, fake_mode, meta)
        with gm.graph.inserting_before(gather):
            if _is_concatenation_for(gather, shard):
                copies = emit(aten.cat.default, list(shard.args[0]) * group_size)
            else:
                repeats = [group_size] + [1] * (shard.meta["val"].dim() - 1)
                copies = emit(aten.repeat.default, shard, repeats)
            exchanged = emit(ALL_TO_ALL, copies, [rows] * group_size, [rows] * group_size, group_name)
        gather.replace_all_uses_with(exchanged)
        gm.graph.erase_node(gather)
    return finalize_graph(gm)


def _is_concatenation_for(gather: fx.Node, shard: fx.Node) -> bool:
    """Whether `shard` is a dim-0 concatenation that only this gather reads."""
    return (shard.op == "call_function" and shard.target == aten.cat.default
            and len(shard.args) == 1 and shard.kwargs.get("dim", 0) == 0
            and list(shard.users) == [gather])
