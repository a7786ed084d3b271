"""The two-lane simulator: how long a graph takes in its node order, and how much of its
communication is exposed, by the cost model's prices; its memory is the liveness model's."""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Mapping

import torch.fx as fx

from graphshard.compiler.cost_model import (ClusterSpec, CollectiveCost, GroupSizes, collective_node_cost,
                                   is_plain_number, node_cost, priced_evaluations)
from graphshard.passes import meta_keys
from graphshard.passes.graph_utils import collective_group, is_collective, is_wait
from graphshard.passes.liveness import MemoryEstimate, graph_memory


@dataclass(frozen=True)
class Event:
    name: str
    lane: str  # "compute" or "comm"
    start_s: float
    dur_s: float
    kind: str  # "compute", a collective kind, or "wait" (compute blocked on a collective)


@dataclass(frozen=True)
class CollectiveEstimate:
    name: str
    kind: str
    nbytes: int
    group_size: int
    issue_s: float  # when compute reached it in node order
    start_s: float  # when the comm lane was free for it
    dur_s: float
    hidden_s: float  # overlapped with compute
    exposed_s: float  # not overlapped with compute


@dataclass(frozen=True)
class GraphEstimate:
    total_s: float
    compute_s: float  # sum of compute node times
    model_compute_s: float  # of those, the model's own (not graphshard's casts and copies)
    flops: int  # of the compute nodes (matmuls, convolutions, attention)
    comm_s: float  # sum of collective times
    exposed_comm_s: float  # total - compute: time compute spent blocked on collectives
    events: tuple[Event, ...]
    collectives: tuple[CollectiveEstimate, ...]
    memory: MemoryEstimate

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.peak_bytes

    def chrome_trace(self, graph: str = "graph") -> dict:
        """This graph alone as a Chrome trace (module-level `chrome_trace`)."""
        return chrome_trace({graph: self})  # the module's function: methods see no class scope


_LANE_TID = {"compute": 0, "comm": 1}


def chrome_trace(graphs: Mapping[str, GraphEstimate], process_name: str | None = None,
                 event_args: Mapping[tuple[str, str], dict] | None = None) -> dict:
    """chrome://tracing / Perfetto JSON of `graphs` ({name: estimate}) run one after another, in
    mapping order: thread 0 is compute (nodes, and "wait" where compute is blocked on a
    collective), thread 1 communication; zero-length events dropped. `process_name` names the
    process and the two threads; `event_args`: extra args of an event, by (graph, node name)."""
    events: list[dict] = []
    if process_name is not None:
        events += [
            {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": process_name}},
            {"ph": "M", "pid": 0, "tid": 0, "name": "thread_name", "args": {"name": "compute"}},
            {"ph": "M", "pid": 0, "tid": 1, "name": "thread_name",
             "args": {"name": "communication"}},
        ]
    event_args = event_args or {}
    offset = 0.0
    for graph, estimate in graphs.items():
        for e in estimate.events:
            if e.dur_s <= 0:
                continue
            events.append({"name": e.name, "cat": f"{graph},{e.kind}", "ph": "X", "pid": 0,
                           "tid": _LANE_TID[e.lane], "ts": (offset + e.start_s) * 1e6,
                           "dur": e.dur_s * 1e6,
                           "args": {"graph": graph, **event_args.get((graph, e.name), {})}})
        offset += estimate.total_s
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _waited_collective(wait: fx.Node) -> fx.Node | None:
    src = wait.args[0]
    while isinstance(src, fx.Node) and src.target is operator.getitem:
        src = src.args[0]
    return src if isinstance(src, fx.Node) and is_collective(src) else None


def _overlap(busy: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Length of [a, b) covered by the sorted, disjoint `busy` intervals."""
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    covered = 0.0
    while i < len(busy) and busy[i][0] < b:
        covered += max(0.0, min(busy[i][1], b) - max(busy[i][0], a))
        i += 1
    return covered


def graph_estimate(gm: fx.GraphModule | fx.Graph, spec: ClusterSpec,
                   world_size: GroupSizes = None,
                   group_specs: Mapping[str, ClusterSpec] | None = None,
                   graph_kind: str = "forward") -> GraphEstimate:
    """Simulate the graph on two lanes, in node order, deterministically.

    Compute nodes run back to back on the compute lane. A collective is issued when compute
    reaches it and starts once the comm lane is free (one collective at a time, as on one
    gloo/NCCL stream), after the wait for the slowest rank (`ClusterSpec.skew_wait_s` of the
    compute since the ranks last met). A wait_tensor blocks compute until its collective
    ends; where `spec.comm_overlaps_compute` is False, so does the collective itself. `group_specs`:
    the spec a process group's collectives see (by group name; e.g. `spec.link(spans_nodes)`).
    `graph_kind`: "backward" for a backward graph, whose memory counts the saved activations
    it frees as it goes.
    """
    if not (world_size is None or isinstance(world_size, Mapping) or is_plain_number(world_size)):
        raise ValueError(f"graph_estimate simulates numbers: world_size must be an int, a "
                         f"{{group_name: int}} mapping or None, got {world_size!r}")
    compute_t = comm_free = met_s = 0.0  # met_s: when the ranks last met in a collective
    flops, model_compute_s = 0, 0.0
    events: list[Event] = []
    issued: dict[fx.Node, tuple[CollectiveCost, float, float, float]] = {}
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    evaluations = priced_evaluations(spec, graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if is_collective(node):
            link = (group_specs or {}).get(collective_group(node)[0], spec)
            cost = collective_node_cost(node, link, world_size)
            # waiting for the slowest rank is part of the collective's time, as a profile shows it
            seconds = cost.seconds + (link.skew_wait_s(compute_t - met_s) if cost.seconds else 0.0)
            start = max(compute_t, comm_free)
            comm_free = met_s = start + seconds
            if not spec.comm_overlaps_compute:
                compute_t = comm_free  # the collective holds the cores compute would use
            issued[node] = (cost, seconds, compute_t, start)
            events.append(Event(node.name, "comm", start, seconds, cost.kind))
        elif is_wait(node):
            coll = _waited_collective(node)
            if coll is not None and coll in issued:
                _, seconds, _, start = issued[coll]
                end = start + seconds
                if end > compute_t:
                    events.append(Event(node.name, "compute", compute_t, end - compute_t, "wait"))
                    compute_t = end
        else:
            cost = node_cost(node, spec, evaluations=evaluations.get(node))
            events.append(Event(node.name, "compute", compute_t, cost.seconds, "compute"))
            compute_t += cost.seconds
            flops += cost.flops
            if meta_keys.ROLE not in node.meta:  # the passes mark every node they insert
                model_compute_s += cost.seconds

    busy = [(e.start_s, e.start_s + e.dur_s) for e in events
            if e.lane == "compute" and e.kind == "compute" and e.dur_s > 0]
    starts = [b[0] for b in busy]
    collectives = []
    for node, (cost, seconds, issue, start) in issued.items():
        hidden = _overlap(busy, starts, start, start + seconds)
        collectives.append(CollectiveEstimate(
            node.name, cost.kind, int(cost.nbytes), int(cost.group_size), issue, start,
            seconds, hidden, max(seconds - hidden, 0.0)))
    compute_s = sum(e.dur_s for e in events if e.kind == "compute")
    total = max(compute_t, comm_free)
    return GraphEstimate(total, compute_s, model_compute_s, flops,
                         sum(c.dur_s for c in collectives), max(total - compute_s, 0.0),
                         tuple(events), tuple(collectives), graph_memory(gm, graph_kind))
