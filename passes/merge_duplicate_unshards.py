"""Merge unshard calls of the same parameter in the Dynamo graph (before AOTAutograd).

A tied weight (embedding shared with the output projection) or a module called twice reads its
parameter more than once; each read is an unshard. Merging them here means one gather in forward
and, because autograd then sums the uses' gradients before the single reduce_grad, one
reduce-scatter in backward instead of one per use plus an add of shards.

Reads are only merged within one grad-mode region: a read under torch.no_grad() must not stand in
for a read that needs a gradient (or the parameter would silently get none).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.graph_utils import is_unshard
from passes.markers import UnshardSpec

_GRAD_MODE_SWITCHES = {torch._C._set_grad_enabled, torch.set_grad_enabled}


def merge_duplicate_unshards(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    first_by_key: dict[tuple, fx.Node] = {}
    region = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _GRAD_MODE_SWITCHES:
            region += 1
            continue
        if not is_unshard(node):
            continue
        key = (region, node.args[0], UnshardSpec.from_node(node))
        if key not in first_by_key:
            first_by_key[key] = node
            continue
        node.replace_all_uses_with(first_by_key[key])
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
