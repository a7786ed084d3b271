"""Reordering: gathers prefetched and reduction waits delayed, within the memory they may cost;
hand-built graphs and graphs captured with a fake process group."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
import torch.distributed as dist

from graphshard.passes import meta_keys
from graphshard._torch_compat import init_fake_process_group
from graphshard.tools.models import build_model
from graphshard.passes.bucket_collectives import bucket_collectives
from graphshard.passes.graph_utils import (
    ALL_GATHER, REDUCE_SCATTER, collective_kind, collective_params, dim0_chunk, is_collective,
    is_wait, list_schedule, node_order, wait_of,
)
from graphshard.passes.liveness import graph_memory, memory_estimate
from graphshard.passes.reorder_collectives import ReorderPolicy, reorder_collectives
from tests.capture import call_nodes, capture_step
from tests.pass_graphs import (
    MB, compute_nodes_between, ctx, gather_graph, inflight_peak, nbytes, small_transformer,
)


def test_prefetch_issues_next_gather_before_current_compute_and_budget_zero_disables_it():
    names = [f"layers.{i}.w" for i in range(4)]
    params = [(n, (64, 64), torch.float32) for n in names]
    unit_bytes = 64 * 64 * 4
    gm = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                             ReorderPolicy(prefetch=1))
    gm.graph.lint()
    gathers = call_nodes(gm, ALL_GATHER)
    order = node_order(gm.graph)
    for previous, current in zip(gathers, gathers[1:]):
        # issued before the previous unit's compute (nothing computed since its wait), and the
        # previous unit's compute runs while it is in flight
        assert order[wait_of(previous)] < order[current]
        assert compute_nodes_between(gm, wait_of(previous), current) == []
        assert compute_nodes_between(gm, current, wait_of(current))
    assert inflight_peak(gm) == unit_bytes  # one unit ahead of the one in use, never more
    # budget 0: nothing is prefetched; no compute between a gather and its wait
    gm0 = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                              ReorderPolicy(prefetch=1, max_inflight_bytes=0))
    for gather in call_nodes(gm0, ALL_GATHER):
        assert compute_nodes_between(gm0, gather, wait_of(gather)) == []
    # prefetch depth 2 with a budget of one unit behaves like depth 1 (never two in flight)
    gm2 = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                              ReorderPolicy(prefetch=2, max_inflight_bytes=unit_bytes))
    assert inflight_peak(gm2) <= unit_bytes
    gm3 = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                              ReorderPolicy(prefetch=2))
    assert inflight_peak(gm3) == 2 * unit_bytes


def test_reduction_waits_are_delayed_only_within_the_budget():
    params = [(f"layers.{i}.w", (64, 64), torch.float32) for i in range(4)]
    unit_bytes = 64 * 64 * 4

    def scheduled(budget):
        return reorder_collectives(
            bucket_collectives(gather_graph(8, params, backward=True), ctx(bucket_mb=64)),
            ReorderPolicy(prefetch=1, max_inflight_bytes=budget))

    # Delayed, a reduction's input is held beside one prefetched gather at a time (each gather's
    # prefetch ends at its wait, before the next is issued): two units, never more.
    for budget, delayed in ((math.inf, True), (2 * unit_bytes, True), (2 * unit_bytes - 1, False)):
        gm = scheduled(budget)
        scatters = call_nodes(gm, REDUCE_SCATTER)
        assert len(scatters) == 4
        for current, following in zip(scatters, scatters[1:]):
            # delayed: compute runs while the reduction is in flight, and it is waited on
            # before the next one is issued; over budget: waited on where it was issued
            in_flight = compute_nodes_between(gm, current, wait_of(current))
            assert bool(in_flight) is delayed
            assert wait_of(current) < following


def test_list_schedule_takes_the_ready_node_of_least_priority():
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.neg, (x,))
    b = graph.call_function(torch.exp, (x,))
    c = graph.call_function(torch.add, (a, b))
    graph.output(c)
    nodes = list(graph.nodes)
    # b is wanted first, c only once both inputs are placed, the placeholder always first
    order = list_schedule(nodes, {x: 9, a: 2, b: 1, c: 0, nodes[-1]: 3})
    assert order == [x, b, a, c, nodes[-1]]
    cyclic = fx.Graph()
    p = cyclic.placeholder("p")
    u = cyclic.call_function(torch.neg, (p,))
    v = cyclic.call_function(torch.exp, (u,))
    u.args = (v,)
    with pytest.raises(RuntimeError, match="cycle"):
        list_schedule([p, u, v], {p: 0, u: 1, v: 2})


def test_gathers_prefetched_at_one_point_are_issued_in_the_order_they_are_needed():
    params = [(f"layers.{i}.w", (64, 64), torch.float32) for i in range(4)]
    gm = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                             ReorderPolicy(prefetch=2))
    gathers = call_nodes(gm, ALL_GATHER)
    assert [collective_params(g) for g in gathers] == [(name,) for name, _, _ in params]
    # layers.1 and layers.2 are both issued right after layers.0's wait (no cost model: the
    # graph's first gathers start at their first use, as nothing says what covers them)
    assert wait_of(gathers[0]).next in (gathers[1], gathers[1].args[0])
    assert compute_nodes_between(gm, gathers[1], gathers[2]) == []


# World size 6 leaves every dim-0 of 64 or 256 rows uneven: each shard is padded to ceil(d/6) rows.
@pytest.mark.parametrize("fake_pg", [6], indirect=True)
def test_captured_transformer_has_one_collective_per_unit(fake_pg):
    world = fake_pg
    model, inputs, loss_fn = small_transformer()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def padded_bytes(names):  # float32, every rank's shard padded to the same rows
        return sum(world * dim0_chunk(shapes[n][0], world) * math.prod(shapes[n][1:]) * 4
                   for n in names)

    graphs = capture_step(model, inputs, loss_fn)
    fwd, bwd = graphs[("forward", "scheduled")], graphs[("backward", "scheduled")]
    units = 4 + 2  # four blocks, embeddings before, norm + head after
    fwd_gathers = call_nodes(fwd, ALL_GATHER)
    assert len(fwd_gathers) == units
    assert [g.meta[meta_keys.BUCKET] for g in fwd_gathers][1:5] == [f"layers.{i}" for i in range(4)]
    # backward: one gather per unit that needs weights (embeddings do not) and that forward did
    # not keep (the default keeps its tail: layers.3, norm + head), one RS per unit
    assert [g.meta[meta_keys.BUCKET] for g in call_nodes(bwd, ALL_GATHER)] == \
        [f"layers.{i}" for i in (2, 1, 0)]
    scatters = call_nodes(bwd, REDUCE_SCATTER)
    assert len(scatters) == units
    assert [s.meta[meta_keys.BUCKET] for s in scatters][1:5] == [f"layers.{i}" for i in (3, 2, 1, 0)]
    # forward gathers cover every parameter once
    covered = sorted(p for g in fwd_gathers for p in collective_params(g))
    assert covered == sorted(shapes)
    # packed bytes = the bucket's parameters' padded sizes: a gather sends one padded shard per
    # parameter and receives N of them; a reduce-scatter sends the padded full gradients
    for gather in fwd_gathers + call_nodes(bwd, ALL_GATHER):
        expected = padded_bytes(collective_params(gather))
        assert (world * nbytes(gather.args[0]), nbytes(gather)) == (expected, expected), gather
    for scatter in scatters:
        expected = padded_bytes(collective_params(scatter))
        assert (nbytes(scatter.args[0]), world * nbytes(scatter)) == (expected, expected), scatter


def test_captured_backward_prefetches_gathers_and_delays_reduce_scatter_waits(fake_pg):
    model, inputs, loss_fn = small_transformer()
    bwd = capture_step(model, inputs, loss_fn)[("backward", "scheduled")]
    order = node_order(bwd.graph)
    gathers = call_nodes(bwd, ALL_GATHER)
    for previous, current in zip(gathers, gathers[1:]):
        assert compute_nodes_between(bwd, wait_of(previous), current) == []
        assert compute_nodes_between(bwd, current, wait_of(current))
    scatters = call_nodes(bwd, REDUCE_SCATTER)
    last_gathered = max(order[wait_of(g)] for g in gathers)
    for current, following in zip(scatters, scatters[1:]):
        wait = wait_of(current)
        assert order[current] < order[wait]
        if order[current] < last_gathered:  # one in flight at a time while gathers run
            assert order[wait] < order[following]
        # the wait does not block the next unit's compute: compute runs while it is in flight
        assert compute_nodes_between(bwd, current, wait)


def test_predicted_peak_stays_within_baseline_plus_budget(fake_pg):
    budget_mb = 0.1
    model, inputs, loss_fn = small_transformer()
    graphs = capture_step(model, inputs, loss_fn, options={"max_inflight_mb": budget_mb, "prefetch": 2})
    for kind in ("forward", "backward"):
        baseline = memory_estimate(graphs[(kind, "bucketed")]).peak_bytes
        scheduled = memory_estimate(graphs[(kind, "scheduled")]).peak_bytes
        assert scheduled <= baseline + budget_mb * MB
        assert inflight_peak(graphs[(kind, "scheduled")]) <= budget_mb * MB


def test_overlap_within_peak_keeps_the_baseline_peak_and_still_prefetches(fake_pg):
    """overlap_within_peak=True overlaps only below the peak of the schedule without overlap
    (max_inflight_mb=0: gathers at first use, reductions waited where issued); the default
    overlaps wherever it helps and raises the backward's peak (its peak is at its start, where
    the saved activations are all still held and a gather is prefetched)."""
    runs = {name: capture_step(*small_transformer(), options=options) for name, options in (
        ("none", {"max_inflight_mb": 0}), ("within", {"overlap_within_peak": True}), ("any", {}))}
    peak = {(name, kind): graph_memory(graphs[(kind, "scheduled")], kind).peak_bytes
            for name, graphs in runs.items() for kind in ("forward", "backward")}
    for kind in ("forward", "backward"):
        assert peak[("within", kind)] <= peak[("none", kind)], kind
    assert peak[("any", "backward")] > peak[("none", "backward")]
    assert inflight_peak(runs["within"][("forward", "scheduled")]) > 0  # still prefetches
    assert inflight_peak(runs["within"][("backward", "scheduled")]) > 0


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_backward_hands_the_comm_lane_over_and_never_holds_two_units_in_flight(fake_pg):
    """The bench's 4-block transformer with gloo's all-to-all transports, as the default
    schedules it: a prefetch is issued after the previous unit's copy-out, a block's
    reduce-scatter is issued after that copy-out and waited on before the next gather is
    issued (compute covering each, by the cost model), so while gathers run at most one unit's
    collective holds its buffers beyond need; the final reductions, with nothing to cover
    them, are in flight together."""
    model, inputs, loss_fn = build_model("transformer", batch=4, seq_len=64)
    options = {"all_gather": "all_to_all", "reduce_scatter": "all_to_all"}
    bwd = capture_step(model, inputs, loss_fn, options=options)[("backward", "scheduled")]
    order = node_order(bwd.graph)
    gathers, scatters = call_nodes(bwd, ALL_GATHER), call_nodes(bwd, REDUCE_SCATTER)

    def copied_out(gather):  # the last of the copy-out nodes our passes put after its wait
        chain, frontier = [], [wait_of(gather)]
        while frontier:
            node = frontier.pop()
            chain.append(node)
            frontier += [u for u in node.users if meta_keys.ROLE in u.meta]
        return max(order[n] for n in chain)

    for previous, current in zip(gathers, gathers[1:]):
        if order[wait_of(previous)] < order[current]:  # prefetched after its wait
            assert copied_out(previous) < order[current]  # the previous bucket is freed first

    def in_flight(node):
        return range(order[node], order[wait_of(node)])

    units = [c for c in gathers + scatters if nbytes(c) > MB]  # the blocks' collectives
    last_gathered = max(order[wait_of(g)] for g in gathers)
    for node in bwd.graph.nodes:  # model compute (views do no work)
        if node.op == "call_function" and node.meta.get(meta_keys.ROLE) is None \
                and not getattr(node.target, "is_view", False) and order[node] < last_gathered:
            assert sum(order[node] in in_flight(c) for c in units) <= 1, node
    handed_over = [s for s in scatters
                   if nbytes(s) > MB and any(order[s] < order[g] for g in gathers)]
    assert len(handed_over) == 2  # layers.3 and .2: a unit's gather follows each
    for scatter in handed_over:
        following = min((g for g in gathers if order[g] > order[scatter]), key=order.get)
        assert order[wait_of(scatter)] < order[following]
        assert compute_nodes_between(bwd, scatter, wait_of(scatter))
        assert compute_nodes_between(bwd, following, wait_of(following))
    # prefetch 2 (a gather needed two units on): the hand-over never moves a wait past the
    # next reduction's issue, so reductions still never overlap while gathers run
    model, inputs, loss_fn = build_model("transformer", batch=4, seq_len=64)
    deep = capture_step(model, inputs, loss_fn, options={**options, "prefetch": 2})
    deep = deep[("backward", "scheduled")]
    deep_order = node_order(deep.graph)
    deep_gathered = max(deep_order[wait_of(g)] for g in call_nodes(deep, ALL_GATHER))
    deep_scatters = call_nodes(deep, REDUCE_SCATTER)
    for current, following in zip(deep_scatters, deep_scatters[1:]):
        if deep_order[current] < deep_gathered:
            assert deep_order[wait_of(current)] < deep_order[following], current
    # after the last gather: layers.1's waited before layers.0's (whose compute covers it);
    # layers.0's and the embedding's, with no compute left to cover them, in flight together
    final = [s for s in scatters if order[s] > last_gathered]
    assert len(final) == 3
    assert order[wait_of(final[0])] < order[final[1]]
    assert order[final[2]] < order[wait_of(final[1])]


def test_overlap_within_peak_schedules_every_rank_alike():
    """World size 6: every shard of 64 rows is uneven (11 rows, the last rank 9), so the shard
    side of the graphs differs by rank; the schedule must not (a different order of collectives
    on different ranks hangs)."""
    orders = []
    for rank in (0, 5):
        init_fake_process_group(6, rank)
        try:
            graphs = capture_step(*small_transformer(), options={"overlap_within_peak": True,
                                                            "prefetch": 2})
        finally:
            dist.destroy_process_group()
        orders.append([[("issue" if is_collective(n) else "wait", collective_params(c))
                        for n in gm.graph.nodes if is_collective(n) or is_wait(n)
                        for c in [n if is_collective(n) else n.args[0]]]
                       for gm in (graphs[(k, "scheduled")] for k in ("forward", "backward"))])
    assert orders[0] == orders[1]


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_a_backward_prefetch_is_issued_where_memory_is_low_and_compute_still_covers_it(
        fake_pg, monkeypatch):
    """The bench's 4-block transformer (gloo's all-to-all transports): a backward block's peak is
    at its start, where its saved activations are still alive. A prefetched gather is issued
    later in the block where that meets lower memory and compute still covers it: the backward's
    predicted peak is lower than with every prefetch at its anchor (just after the previous
    unit's copy-out). The rule itself: test_late_issue_meets_the_least_memory_the_margin_allows."""
    from graphshard.compiler.cost_model import ClusterSpec, collective_node_cost, node_cost
    import graphshard.passes.reorder_collectives as reorder

    # Every block gathered again in backward, the output projection kept (the default keeps
    # the last block too, and then the backward's peak is not where a prefetch is issued).
    options = {"all_gather": "all_to_all", "reduce_scatter": "all_to_all",
               "reshard_after_forward": {"layers.*": True, "norm": True, "output": False}}

    def backward():
        model, inputs, loss_fn = build_model("transformer", batch=4, seq_len=64)
        return capture_step(model, inputs, loss_fn, options=options)[("backward", "transport")]

    late = backward()
    monkeypatch.setattr(reorder, "LATE_ISSUE_COVER", math.inf)  # every prefetch at its anchor
    anchored = backward()
    peak = {name: graph_memory(gm, "backward").peak_transient_bytes
            for name, gm in (("late", late), ("anchored", anchored))}
    # most of one unit's exchange buffers in flight (3 MiB: N - 1 = 1 copy sent, 1 received)
    assert peak["late"] <= peak["anchored"] - 2 * MB

    def gathers(gm):  # in the transport stage: all-to-all carrying an all-gather
        return [n for n in gm.graph.nodes if is_collective(n)
                and collective_kind(n) == "all_gather" and nbytes(n) > MB]

    cluster = ClusterSpec.default()
    order, anchored_order = node_order(late.graph), node_order(anchored.graph)
    nodes = list(late.graph.nodes)
    moved = 0
    for gather, twin in zip(gathers(late), gathers(anchored), strict=True):
        between = nodes[order[gather] + 1:order[wait_of(gather)]]
        covered = sum(node_cost(n, cluster).seconds for n in between
                      if n.op == "call_function" and meta_keys.ROLE not in n.meta
                      and not is_collective(n) and not is_wait(n))
        # fewer nodes between issue and wait than from the anchor: issued later, and still
        # covered (the margin is chosen before the hand-over, which may move it later still)
        if (order[wait_of(gather)] - order[gather]
                < anchored_order[wait_of(twin)] - anchored_order[twin]):
            moved += 1
            assert covered >= collective_node_cost(gather, cluster).seconds
    assert moved  # layers.2's, at the backward's peak; the others meet no lower memory later


def test_late_issue_meets_the_least_memory_the_margin_allows():
    """`_least_memory_issue` on made-up slots: compute 1 s per slot, the gather needs 1 s and is
    waited on at slot 10, anchored at slot 2 (priority 1.5); LATE_ISSUE_COVER 2 allows issuing
    it up to slot 8 (2 s of compute left)."""
    from graphshard.passes.reorder_collectives import LATE_ISSUE_COVER, _least_memory_issue

    assert LATE_ISSUE_COVER == 2.0
    before = [float(s) for s in range(12)]  # before[s]: compute in slots < s

    def issue(headroom_by_slot, latest=10.0, needed=1.0):
        return _least_memory_issue(1.5, latest, 10, needed, before, headroom_by_slot[2:10])

    dip = [0, 0, 5, 1, 1, 3, 8, 8, 8, 8]  # little room early (a block's start), more from slot 6
    assert issue(dip) == 5.5  # just before slot 6: the earliest from which the worst is 8
    assert issue([0, 0, 5, 5, 5, 5, 5, 5, 5, 5]) == 1.5  # flat: memory no lower later, anchor
    assert issue(dip, needed=5.0) == 1.5  # not covered twice over anywhere: anchor
    assert issue(dip, needed=2.0) == 5.5  # covered twice over up to slot 6
    assert issue(dip, needed=2.5) == 4.5  # up to slot 5: the worst from there on is 3
    assert issue(dip, latest=4.5) == 4.5  # not past the next gather's anchor: up to slot 5
