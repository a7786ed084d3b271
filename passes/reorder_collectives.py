"""Reorder collectives so communication hides behind compute, within a memory budget.

One mechanism, three policies (all inputs of the pass):
- all-gather waits sink to just before the first use of their result (copy-outs with them),
  and each all-gather to just before its wait: the no-prefetch baseline;
- all-gathers are prefetched: bucket k is issued right after bucket k-d is waited on, i.e.
  before unit k-d's compute, for d <= `prefetch`. Of the allowed depths the pass takes the
  shallowest whose compute (by the cost model) covers the gather's time, holding memory no longer
  than needed, and never one that would put more than `max_inflight_mb` of prefetched
  (issued, not yet needed) unsharded bytes in flight. Budget 0 means no prefetch;
- reduce-scatters / all-reduces are issued as soon as their gradients exist and waited on just
  before the next one is issued (at most one in flight), so the wait never blocks the next
  unit's compute. A delayed reduction holds its unsharded input until its wait, so under a
  budget it is delayed only if it fits beside the prefetched gathers in flight meanwhile;
  otherwise it is waited on where it was issued.
Nodes only move within what their data dependencies allow; the graph stays topologically valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from passes.graph_utils import (
    collective_kind,
    hoist_before,
    is_collective,
    is_wait,
    finalize_graph,
    stable_topological_sort,
    unsharded_bytes,
    wait_of,
)

NodeSeconds = Callable[[fx.Node], float]


@dataclass(frozen=True)
class ReorderPolicy:
    prefetch: int = 1  # max units ahead an all-gather may be issued
    # unsharded bytes held in flight beyond need: prefetched gathers, delayed reductions' inputs
    max_inflight_bytes: float = math.inf
    compute_seconds: NodeSeconds | None = None  # cost model; None: always prefetch fully
    collective_seconds: NodeSeconds | None = None


def _output_chain(wait: fx.Node) -> list[fx.Node]:
    """Nodes our passes emitted after a collective's wait (narrow, copy-out, casts): they move
    with the wait. Identified by sharing the collective's graphshard provenance."""
    role = wait.meta.get("graphshard_role")
    chain, frontier = [], [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if (user.op == "call_function" and user.meta.get("graphshard_role") == role
                    and user.meta.get("graphshard_params") == wait.meta.get("graphshard_params")
                    and not is_collective(user) and not is_wait(user) and user not in chain):
                chain.append(user)
                frontier.append(user)
    return chain


def _sink_block(nodes: list[fx.Node]) -> None:
    """Move a wait and its copy-out chain, as one block, to just before the first node outside
    the block that uses any of them. As a block: copying out one parameter at a time would keep
    the whole gathered buffer alive next to the copies."""
    block = set(nodes)
    outside_users = [user for node in nodes for user in node.users if user not in block]
    if not outside_users:
        return
    first_user = min(outside_users)  # fx.Node compares by graph position
    for node in sorted(nodes):
        first_user.prepend(node)


def sink_gather_waits(gm: fx.GraphModule) -> None:
    for collective in [n for n in gm.graph.nodes if is_collective(n) and collective_kind(n) == "all_gather"]:
        wait = wait_of(collective)
        _sink_block([wait, *_output_chain(wait)])
        # Start from "issue at first use" (the partitioner may have placed a recomputed gather
        # anywhere earlier); prefetching then happens only by policy, within the budget.
        wait.prepend(collective)


def _compute_between(gm: fx.GraphModule, start: fx.Node, end: fx.Node, seconds: NodeSeconds) -> float:
    # Only compute on full (gathered) tensors counts: our own prep nodes work on local shards,
    # whose sizes differ between ranks with uneven shards, and every rank must reach the same
    # schedule (collectives issued in a different order on different ranks hang).
    total, node = 0.0, start.next
    while node is not end and node.op != "root":
        if not is_collective(node) and not is_wait(node) and "graphshard_role" not in node.meta:
            total += seconds(node)
        node = node.next
    return total


# A prefetched gather's extra time in flight: (issue node, original issue node, bytes).
Interval = tuple[fx.Node, fx.Node, int]


def _most_in_flight(intervals: list[Interval], start: fx.Node, end: fx.Node) -> int:
    """Most bytes of `intervals` held at one time within [start, end): the peak is at `start` or
    where an interval begins (an interval is held from its issue to before its original node)."""
    points = [start] + [s for s, _, _ in intervals if start < s < end]
    return max(sum(b for s, e, b in intervals if not point < s and point < e) for point in points)


def prefetch_all_gathers(gm: fx.GraphModule, policy: ReorderPolicy) -> list[Interval]:
    """Hoist gathers by policy; returns the intervals each one is now in flight for longer."""
    gathers = [n for n in gm.graph.nodes if is_collective(n) and collective_kind(n) == "all_gather"]
    intervals: list[Interval] = []
    for index, gather in enumerate(gathers):
        if policy.prefetch == 0 or policy.max_inflight_bytes <= 0:
            break
        wait = wait_of(gather)
        nbytes = unsharded_bytes(gather)
        candidates = []  # deepest first
        for depth in range(min(policy.prefetch, index), 0, -1):
            anchor = wait_of(gathers[index - depth]).next  # just after the earlier bucket's wait
            candidates.append(anchor)
        candidates = [a for a in candidates if a < gather]  # nodes compare by position
        if not candidates:
            continue

        def inflight_at(anchor: fx.Node) -> int:
            # most prefetched bytes simultaneously in flight if this gather is issued at anchor
            return nbytes + _most_in_flight(intervals, anchor, gather)

        allowed = [a for a in candidates if inflight_at(a) <= policy.max_inflight_bytes]
        if not allowed:
            continue
        chosen = allowed[0]
        if policy.compute_seconds and policy.collective_seconds:
            needed = policy.collective_seconds(gather)
            for anchor in reversed(allowed):  # shallowest first: hold memory only as needed
                if _compute_between(gm, anchor, wait, policy.compute_seconds) >= needed:
                    chosen = anchor
                    break
        original_position = gather.next
        hoist_before(chosen, gather)
        intervals.append((gather, original_position, nbytes))
    return intervals


def delay_reduction_waits(gm: fx.GraphModule, max_inflight_bytes: float = math.inf,
                          prefetched: list[Interval] = ()) -> None:
    reductions = [n for n in gm.graph.nodes if is_collective(n) and collective_kind(n) != "all_gather"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for index, collective in enumerate(reductions):
        wait = wait_of(collective)
        # wait just before the next reduction is issued (or at the end): never block compute
        anchor = reductions[index + 1] if index + 1 < len(reductions) else output
        # held meanwhile: this reduction's input and the prefetched gathers in flight beside it
        held = unsharded_bytes(collective) + _most_in_flight(prefetched, collective, anchor)
        if held > max_inflight_bytes:
            continue
        if wait.next is not anchor:
            anchor.prepend(wait)
    stable_topological_sort(gm.graph)  # users of moved waits follow them down


def reorder_collectives(gm: fx.GraphModule, policy: ReorderPolicy) -> fx.GraphModule:
    sink_gather_waits(gm)
    prefetched = prefetch_all_gathers(gm, policy)
    delay_reduction_waits(gm, policy.max_inflight_bytes, prefetched)
    return finalize_graph(gm)
