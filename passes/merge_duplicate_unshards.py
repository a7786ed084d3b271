"""Merge unshard calls of the same parameter in the Dynamo graph (before AOTAutograd).

A tied weight (embedding shared with the output projection) or a module called twice reads its
parameter more than once; each read is an unshard. Merging them here means one gather in forward
and, because autograd then sums the uses' gradients before the single reduce_grad, one
reduce-scatter in backward instead of one per use plus an add of shards.

A read under torch.no_grad() never stands in for a read that needs a gradient (or the parameter
would silently get none): the grad mode at the read is one of the marker's arguments, so such
reads have different specs and are not merged.
"""

from __future__ import annotations

import torch.fx as fx

from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import is_unshard
from graphshard.passes.markers import UnshardSpec


def merge_duplicate_unshards(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    first_by_key: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        key = (node.args[0], UnshardSpec.from_node(node))
        if key not in first_by_key:
            first_by_key[key] = node
            continue
        node.replace_all_uses_with(first_by_key[key])
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
