"""Lower graphshard's marker ops to functional collectives (see passes/lowering.py for the math)."""

from __future__ import annotations

import torch.fx as fx

from graphshard.passes import meta_keys
from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import GraphEmitter, fake_mode_of, finalize_graph, is_float8_scale, is_reduce_grad, is_unshard
from graphshard.passes.lowering import lower_float8_scale, lower_reduce_grad, lower_unshard
from graphshard.passes.markers import ReduceSpec, UnshardSpec


def insert_collectives(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    """Replace every unshard / float8_scale / reduce_grad marker with its collective lowering, in place."""
    fake_mode = fake_mode_of(gm)
    for node in list(gm.graph.nodes):
        if is_unshard(node):
            role, spec, lower = "unshard", UnshardSpec.from_node(node), lower_unshard
        elif is_float8_scale(node):
            role, spec, lower = "float8_scale", UnshardSpec.from_node(node), lower_float8_scale
        elif is_reduce_grad(node):
            role, spec, lower = "reduce_grad", ReduceSpec.from_node(node), lower_reduce_grad
        else:
            continue
        meta = {key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta}
        meta[meta_keys.MARKER] = node.name  # provenance: which marker produced this node
        meta[meta_keys.PARAMS] = (spec.name,)  # bucketing concatenates these
        meta[meta_keys.ROLE] = role
        emit = GraphEmitter(gm.graph, fake_mode, meta)
        with gm.graph.inserting_before(node):
            out = lower(emit, node.args[0], spec)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return finalize_graph(gm)
