"""Turn a partition in which backward gathers some parameters again into the one that keeps
their gathered weights from forward instead, without partitioning the joint graph again.

The default decides whether to keep the tail of forward (the last block) gathered by comparing
the two partitions' peaks (`reshard_policy.keeping_costs_peak_memory`). A min-cut partition of
a large model's joint graph takes seconds (about 5 s for Llama-3-8B's 32 blocks here), so the
backend partitions once, with those parameters resharded, and derives the other partition:
forward also outputs each parameter's gathered weight as a saved value, and backward reads that
saved value where it gathered the weight again. Saved values follow AOTAutograd's convention:
forward's outputs are the user outputs, the saved tensors, then the saved symbolic sizes;
backward's inputs are the saved sizes, the saved tensors in the same order, then the tangents.
The new saved tensor goes right after the last tensor saved with a version-counter check, in
both graphs; a shard that backward no longer reads leaves both lists.

Returns None where the graphs do not have that shape (the caller then partitions again).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Collection

import torch
import torch.fx as fx

from graphshard.passes.graph_utils import is_unshard
from graphshard.passes.markers import UnshardSpec

_NO_VC_CHECK = "saved_tensor_with_no_vc_check"


def keep_gathered(forward: fx.GraphModule, backward: fx.GraphModule, params: Collection[str]
                  ) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """Copies of (`forward`, `backward`) in which forward keeps the gathered weights of
    `params` for backward, or None where the partition's saved values cannot be matched."""
    forward, backward = copy.deepcopy(forward), copy.deepcopy(backward)
    gathered = {UnshardSpec.from_node(n).name: n for n in forward.graph.nodes
                if is_unshard(n) and UnshardSpec.from_node(n).name in params}
    regathers = [n for n in backward.graph.nodes
                 if is_unshard(n) and UnshardSpec.from_node(n).name in params]
    if any(UnshardSpec.from_node(n).name not in gathered for n in regathers):
        return None
    if not regathers:  # nothing gathered again: the partition keeps them already
        return forward, backward
    fw_output = forward.graph.output_node()
    outputs = list(fw_output.args[0])
    bw_inputs = list(backward.graph.find_nodes(op="placeholder"))
    saved = {n.name for n in bw_inputs} & {n.name for n in outputs if isinstance(n, fx.Node)}
    checked = [i for i, n in enumerate(outputs) if isinstance(n, fx.Node) and n.name in saved
               and isinstance(n.meta.get("val"), torch.Tensor) and not n.meta.get(_NO_VC_CHECK)]
    descs = list(fw_output.meta.get("desc") or [None] * len(outputs))
    if not checked or len(descs) != len(outputs):
        return None  # nothing saved to place it beside, or descriptors that do not match
    fw_at = checked[-1]
    placeholders = {n.name: n for n in bw_inputs}
    bw_after = placeholders[outputs[fw_at].name]

    for regather in regathers:
        weight = gathered[UnshardSpec.from_node(regather).name]
        if weight.name in saved:  # already saved (a unit's weight read by two regathers)
            placeholder = placeholders[weight.name]
        else:
            descs.insert(fw_at + 1, descs[fw_at])
            fw_at += 1
            outputs.insert(fw_at, weight)
            with backward.graph.inserting_after(bw_after):
                placeholder = backward.graph.placeholder(weight.name)
            placeholder.meta = copy.copy(weight.meta)  # as the partitioner copies a saved value's
            bw_after = placeholders[weight.name] = placeholder
            saved.add(weight.name)
        regather.replace_all_uses_with(placeholder)
        erased = _erase_with_dead_inputs(backward.graph, regather)
        if placeholder.name != weight.name:  # the name's holder (one joint node) may be gone
            if weight.name not in erased:
                return None
            placeholder.name = weight.name  # a saved value's name in both graphs, as partitioned

    # saved values backward no longer reads (the shards it gathered): out of both lists
    unread = {n.name for n in backward.graph.find_nodes(op="placeholder")
              if n.name in saved and not n.users}
    # the last occurrence of each is the saved one (a value may also be returned, earlier)
    for at in reversed(range(len(outputs))):
        node = outputs[at]
        if isinstance(node, fx.Node) and node.name in unread:
            unread.discard(node.name)
            if not isinstance(node.meta.get("val"), torch.Tensor):
                continue  # symbolic sizes stay: the saved tensors' shapes may bind them
            del descs[at], outputs[at]
            backward.graph.erase_node(placeholders[node.name])
    fw_output.args = (tuple(outputs),)
    if "desc" in fw_output.meta:
        fw_output.meta["desc"] = _numbered(descs)
    forward.graph.lint()
    backward.graph.lint()
    forward.recompile()
    backward.recompile()
    return forward, backward


def _numbered(descs: list) -> list:
    """AOTAutograd's output descriptors with the saved values numbered in order again."""
    numbered, index = [], 0
    for desc in descs:
        if type(desc).__name__.startswith("SavedForBackwards"):
            desc = dataclasses.replace(desc, idx=index)
            index += 1
        numbered.append(desc)
    return numbered


def _erase_with_dead_inputs(graph: fx.Graph, node: fx.Node) -> set[str]:
    """Erase `node`, then each input it leaves unused (not placeholders: those are saved values,
    handled by the caller); the erased nodes' names."""
    pending, erased = [node], set()
    while pending:
        dead = pending.pop()
        inputs = [n for n in dead.all_input_nodes if n.op != "placeholder"]
        erased.add(dead.name)
        graph.erase_node(dead)
        pending.extend(n for n in inputs if not n.users and n not in pending)
    return erased
