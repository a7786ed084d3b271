"""The memory model: which buffers each node's value keeps alive, and what they add up to.

One model for the scheduler (what a collective holds in flight) and for `graphshard dump` (the
predicted per-rank peak), so the budget the scheduler keeps is the memory the user is shown.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

import torch
import torch.fx as fx

from graphshard.passes.graph_utils import collective_kind, is_collective, is_wait, tensor_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    placeholder_bytes: int  # graph inputs and constants the caller keeps: live throughout
    peak_transient_bytes: int  # peak of what the graph allocates, plus the inputs it may free
    peak_bytes: int  # placeholder_bytes + peak_transient_bytes
    peak_node: str | None  # the node at which the transient peak occurs


def _graph(gm: fx.GraphModule | fx.Graph) -> fx.Graph:
    return gm.graph if isinstance(gm, fx.GraphModule) else gm


def _aliases_input(node: fx.Node) -> bool:
    """True if the node's output shares storage with an input (views, in-place ops, waits)."""
    if is_wait(node) or node.target is operator.getitem:
        return True
    if node.target is torch.ops.aten._unsafe_view.default:  # a view in practice, not by schema
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


class Buffers:
    """Storages, not nodes: a node that allocates gets one buffer per tensor it returns; a
    view, an in-place op or a wait shares its input's buffers; getitem picks one output's.
    Inputs and constants (placeholder, get_attr) are the caller's, live throughout, except the
    placeholders named in `freed_inputs`: handed over to the graph, which frees each after its
    last use like a buffer of its own."""

    def __init__(self, gm: fx.GraphModule | fx.Graph, freed_inputs: Collection[str] = ()):
        self.sizes: list[int] = []
        self.owned: dict[fx.Node, tuple[int, ...]] = {}  # buffers a node's value keeps alive
        self.inputs: set[int] = set()
        per_output: dict[fx.Node, list[tuple[int, ...]]] = {}  # multi-output allocations
        for node in _graph(gm).nodes:
            val = node.meta.get("val")
            if node.op == "get_attr" and val is None and isinstance(gm, fx.GraphModule):
                val = getattr(gm, str(node.target), None)
            if node.op in ("placeholder", "get_attr"):
                self.owned[node] = self._new(val)
                if node.name not in freed_inputs:
                    self.inputs.update(self.owned[node])
            elif node.op == "call_function" and _aliases_input(node):
                src = node.args[0] if node.args else None
                if node.target is operator.getitem and src in per_output:
                    self.owned[node] = per_output[src][node.args[1]]
                else:
                    self.owned[node] = self.owned.get(src, ()) if isinstance(src, fx.Node) else ()
            elif node.op in ("call_function", "call_module", "call_method"):
                if isinstance(val, (tuple, list)):
                    per_output[node] = [self._new(v) for v in val]
                    self.owned[node] = tuple(b for bufs in per_output[node] for b in bufs)
                else:
                    self.owned[node] = self._new(val)

    def _new(self, val: Any) -> tuple[int, ...]:
        tensors = [v for v in (val if isinstance(val, (tuple, list)) else [val])
                   if isinstance(v, torch.Tensor)]
        self.sizes.extend(tensor_bytes(t) for t in tensors)
        return tuple(range(len(self.sizes) - len(tensors), len(self.sizes)))

    def bytes_of(self, nodes: Iterable[fx.Node]) -> int:
        """Bytes of the distinct buffers the values of `nodes` keep alive."""
        buffers = {b for node in nodes for b in self.owned.get(node, ())}
        return sum(self.sizes[b] for b in buffers)

    def held_in_flight(self, collective: fx.Node) -> int:
        """What a collective keeps allocated from issue to wait: an all-gather its output,
        a reduction its input (read until it completes)."""
        if collective_kind(collective) == "all_gather":
            return self.bytes_of([collective])
        return self.bytes_of(collective.all_input_nodes)


def memory_estimate(gm: fx.GraphModule | fx.Graph,
                    freed_inputs: Collection[str] = ()) -> MemoryEstimate:
    """Liveness walk over buffers in node order (`live_bytes`). `freed_inputs`: placeholders
    the graph frees after their last use (see `saved_activations`)."""
    buffers = Buffers(gm, freed_inputs)
    nodes = list(_graph(gm).nodes)
    live = live_bytes(nodes, buffers)
    peak = max(live, default=0)
    peak_node = nodes[live.index(peak)].name if peak > 0 else None
    placeholder_bytes = sum(buffers.sizes[b] for b in buffers.inputs)
    return MemoryEstimate(placeholder_bytes, peak, placeholder_bytes + peak, peak_node)


def live_bytes(nodes: Sequence[fx.Node], buffers: Buffers,
               counted: Callable[[fx.Node], bool] | None = None) -> list[int]:
    """Bytes allocated beyond the inputs while each of `nodes` runs, in the order given (a
    schedule not yet applied to the graph): a buffer is freed after the last node that uses
    anything sharing it (outputs stay to the end); a collective reads its input until its wait.
    `counted`: only the buffers of the nodes it accepts (None: all)."""
    index = {n: i for i, n in enumerate(nodes)}
    born: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for node in nodes:
        for b in buffers.owned.get(node, ()):
            born.setdefault(b, index[node])
            last_use[b] = max(last_use.get(b, 0), index[node])
        done = index[node]
        if is_collective(node):
            done = max((index[u] for u in node.users if is_wait(u)), default=done)
        for user_input in node.all_input_nodes:
            for b in buffers.owned.get(user_input, ()):
                last_use[b] = max(last_use[b], done)

    frees: dict[int, list[int]] = {}
    for b, i in last_use.items():
        frees.setdefault(i, []).append(b)
    born_at: dict[int, list[int]] = {}
    for b, i in born.items():
        born_at.setdefault(i, []).append(b)
    ignored = {b for b, i in born.items() if counted is not None and not counted(nodes[i])}
    ignored |= buffers.inputs
    live, timeline = 0, []
    for i in range(len(nodes)):
        live += sum(buffers.sizes[b] for b in born_at.get(i, ()) if b not in ignored)
        timeline.append(live)
        live -= sum(buffers.sizes[b] for b in frees.get(i, ()) if b not in ignored)
    return timeline


def saved_activations(backward: fx.GraphModule | fx.Graph) -> set[str]:
    """The backward's placeholders that are not forward inputs (AOTAutograd names those
    primals_*: parameter shards and the batch, which the model keeps): the activations forward
    saved and the incoming gradient. The compiled backward takes them over and frees each
    after its last use (AOTAutograd clears the saved tensors it passes; Inductor's code drops
    its inputs as it goes), so they count as the backward's own memory, not the model's."""
    return {n.name for n in _graph(backward).nodes
            if n.op == "placeholder" and not n.name.startswith("primals")}


@dataclass(frozen=True)
class StepMemory:
    """What a training step's graphs hold beyond the model's state and the batch."""

    forward_peak_bytes: int  # forward's own peak, including the activations it saves
    backward_saved_bytes: int  # the saved activations (and incoming gradient) backward starts with
    # backward's peak: what is left of those plus what it allocates (its gradients included)
    backward_peak_bytes: int
    peak_graph: str  # "forward" or "backward"
    peak_node: str | None

    @property
    def transient_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)


def graph_memory(gm: fx.GraphModule | fx.Graph, graph_kind: str) -> MemoryEstimate:
    """A partitioned graph's estimate: a backward frees its saved activations as it goes."""
    return memory_estimate(gm, saved_activations(gm) if graph_kind == "backward" else ())


def step_memory(forward: fx.GraphModule, backward: fx.GraphModule | None,
                forward_estimate: MemoryEstimate | None = None,
                backward_estimate: MemoryEstimate | None = None) -> StepMemory:
    """Forward then backward. Pass the graphs' estimates (`graph_memory`) where they are
    already computed."""
    fw = forward_estimate or graph_memory(forward, "forward")
    if backward is None:
        return StepMemory(fw.peak_transient_bytes, 0, 0, "forward", fw.peak_node)
    bw = backward_estimate or graph_memory(backward, "backward")
    saved_names = saved_activations(backward)
    saved = sum(tensor_bytes(n.meta["val"]) for n in backward.graph.nodes
                if n.name in saved_names and isinstance(n.meta.get("val"), torch.Tensor))
    backward_peak = bw.peak_transient_bytes > fw.peak_transient_bytes
    return StepMemory(fw.peak_transient_bytes, saved, bw.peak_transient_bytes,
                      "backward" if backward_peak else "forward",
                      bw.peak_node if backward_peak else fw.peak_node)
