"""Merge unshard calls of the same parameter in the Dynamo graph (before AOTAutograd).

A tied weight (embedding shared with the output projection) or a module called twice reads its
parameter more than once; each read is an unshard. Merging them here means one gather in forward
and, because autograd then sums the uses' gradients before the single reduce_grad, one
reduce-scatter in backward instead of one per use plus an add of shards.
"""

from __future__ import annotations

import torch.fx as fx

from passes.graph_utils import is_unshard


def _source(node):
    """The value an unshard reads, looking through DTensor.to_local (one call per read)."""
    while isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == "to_local")
        or (node.op == "call_function" and getattr(node.target, "__name__", "") == "to_local")
    ):
        node = node.args[0]
    return node


def merge_duplicate_unshards(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    first_by_key: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        key = (_source(node.args[0]), *(tuple(a) if isinstance(a, list) else a for a in node.args[1:]))
        if key in first_by_key:
            node.replace_all_uses_with(first_by_key[key])
            gm.graph.erase_node(node)
        else:
            first_by_key[key] = node
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
