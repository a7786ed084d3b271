"""Concatenations of graph inputs run as ATen's cat, not as kernels Inductor generates.

A bucket's all-gather sends its parameter shards packed in one buffer: a dim-0 concatenation of
graph inputs (bucket_collectives; the all-to-all transport repeats the parts). Inductor would
generate a kernel for each such concatenation, one per distinct bucket layout (the embedding's,
a block's, the head's; forward and backward gather different sets), and compile each, about
0.7 s of g++ apiece on CPU (a Triton compile on GPU), for a plain copy of memory that torch.cat
does as fast. Here each becomes `graphshard::concat` (compiler/ops.py), which Inductor
calls as it is. A concatenation that reads anything computed in the graph is left to Inductor,
which fuses it with its producers (a mixed-precision gather's casts, a reduce-scatter bucket's
copy-in).

Runs after the transport (which recognises the bucket's concatenation) and before the buffers
are freed; the graph's collectives and their order do not change.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphshard.passes import meta_keys
from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import aten, finalize_graph, is_view

CONCAT = torch.ops.graphshard.concat.default


def pack_graph_inputs(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if not _concatenates_inputs(node):
            continue
        with gm.graph.inserting_before(node):
            packed = gm.graph.call_function(CONCAT, (list(node.args[0]),))
        packed.meta.update(node.meta)
        node.replace_all_uses_with(packed)
        gm.graph.erase_node(node)
    return finalize_graph(gm)


def _concatenates_inputs(node: fx.Node) -> bool:
    """A bucket's dim-0 torch.cat (graphshard emitted it: it has a role) of two or more
    pieces, each a graph input or a view of one. The model's own concatenations stay."""
    if (node.op != "call_function" or node.target is not aten.cat.default
            or node.meta.get(meta_keys.ROLE) is None):
        return False
    pieces = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return dim == 0 and len(pieces) > 1 and all(_is_input_view(piece) for piece in pieces)


def _is_input_view(node) -> bool:
    while isinstance(node, fx.Node) and node.op == "call_function" and is_view(node):
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder"
