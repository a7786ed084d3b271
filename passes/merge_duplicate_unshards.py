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

_GRAD_MODE_SWITCHES = {torch._C._set_grad_enabled, torch.set_grad_enabled}


def _is_to_local(node) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == "to_local")
        or (node.op == "call_function" and getattr(node.target, "__name__", "") == "to_local"))


def _source(node):
    """The value an unshard reads, looking through DTensor.to_local (one call per read)."""
    while _is_to_local(node):
        node = node.args[0]
    return node


def merge_duplicate_unshards(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    first_by_key: dict[tuple, fx.Node] = {}
    region = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _GRAD_MODE_SWITCHES:
            region += 1
            continue
        if not is_unshard(node):
            continue
        args = tuple(tuple(a) if isinstance(a, list) else a for a in node.args[1:])
        key = (region, _source(node.args[0]), *args)
        if key not in first_by_key:
            first_by_key[key] = node
            continue
        node.replace_all_uses_with(first_by_key[key])
        read = node.args[0]
        gm.graph.erase_node(node)
        # Only the now-unused to_local chain goes; no whole-graph DCE (it would drop in-place
        # call_method nodes, which FX does not know to be impure).
        while _is_to_local(read) and not read.users:
            parent = read.args[0]
            gm.graph.erase_node(read)
            read = parent
    gm.recompile()
    return gm
