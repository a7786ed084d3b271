"""Graph helpers shared by every pass: what a node is, what it costs in bytes, how to emit ops.

Passes are pure functions over a GraphModule; the questions they all ask of a node (is it a
collective, which wait belongs to it, how many bytes is it) are answered here, once.
"""

from __future__ import annotations

import heapq
import operator
from fractions import Fraction
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from graphshard.passes import meta_keys
from graphshard.passes.markers import UnshardSpec, dim0_chunk  # noqa: F401 (re-exported)
# Fake tensors are how a pass computes the shapes of the nodes it emits (private torch API).
from graphshard._torch_compat import (fake_mode_of_value, fake_tensor_mode, free_storage_op,
                                      is_op_overload, real_tensors, tree_map_only)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default
ALL_TO_ALL = c10d.all_to_all_single.default
FREE_STORAGE = free_storage_op()  # (tensor, 0): frees the tensor's storage where it runs
COLLECTIVES = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce"}


def _is_op(node: fx.Node, name: str) -> bool:
    # Dynamo graphs call the overload packet, AOTAutograd graphs the .default overload.
    if node.op != "call_function" or not hasattr(torch.ops.graphshard, name):
        return False
    packet = getattr(torch.ops.graphshard, name)
    return node.target is packet or node.target is packet.default


def is_unshard(node: fx.Node) -> bool:
    return _is_op(node, "unshard")


def is_reduce_grad(node: fx.Node) -> bool:
    return _is_op(node, "reduce_grad")


def is_float8_scale(node: fx.Node) -> bool:
    return _is_op(node, "float8_scale")


def is_exchange_with_peers(node: fx.Node) -> bool:
    """graphshard::exchange_with_peers (compiler/ops.py): an all-to-all that leaves the rank's
    own chunk out, its splits found when it runs, so that every rank shares one graph."""
    return _is_op(node, "exchange_with_peers")


def all_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """Nodes of the graph and of its subgraphs (activation-checkpoint and other HOP bodies)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from module.graph.nodes


def call_nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _transported(node: fx.Node) -> bool:
    """An all-to-all the transport stage made of one of our collectives (it keeps the kind)."""
    return ((node.target is ALL_TO_ALL or is_exchange_with_peers(node))
            and node.meta.get(meta_keys.LOWERED_FROM) in COLLECTIVES.values())


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in COLLECTIVES or _transported(node))


def is_graphshard_collective(node: fx.Node) -> bool:
    """One of the collectives graphshard inserted (a parameter's gather, a gradient's
    reduction), as opposed to one the model's own code traced into the graph (a TP plan's
    DTensor redistributions): only ours are bucketed, moved and freed by the passes."""
    return is_collective(node) and meta_keys.ROLE in node.meta


def collective_kind(node: fx.Node) -> str:
    """all_gather / reduce_scatter / all_reduce: what the collective does for us, whichever
    op carries it."""
    return node.meta[meta_keys.LOWERED_FROM] if _transported(node) else COLLECTIVES[node.target]


def is_view(node: fx.Node) -> bool:
    """Free ops: metadata-only views (an in-place op also aliases, but does real work)."""
    if node.target is operator.getitem or node.target is aten._unsafe_view.default:
        return True
    return is_op_overload(node.target) and node.target.is_view


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def wait_of(collective: fx.Node) -> fx.Node:
    """The wait_tensor that completes `collective` (functional collectives have exactly one)."""
    waits = [user for user in collective.users if is_wait(user)]
    if len(waits) != 1:
        raise ValueError(f"collective {collective.name} has {len(waits)} waits, expected 1")
    return waits[0]


def collective_group(node: fx.Node) -> tuple[str, int]:
    """(group_name, group_size) of a functional collective node."""
    if node.target is ALL_GATHER:
        return node.args[2], node.args[1]
    if node.target is REDUCE_SCATTER:
        return node.args[3], node.args[2]
    if node.target is ALL_REDUCE:
        return node.args[2], node.meta.get(meta_keys.GROUP_SIZE, 0)
    if is_exchange_with_peers(node) and _transported(node):
        return node.args[2], node.args[1]
    if _transported(node):
        return node.args[3], len(node.args[1])
    raise ValueError(f"{node.name} is not a collective")


def tensor_val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor; a symbolic size counts at its hint (an unbacked one at the size
    Inductor assumes for one too), never guarding on it."""
    numel = t.numel()
    if isinstance(numel, torch.SymInt):
        numel = optimization_hint(numel, fallback=8192)
    return int(numel) * t.element_size()


def node_bytes(node: fx.Node) -> int:
    val = tensor_val(node)
    return 0 if val is None else tensor_bytes(val)


def full_buffer(collective: fx.Node) -> fx.Node:
    """The node whose value is the full (unsharded) buffer a collective moves: all-gather's
    and an exchange's output (less the own chunk an exchange keeps local: exchange_share),
    reduce-scatter's and all-reduce's input."""
    if collective.target is ALL_GATHER or _transported(collective):
        return collective
    return collective.args[0]


def unsharded_bytes(collective: fx.Node) -> int:
    """Size of the full (unsharded) buffer a collective moves."""
    return int(node_bytes(full_buffer(collective)) * exchange_share(collective))


def exchange_share(exchange: fx.Node) -> Fraction:
    """The full buffer over an exchange's output: N / (N - 1) where the rank's own chunk
    stays local, else 1."""
    if not is_exchange_with_peers(exchange):
        return Fraction(1)
    group_size = exchange.args[1]
    return Fraction(group_size, group_size - 1)


def fake_mode_of(gm: fx.GraphModule):
    """The fake mode of the graph's values (None if they are not fake tensors)."""
    for node in gm.graph.nodes:
        mode = fake_mode_of_value(tensor_val(node))
        if mode is not None:
            return mode
    return None


# --------------------------------------------------------------------------- emitters
#
# The collective lowering is written once, against an emitter: run eagerly it computes on real
# tensors (the marker ops' eager implementation); run on a graph it appends FX nodes with
# fake values (the insert_collectives pass). The same code is both the runtime and the compiler.


class EagerEmitter:
    def __call__(self, op: Callable, *args, **kwargs):
        return op(*args, **kwargs)

    def val(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass
class GraphEmitter:
    """Appends each op as a call_function node, with meta["val"] computed on fake tensors."""

    graph: fx.Graph
    fake_mode: Any  # the graph's FakeTensorMode, or None (a fresh one)
    meta: dict | None = None  # copied onto every new node (provenance, module stack)

    def __call__(self, op: Callable, *args, **kwargs):
        node = self.graph.call_function(op, args, kwargs)
        if self.meta:
            node.meta.update(self.meta)
        fake_args, fake_kwargs = tree_map_only(
            fx.Node, lambda n: n.meta["val"], (args, kwargs)
        )
        with real_tensors():
            mode = self.fake_mode or fake_tensor_mode()
            with mode:
                node.meta["val"] = op(*fake_args, **fake_kwargs)
        return node

    def val(self, x: fx.Node) -> torch.Tensor:
        return x.meta["val"]


def finalize_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """After surgery: drop dead pure nodes, lint, recompile."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: index for index, node in enumerate(graph.nodes)}


# --------------------------------------------------------------------------- ordering


def list_schedule(nodes: Iterable[fx.Node], priority: Mapping[fx.Node, float],
                  after: Mapping[fx.Node, fx.Node] | None = None) -> list[fx.Node]:
    """The one ordering mechanism of passes/: repeatedly take, of the nodes whose inputs are
    all taken, the one of least priority (ties: the earlier in `nodes`). Placeholders come
    first, as FX expects. A policy is only a choice of priorities. `after[node]`: one more
    node that must be taken before `node`, as if it were an input."""
    nodes = list(nodes)
    after = after or {}
    position = {node: index for index, node in enumerate(nodes)}
    missing = {node: sum(arg in position for arg in node.all_input_nodes) + (node in after)
               for node in nodes}
    followers: dict[fx.Node, list[fx.Node]] = {}
    for node, first in after.items():
        followers.setdefault(first, []).append(node)

    def entry(node: fx.Node) -> tuple:
        return (node.op != "placeholder", priority[node], position[node])

    ready = [entry(node) for node in nodes if missing[node] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)[-1]]
        order.append(node)
        for user in [*node.users, *followers.get(node, ())]:
            if user in missing:
                missing[user] -= 1
                if missing[user] == 0:
                    heapq.heappush(ready, entry(user))
    if len(order) != len(nodes):
        raise RuntimeError("graph has a cycle; a pass produced an invalid graph")
    return order


def apply_order(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Move the graph's nodes into `order` (all of them, a topological order)."""
    cursor = None
    for node in order:
        if cursor is None:
            first = next(iter(graph.nodes))
            if first is not node:
                first.prepend(node)
        elif cursor.next is not node:
            cursor.append(node)
        cursor = node


def stable_topological_sort(graph: fx.Graph) -> None:
    """Re-sort so every node follows its inputs, moving as few nodes as possible: a node whose
    input now comes later waits until that input is placed (users move down)."""
    nodes = list(graph.nodes)
    apply_order(graph, list_schedule(nodes, {node: index for index, node in enumerate(nodes)}))


def hoist_before(anchor: fx.Node, node: fx.Node) -> None:
    """Move `node`, and those of its ancestors placed after `anchor`, to just before `anchor`
    (keeping their relative order), so `node` can be computed at that point."""
    to_move: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in to_move or current < anchor:  # fx.Node compares by graph position
            continue
        if current.op == "placeholder":
            raise ValueError(f"cannot hoist {node.name}: placeholder {current.name} is after the anchor")
        to_move.add(current)
        stack.extend(current.all_input_nodes)
    for moved in sorted(to_move):
        anchor.prepend(moved)


def depends_only_on_inputs(node: fx.Node) -> bool:
    """True if `node` is computed from graph inputs by plain ops alone (no collective on the
    way but a float8 scale's all-reduce, itself computed from inputs: a float8 gather's input
    is its shard cast with that scale), so it can be moved to any earlier point."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op in ("placeholder", "get_attr"):
            continue
        if current.op != "call_function":
            return False
        if ((is_collective(current) or is_wait(current))
                and current.meta.get(meta_keys.ROLE) != "float8_scale"):
            return False
        stack.extend(current.all_input_nodes)
    return True


def collective_params(node: fx.Node) -> tuple[str, ...]:
    return tuple(node.meta.get(meta_keys.PARAMS, ()))


def unshard_specs(gm: fx.GraphModule, *, subgraphs: bool = False) -> dict[str, UnshardSpec]:
    """Parameter name -> the spec of its unshard marker, in graph order (with `subgraphs`, the
    markers inside activation-checkpoint and other HOP bodies too)."""
    nodes = all_nodes(gm) if subgraphs else gm.graph.nodes
    specs = (UnshardSpec.from_node(node) for node in nodes if is_unshard(node))
    return {spec.name: spec for spec in specs}
