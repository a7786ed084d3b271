"""Free each collective's buffers on the graph's own thread, right after their last use.

A collective's work object holds its input and output tensors until it is destroyed, and gloo
destroys it on its worker thread when that thread next runs, which on a busy CPU can be
milliseconds after the wait returned, while the graph goes on to allocate the next unit's
buffers. Measured (8-block transformer, seq 32, world size 2, all-to-all transports): in some
runs a reduce-scatter's send and receive buffers (6 MiB) were still allocated when the next
all-gather's arrived, 2.1 MiB over the memory model's peak, on one rank or the other. Resizing a
buffer's storage to zero frees its bytes whoever still holds the tensor object; the memory model
already counts each buffer freed at its last use, so the schedule and the predicted peak do not
change. FSDP frees its all-gather buffers the same way.

Only buffers the graph allocated and nothing later reads, counting as readers of a buffer the
consumers of each reader's result (where Inductor's pattern passes may move the read), those of
a concatenation's parts (Inductor computes them into it) and of any op Inductor may drop as a
no-op (a clone of a gathered weight is the weight): never a graph input, nor a buffer an output
shares (saved for backward, a gradient), and a collective's input only after its wait (any op
with a wait reads until it).
Never a buffer an all-reduce reads: Inductor runs the all-reduce in place on a copy of its input
and drops the copy where it can, so the input's buffer may become the result (hybrid sharding's
reduce-scatter output, all-reduced across replicas, is returned as the gradient); nor one whose
views are concatenated back whole (Inductor may replace that concatenation by the buffer itself).

Runs last, after the transport: it frees what the collectives that run actually hold.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import (ALL_REDUCE, FREE_STORAGE, aten, finalize_graph, is_collective,
                                          is_wait, node_order)
from graphshard.passes.liveness import Buffers


def free_collective_buffers(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    graph = gm.graph
    order = node_order(graph)
    buffers = Buffers(gm)
    holders: dict[int, list[fx.Node]] = {}  # buffer -> the nodes whose value shares it
    for node in graph.nodes:
        for b in buffers.owned.get(node, ()):
            holders.setdefault(b, []).append(node)
    collectives = [n for n in graph.nodes if is_collective(n)]
    kept = set(buffers.inputs)
    kept.update(b for node in graph.output_node().all_input_nodes for b in buffers.owned.get(node, ()))
    kept.update(b for c in collectives if c.target is ALL_REDUCE
                for value in c.all_input_nodes for b in buffers.owned.get(value, ()))

    def sharing(b: int) -> set[fx.Node]:
        """The nodes whose value may live in buffer `b` once Inductor has compiled the graph:
        those that share it; the parts of a concatenation, which Inductor computes straight into
        its buffer; and what Inductor may drop as a no-op, any op whose result has its input's
        shape, strides and dtype (a clone, a same-dtype conversion: the result is the input)."""
        parts = [n for h in holders[b] if h.target is aten.cat.default for part in h.args[0]
                 for pb in buffers.owned.get(part, ()) if pb not in buffers.inputs for n in holders[pb]]
        found: set[fx.Node] = set()
        pending = [*holders[b], *parts]
        while pending:
            node = pending.pop()
            if node not in found:
                found.add(node)
                pending.extend(n for nb in buffers.owned.get(node, ()) for n in holders[nb])
                pending.extend(user for user in node.users
                               if _maybe_no_op(user, node) or _rejoins(user, b, buffers))
        return found

    def read_until(node: fx.Node) -> fx.Node:  # a collective reads its input until its wait
        waits = [user for user in node.users if is_wait(user)]
        return max(waits, key=order.__getitem__) if waits else node

    last_use: dict[int, fx.Node] = {}  # collective buffer -> the node after which it is dead
    for collective in collectives:
        for value in (collective, *collective.all_input_nodes):
            for b in set(buffers.owned.get(value, ())) - kept - last_use.keys():  # once per buffer
                shared = sharing(b)
                if any(set(buffers.owned.get(n, ())) & kept for n in shared):
                    continue  # may be an input or an output once compiled
                readers = [read_until(n) for h in shared for n in (h, *h.users)]
                # Inductor's pattern passes may fuse a reader into its consumer, at the
                # consumer's place (add(mm(x, w), y) -> addmm(y, x, w) where the add was): the
                # buffer is read there too.
                readers += [c for r in readers if not is_wait(r) for c in r.users if c.op != "output"]
                last_use[b] = max(readers, key=order.__getitem__)
    for b, last in last_use.items():
        tensor = next((h for h in holders[b] if _storage_is(h, buffers, b)), None)
        if tensor is None:
            continue
        with graph.inserting_after(last):
            freed = graph.call_function(FREE_STORAGE, (tensor, 0))
        freed.meta["val"] = None
    return finalize_graph(gm)


def _maybe_no_op(node: fx.Node, source: fx.Node) -> bool:
    """Whether Inductor may replace `node` by `source`, its first input (Inductor's no-op
    removal only drops ops whose result has the input's shape, strides and dtype; graphshard's
    own ops, such as the all-to-all reduce-scatter's local sum, always run)."""
    if node.op != "call_function" or not node.args or node.args[0] is not source:
        return False
    if getattr(node.target, "namespace", None) == "graphshard":
        return False
    if is_wait(node) or any(is_wait(user) for user in node.users):  # a collective, not a no-op
        return False
    before, after = source.meta.get("val"), node.meta.get("val")
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
            and after.shape == before.shape and after.stride() == before.stride()
            and after.dtype == before.dtype)


def _rejoins(node: fx.Node, b: int, buffers: Buffers) -> bool:
    """Whether `node` concatenates nothing but views of buffer `b`: Inductor replaces a
    concatenation of a split's pieces, in order, by the split buffer itself, so `b` may live on
    as the concatenation. (Bucketing emits none for hybrid sharding's all-reduce, which reads the
    reduce-scatter's output directly; the rule holds for any graph that does.)"""
    return (node.op == "call_function" and node.target is aten.cat.default
            and all(isinstance(part, fx.Node) and buffers.owned.get(part) == (b,)
                    for part in node.args[0]))


def _storage_is(node: fx.Node, buffers: Buffers, b: int) -> bool:
    """Whether `node`'s value is one tensor whose storage is buffer `b` (not a tuple of them)."""
    return isinstance(node.meta.get("val"), torch.Tensor) and buffers.owned.get(node) == (b,)
