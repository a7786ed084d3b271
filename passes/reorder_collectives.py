"""Schedule collectives so communication hides behind compute, within a memory budget.

One list scheduler (graph_utils.list_schedule: repeatedly take the ready node of least
priority), run with the sink policy alone for the baseline, then with every policy; the
policies only choose priorities:
- sink (the baseline): an all-gather, its wait and the copy-outs after it have no priority of
  their own: they run just before their first user, wait and copy-outs as one block (copying
  out one parameter at a time would keep the whole gathered buffer alive next to the copies).
  Every other node keeps its place. Times and places below are slots of this baseline.
- prefetch: bucket k's all-gather runs right after bucket k-d's wait and copy-outs (not
  between them: the gathered buffer k-d is freed first, so it is never held beside bucket k's
  buffers), d <= `prefetch`: the shallowest d whose compute (by the cost model) covers the
  gather's time, holding memory no longer than needed, else the deepest d the budget allows;
  its inputs come with it. From there it may go later, as long as the compute left covers it
  `LATE_ISSUE_COVER` times (before the hand-over below, which may move it later still, keeping
  it covered), to the earliest slot that meets the least memory (a backward block's peak is at
  its start, with its activations still alive), never past where the next gather may be
  issued. The graph's first `prefetch` + 1 gathers may also start before any copy-out: as late
  as the compute left covers them, else at the start where that fits below the peak. A gather
  is never issued before one needed earlier (one comm lane serves them in turn).
- issue reductions after copy-outs: a delayed reduce-scatter / all-reduce is issued just
  before the next node that does work, after a gathered unit waited on and copied out there.
- delay reduction waits: a reduce-scatter / all-reduce is waited on just before the next one
  is issued (or at the end): while gathers run at most one is in flight, and its wait never
  blocks compute. After the last gather, one whose time the compute up to the next does not
  cover stays in flight past it, where that fits below the peak.
- hand over: where a gather is prefetched while a delayed reduction is in flight, and the
  compute between the reduction's issue and the gather's use covers both (cost model), the
  reduction is waited on earlier, at the point that leaves each the most compute per second
  it needs, and the gather is issued just after. One comm lane runs them one after the other
  anyway; so each keeps its time covered, with the same margin, and their buffers are never
  held at once (the backward's peak is where a unit starts: the next unit's prefetch beside
  the last unit's reduction).
Two limits on the bytes collectives hold in flight beyond need (prefetched gathers' outputs,
delayed reductions' inputs; twice that where an all-to-all transport holds a second buffer of
the same size), counted by the memory model that `graphshard dump` reports
(passes/liveness.py); a prefetch or a delay that would exceed either is not made:
- `within_peak`: at every slot it spans, no more than the room left below the baseline's own
  peak, so overlap never raises the graph's peak memory (the baseline's peak comes late in a
  forward, which saves activations, and early in a backward, which frees them: prefetching
  goes on where memory is low);
- `max_inflight_bytes`: a flat budget.
Every rank must reach the same schedule, so only rank-invariant sizes decide.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch.fx as fx

from graphshard.passes import meta_keys
from graphshard.passes.graph_utils import (
    apply_order,
    collective_kind,
    finalize_graph,
    is_collective,
    is_graphshard_collective,
    is_view,
    is_wait,
    list_schedule,
    wait_of,
)
from graphshard.passes.liveness import Buffers, live_bytes

NodeSeconds = Callable[[fx.Node], float]
# A prefetched gather may wait to be issued until the compute left before its use covers its time
# this many times over (by the cost model, whose time errors are about 20% median here).
LATE_ISSUE_COVER = 2.0


@dataclass(frozen=True)
class ReorderPolicy:
    prefetch: int = 1  # max units ahead an all-gather may be issued
    # bytes held in flight beyond need: prefetched gathers' outputs, delayed reductions' inputs
    max_inflight_bytes: float = math.inf
    within_peak: bool = False  # hold in flight only what fits below the baseline's peak
    freed_inputs: frozenset[str] = frozenset()  # placeholders the graph frees (a backward's)
    via_all_to_all: frozenset[str] = frozenset()  # kinds whose transport holds a second buffer
    compute_seconds: NodeSeconds | None = None  # cost model; None: always prefetch fully
    collective_seconds: NodeSeconds | None = None


def _is_gather(node: fx.Node) -> bool:
    return is_graphshard_collective(node) and collective_kind(node) == "all_gather"


def _is_reduction(node: fx.Node) -> bool:
    # A float8 scale's all-reduce is an input of its weight's gather, not a gradient's
    # reduction: delaying its wait would hold the gather back.
    return (is_graphshard_collective(node) and not _is_gather(node)
            and node.meta.get(meta_keys.ROLE) != "float8_scale")


def _output_chain(wait: fx.Node) -> list[fx.Node]:
    """Nodes our passes emitted after a collective's wait (narrow, copy-out, casts): they move
    with the wait. Identified by sharing the collective's graphshard provenance."""
    role = wait.meta.get(meta_keys.ROLE)
    chain, frontier = [], [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if (user.op == "call_function" and user.meta.get(meta_keys.ROLE) == role
                    and user.meta.get(meta_keys.PARAMS) == wait.meta.get(meta_keys.PARAMS)
                    and not is_collective(user) and not is_wait(user) and user not in chain):
                chain.append(user)
                frontier.append(user)
    return chain


def _sink_priorities(nodes: Sequence[fx.Node]) -> dict[fx.Node, float]:
    """Sink policy: a node keeps its place (its index), except gathers and their wait blocks,
    which take the place of their first user outside the block."""
    blocks = [[wait_of(n), *_output_chain(wait_of(n))] for n in nodes if _is_gather(n)]
    block_of = {node: index for index, block in enumerate(blocks) for node in block}
    lazy = set(block_of) | {block[0].args[0] for block in blocks}
    priority: dict[fx.Node, float] = {}
    block_need = [math.inf] * len(blocks)
    for index in reversed(range(len(nodes))):  # users before their inputs
        node = nodes[index]
        block = block_of.get(node)
        needed = min((priority[u] for u in node.users
                      if block is None or block_of.get(u) != block), default=math.inf)
        if block is not None:
            block_need[block] = min(block_need[block], needed)
            needed = block_need[block]  # the wait, processed last of its block, sees it all
        priority[node] = needed if node in lazy and needed < math.inf else index
    for block, need in zip(blocks, block_need):
        for node in block:
            priority[node] = need if need < math.inf else priority[node]
    return priority


def _pull_inputs(nodes: Sequence[fx.Node], priority: dict[fx.Node, float],
                 fixed: Mapping[fx.Node, float]) -> dict[fx.Node, float]:
    """A node runs no later than its users need it: inputs of an early node come early too."""
    for node in reversed(nodes):
        if node not in fixed:
            priority[node] = min([priority[node], *(priority[u] for u in node.users)])
    return priority


class InFlight:
    """Bytes held in flight beyond need, as intervals of baseline slots, against the room each
    slot has (`room[slot]`: the budget, or less below the baseline's peak)."""

    def __init__(self, room: Sequence[float]):
        self.room = room
        self.intervals: list[tuple[float, float, int]] = []  # [from, to) slots, bytes

    def fits(self, start: float, end: float, nbytes: int, room: Sequence[float] | None = None
             ) -> bool:
        """Whether `nbytes` more, held over [start, end), stay within the room (or `room`)
        everywhere: at `start` (a half slot, where another gather's output may still be held)
        and at every slot after it."""
        room = self.room if room is None else room
        points = [start, *range(math.floor(start) + 1, math.ceil(end))]
        return all(nbytes + self.held_at(point) <= room[int(point)] for point in points)

    def held_at(self, point: float) -> int:
        """Bytes already held in flight at `point`."""
        return sum(b for s, e, b in self.intervals if s <= point < e)

    def add(self, start: float, end: float, nbytes: int) -> None:
        self.intervals.append((start, end, nbytes))


def _shard_side(nodes: Sequence[fx.Node]) -> set[fx.Node]:
    """Our collectives' nodes that work on this rank's shard, whose sizes differ between ranks
    when shards are uneven: what feeds an all-gather (pads, casts) and what follows a
    reduction (narrows, casts, a hybrid replica all-reduce). Everything else has the same size
    on every rank: model compute (every rank has an equal batch), gathered parameters and
    gradients before their reduction."""
    side: set[fx.Node] = set()
    for node in nodes:
        if not is_collective(node):
            continue
        if _is_gather(node):
            frontier, step = list(node.all_input_nodes), lambda n: n.all_input_nodes
        else:
            frontier, step = list(wait_of(node).users), lambda n: list(n.users)
        while frontier:
            current = frontier.pop()
            if meta_keys.ROLE in current.meta and current not in side:
                side.add(current)
                frontier.extend(step(current))
    return side


def _held_in_flight(collective: fx.Node, buffers: Buffers, policy: ReorderPolicy,
                    shard_side: set[fx.Node]) -> int:
    """Rank-invariant bytes a collective holds in flight: none for one on the shard side (a
    hybrid replica all-reduce of this rank's shard), whose size would make ranks decide
    differently; twice its buffer where overlap stays within the peak and the all-to-all
    transport holds a second one."""
    if collective in shard_side:
        return 0
    held = buffers.held_in_flight(collective)
    doubled = policy.within_peak and collective_kind(collective) in policy.via_all_to_all
    return 2 * held if doubled else held


def _below_peak(baseline: Sequence[fx.Node], buffers: Buffers, shard_side: set[fx.Node]
                ) -> list[float]:
    """Per slot: the room left below the baseline's peak, counted without the shard side:
    every rank must reach the same schedule."""
    live = live_bytes(baseline, buffers, counted=lambda node: node not in shard_side)
    peak = max(live, default=0)
    return [peak - used for used in live]


def _room(baseline: Sequence[fx.Node], policy: ReorderPolicy, below_peak: Sequence[float]
          ) -> list[float]:
    """Per slot: the bytes that may be held in flight there."""
    if not policy.within_peak:
        return [policy.max_inflight_bytes] * len(baseline)
    return [min(policy.max_inflight_bytes, room) for room in below_peak]


def _compute_before(baseline: Sequence[fx.Node], policy: ReorderPolicy) -> list[float]:
    """before[i]: seconds of compute in slots < i. Only compute on full (gathered) tensors
    counts as cover: our own prep nodes work on local shards, whose sizes differ between ranks
    with uneven shards, and every rank must reach the same schedule (collectives issued in a
    different order on different ranks hang)."""
    seconds = [policy.compute_seconds(n) if policy.compute_seconds and not is_collective(n)
               and not is_wait(n) and meta_keys.ROLE not in n.meta else 0.0 for n in baseline]
    return [0.0, *itertools.accumulate(seconds)]


def _prefetch_slots(baseline: Sequence[fx.Node], policy: ReorderPolicy, buffers: Buffers,
                    in_flight: InFlight, shard_side: set[fx.Node], below_peak: Sequence[float],
                    before: Sequence[float]) -> dict[fx.Node, float]:
    """Prefetch policy: the slot each prefetched gather is issued at; `in_flight` records the
    extra time its output is held for."""
    issue: dict[fx.Node, float] = {}
    if policy.prefetch == 0 or policy.max_inflight_bytes <= 0:
        return issue
    slot = {node: index for index, node in enumerate(baseline)}
    gathers = [n for n in baseline if _is_gather(n)]
    # where each gather's wait block ends: its wait and the copy-outs that move with it
    copied_out = [max(slot[n] for n in (wait_of(g), *_output_chain(wait_of(g)))) for g in gathers]
    inputs_end = next(i for i, n in enumerate(baseline) if n.op != "placeholder")
    costed = policy.compute_seconds and policy.collective_seconds

    def start_of(gather: fx.Node) -> int | None:
        """Where one of the graph's first gathers may start before any copy-out: the latest
        slot whose compute covers it, else the graph's start if it fits below the peak there
        (nothing bounds the default's room, and a backward's peak is near its start)."""
        if not costed:
            return None
        wait, needed = slot[wait_of(gather)], policy.collective_seconds(gather)
        covered = [s for s in range(inputs_end, wait) if before[wait] - before[s] >= needed]
        if covered:
            return covered[-1]
        held = _held_in_flight(gather, buffers, policy, shard_side)
        return inputs_end if in_flight.fits(inputs_end - 0.5, wait, held, room=below_peak) else None

    # the first `prefetch` + 1 gathers: as many in flight as anywhere later
    starts = {g: start_of(g) for g in gathers[:policy.prefetch + 1]}

    def anchors_of(index: int) -> list[float]:
        """Where gather `index` may be issued: just after an earlier bucket's copy-out, or from
        the start."""
        anchors = [copied_out[index - depth] + 0.5
                   for depth in range(1, min(policy.prefetch, index) + 1)]
        if starts.get(gathers[index]) is not None:
            anchors.append(starts[gathers[index]] - 0.5)
        return anchors

    previous_issue = -math.inf
    for index, gather in enumerate(gathers):
        wait, nbytes = slot[wait_of(gather)], _held_in_flight(gather, buffers, policy, shard_side)
        # never before a gather needed earlier (one comm lane serves them in need order)
        allowed = sorted(a for a in anchors_of(index) if previous_issue <= a < slot[gather]
                         and in_flight.fits(a, wait, nbytes))
        previous_issue = max(previous_issue, slot[gather] - 1)  # if not prefetched: at first use
        if not allowed:  # deepest first
            continue
        chosen = allowed[0]
        if costed:
            needed = policy.collective_seconds(gather)
            # shallowest first: hold memory only as long as needed
            chosen = next((a for a in reversed(allowed)
                           if before[wait] - before[math.ceil(a)] >= needed), chosen)
            # not past the next gather's earliest anchor (prefetch > 1), which it must precede
            latest = min([wait, *anchors_of(index + 1)]) if index + 1 < len(gathers) else wait
            headroom = [below_peak[s] - in_flight.held_at(s)
                        for s in range(math.ceil(chosen), wait)]
            chosen = _least_memory_issue(chosen, latest, wait, needed, before, headroom)
        issue[gather] = previous_issue = chosen
        in_flight.add(chosen, wait, nbytes)
    return issue


def _least_memory_issue(anchor: float, latest: float, wait: int, needed: float,
                        before: Sequence[float], headroom: Sequence[float]) -> float:
    """Where, from `anchor` to `latest`, a prefetched gather is issued: the earliest slot from
    which holding its output until `wait` meets as much headroom (`headroom[i]`: bytes below
    the peak at slot ceil(anchor) + i, less what is already in flight) as issuing it at the
    last slot whose compute left covers it `LATE_ISSUE_COVER` times over. Issued at its anchor,
    the next unit's gather would sit beside the activations a backward block frees as it goes
    (the backward's peak is at a block's start); issued there, it is allocated where memory is
    lower and keeps a margin for the cost model's error. The anchor where no slot is covered
    that well or memory is no lower later."""
    first = math.ceil(anchor)
    covered = [s for s in range(first, min(wait, math.floor(latest + 0.5) + 1))
               if before[wait] - before[s] >= LATE_ISSUE_COVER * needed]
    if not covered:
        return anchor
    # worst[i]: the least headroom over slots first + i .. wait - 1 (grows with i)
    worst = list(itertools.accumulate(reversed(headroom), min))[::-1]
    enough = worst[covered[-1] - first]
    issue = first + next(i for i, least in enumerate(worst) if least >= enough)
    return max(anchor, issue - 0.5)


def _descendants(node: fx.Node) -> set[fx.Node]:
    found, frontier = set(), [node]
    while frontier:
        for user in frontier.pop().users:
            if user not in found:
                found.add(user)
                frontier.append(user)
    return found


def _reduction_wait_slots(baseline: Sequence[fx.Node], policy: ReorderPolicy, buffers: Buffers,
                          in_flight: InFlight, shard_side: set[fx.Node],
                          below_peak: Sequence[float], before: Sequence[float]
                          ) -> dict[fx.Node, float]:
    """Delay policy: the slot each delayed reduction is waited at (just before the next
    reduction, or the output), if its input fits beside the prefetched gathers meanwhile.
    After the graph's last gather, where the compute before the next reduction does not cover
    this one's time (the end of a backward: the embedding's gradient follows the first
    block's), waiting there would only block: it stays in flight until a later reduction that
    its compute covers (or that needs its result: a hybrid replica all-reduce), or the
    output, if its input fits below the peak over the extra stretch."""
    slot = {node: index for index, node in enumerate(baseline)}
    reductions = [n for n in baseline if _is_reduction(n)]
    ends = [slot[r] for r in reductions[1:]] + [slot[baseline[-1]]]  # baseline[-1]: the output
    costed = policy.compute_seconds and policy.collective_seconds
    last_gathered = max((slot[wait_of(n)] for n in baseline if _is_gather(n)), default=-1)
    delayed = {}
    for index, (reduction, end) in enumerate(zip(reductions, ends)):
        start, held = slot[reduction], _held_in_flight(reduction, buffers, policy, shard_side)
        # past the last gather memory only falls; shard side: a rank-dependent cost
        if costed and start > last_gathered and reduction not in shard_side:
            needed = policy.collective_seconds(reduction)
            after = _descendants(wait_of(reduction))
            covered = next(slot[r] for r in [*reductions[index + 1:], baseline[-1]]
                           if r is baseline[-1] or r in after  # a reduction that needs it
                           or before[slot[r]] - before[start + 1] >= needed)
            if in_flight.fits(end, covered, held, room=below_peak):
                end = covered
        if in_flight.fits(start, end, held):
            delayed[wait_of(reduction)] = end - 0.5
            in_flight.add(start, end, held)
    return delayed


def _hand_over(baseline: Sequence[fx.Node], policy: ReorderPolicy, issue: dict[fx.Node, float],
               delayed: dict[fx.Node, float], shard_side: set[fx.Node], before: Sequence[float]
               ) -> None:
    """Hand-over policy (see the module docstring): moves delayed reductions' waits earlier and
    the gathers prefetched while they are in flight later, in `delayed` and `issue`. Both
    intervals only shrink, so every memory limit checked before still holds."""
    if not (policy.compute_seconds and policy.collective_seconds):
        return
    slot = {node: index for index, node in enumerate(baseline)}
    for reduction in (n for n in baseline if _is_reduction(n)):
        wait = wait_of(reduction)
        if wait not in delayed or reduction in shard_side:  # shard side: rank-dependent cost
            continue
        start = slot[reduction]
        queued = sorted((g for g, at in issue.items() if start < at < delayed[wait]), key=issue.get)
        if not queued:
            continue
        need = slot[wait_of(queued[0])]
        reduce_s = policy.collective_seconds(reduction)
        gather_s = policy.collective_seconds(queued[0])

        def margin(handover: int) -> float:  # of the worse covered, waiting before `handover`
            return min((before[handover] - before[start + 1]) / reduce_s,
                       (before[need] - before[handover]) / gather_s)

        # no later than the wait it had: the reduction's interval only shrinks
        handover = max(range(start + 1, min(need, math.ceil(delayed[wait])) + 1), key=margin)
        if margin(handover) < 1:
            continue
        delayed[wait] = handover - 0.5
        for gather in queued:  # gathers issued before the hand-over follow it
            if issue[gather] < handover:
                issue[gather] = handover - 0.25


def _reduction_issue_slots(baseline: Sequence[fx.Node], delayed: Mapping[fx.Node, float]
                           ) -> dict[fx.Node, float]:
    """Issue policy: a delayed reduction goes just before the next node that does work (not a
    view, not one of our prep or copy-out nodes): a gathered unit waited on and copied out in
    between has released its buffers by then, so the reduction's are not allocated beside them.
    (One waited where it is issued gains nothing from moving.)"""
    working = [index for index, node in enumerate(baseline)
               if node.op == "call_function" and meta_keys.ROLE not in node.meta
               and not is_collective(node) and not is_wait(node) and not is_view(node)]
    issue = {}
    for index, node in enumerate(baseline):
        if _is_reduction(node) and wait_of(node) in delayed:
            at = bisect.bisect_right(working, index)
            later = working[at] if at < len(working) else None
            if later is not None and later - 0.75 < delayed[wait_of(node)]:
                issue[node] = later - 0.75
    return issue


def reorder_collectives(gm: fx.GraphModule, policy: ReorderPolicy) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    # Start from "issue at first use" (the partitioner may have placed a recomputed gather
    # anywhere earlier); prefetching then happens only by policy, within the budget.
    baseline = list_schedule(nodes, _sink_priorities(nodes))
    buffers = Buffers(gm, policy.freed_inputs)
    shard_side = _shard_side(baseline)
    below_peak = _below_peak(baseline, buffers, shard_side)
    in_flight = InFlight(_room(baseline, policy, below_peak))
    before = _compute_before(baseline, policy)
    issue = _prefetch_slots(baseline, policy, buffers, in_flight, shard_side, below_peak, before)
    delayed = _reduction_wait_slots(baseline, policy, buffers, in_flight, shard_side, below_peak,
                                    before)
    _hand_over(baseline, policy, issue, delayed, shard_side, before)
    priority = {node: float(index) for index, node in enumerate(baseline)}
    priority.update(_reduction_issue_slots(baseline, delayed))
    priority.update(issue)
    priority.update(delayed)
    apply_order(gm.graph, list_schedule(baseline, _pull_inputs(baseline, priority, delayed)))
    return finalize_graph(gm)
