"""Bucketing and reordering: hand-built FX graphs and graphs captured at world sizes 8 and 64."""

from __future__ import annotations

import fractions
import math
import operator
import threading

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import torch.distributed as dist

from graphshard.passes import meta_keys
from graphshard._torch_compat import init_fake_process_group
from graphshard.tools.models import build_model
from graphshard.compiler.options import GraphshardOptions
from graphshard.passes.context import PassContext
from graphshard.passes.bucket_collectives import bucket_collectives, plan_buckets
from graphshard.passes.graph_utils import (
    ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, GraphEmitter, aten, collective_kind, collective_params, dim0_chunk,
    is_collective, is_wait, list_schedule, node_order, wait_of,
)
from graphshard.passes.liveness import graph_memory, memory_estimate
from graphshard.passes.lowering import lower_reduce_grad, lower_unshard
from graphshard.passes.markers import UnshardSpec
from graphshard.passes.reorder_collectives import ReorderPolicy, reorder_collectives
from tests.capture import call_nodes, capture_step

MB = 2**20


# --------------------------------------------------------------------------- hand-built graphs


def gather_graph(world: int, params, use_order=None, backward=False, replicas=1,
                 rank=0) -> fx.GraphModule:
    """A graph that gathers each (name, full_shape, dtype) parameter's shard and uses it in one
    compute node (a matmul-like sum), in `use_order`; with backward=True also reduce-scatters a
    gradient per parameter (and all-reduces it across `replicas` groups: hybrid sharding).
    Shards are `rank`'s (torch.chunk's rows: the last ranks' may be short)."""
    graph, mode = fx.Graph(), FakeTensorMode()
    shards = {}
    for name, shape, dtype in params:
        node = graph.placeholder(name.replace(".", "_"))
        chunk = math.ceil(shape[0] / world)
        rows = min(chunk, max(0, shape[0] - rank * chunk))
        with mode:
            node.meta["val"] = torch.empty((rows, *shape[1:]), dtype=dtype)
        shards[name] = (node, shape, dtype)
    outputs = []
    for name in use_order or [p[0] for p in params]:
        shard, shape, dtype = shards[name]
        emit = GraphEmitter(graph, mode, {meta_keys.PARAMS: (name,), meta_keys.ROLE: "unshard"})
        groups = (("0",), (world,)) if replicas == 1 else (("0", "1"), (world, replicas))
        spec = UnshardSpec(shape[0], "0", world, None, True, *groups, True, None, name, 0, 0, "fake",
                           True)
        full = lower_unshard(emit, shard, spec)
        compute = GraphEmitter(graph, mode)
        out = compute(aten.mul.Tensor, full, 2.0)
        outputs.append(out)
        if backward:
            emit = GraphEmitter(graph, mode, {meta_keys.PARAMS: (name,), meta_keys.ROLE: "reduce_grad"})
            reduce = spec.reduce_spec(shard.meta["val"].shape[0], dtype)
            outputs.append(lower_reduce_grad(emit, out, reduce))
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def ctx(**options):
    return PassContext("forward", GraphshardOptions(**options))


def test_size_cap_splits_a_unit_into_ceil_total_over_cap_buckets():
    # 10 parameters of 1 MiB each in one block; a 3 MiB cap -> ceil(10 / 3) = 4 buckets
    params = [(f"layers.0.w{i}", (256, 1024), torch.float32) for i in range(10)]
    gm = bucket_collectives(gather_graph(8, params), ctx(bucket_mb=3))
    gathers = call_nodes(gm, ALL_GATHER)
    assert len(gathers) == 4
    assert [len(collective_params(g)) for g in gathers] == [3, 3, 3, 1]
    # no cap (a large one) -> one bucket for the unit
    gm = bucket_collectives(gather_graph(8, params), ctx(bucket_mb=1000))
    assert len(call_nodes(gm, ALL_GATHER)) == 1


def test_packing_follows_registration_order_not_use_order():
    params = [(f"layers.0.w{i}", (16, 8), torch.float32) for i in range(4)]
    use = ["layers.0.w2", "layers.0.w0", "layers.0.w3", "layers.0.w1"]
    order = {name: index for index, (name, _, _) in enumerate(params)}
    gm = gather_graph(8, params, use_order=use)
    context = PassContext("forward", GraphshardOptions(bucket_mb=64), param_order=order)
    (gather,) = call_nodes(bucket_collectives(gm, context), ALL_GATHER)
    assert collective_params(gather) == tuple(name for name, _, _ in params)


def test_dtypes_never_share_a_buffer():
    params = [("layers.0.a", (16, 8), torch.float32), ("layers.0.b", (16, 8), torch.bfloat16),
              ("layers.0.c", (16, 8), torch.float32)]
    gm = bucket_collectives(gather_graph(8, params, backward=True), ctx(bucket_mb=64))
    gathers = call_nodes(gm, ALL_GATHER)
    assert sorted((str(g.meta["val"].dtype), collective_params(g)) for g in gathers) == [
        ("torch.bfloat16", ("layers.0.b",)), ("torch.float32", ("layers.0.a", "layers.0.c"))]
    scattered = sorted((str(rs.args[0].meta["val"].dtype), collective_params(rs))
                       for rs in call_nodes(gm, REDUCE_SCATTER))
    assert scattered == [("torch.bfloat16", ("layers.0.b",)),
                         ("torch.float32", ("layers.0.a", "layers.0.c"))]


def test_units_are_blocks_plus_leftovers_before_and_after():
    names = ["emb.weight", "layers.0.w", "layers.0.v", "layers.1.w", "layers.1.v", "norm.weight", "head.weight"]
    gm = gather_graph(8, [(n, (8, 4), torch.float32) for n in names])
    units = [b.unit for b in plan_buckets(gm, 0)]
    assert units == ["<other 1>", "layers.0", "layers.1", "<other 2>"]


def test_bucketed_graph_is_valid_and_uneven_shards_keep_their_shapes():
    params = [("layers.0.a", (11, 3), torch.float32), ("layers.0.b", (5,), torch.float32),
              ("layers.0.c", (1, 7), torch.float32)]
    before = gather_graph(4, params, backward=True)
    shapes = [tuple(v.meta["val"].shape) for v in before.graph.output_node().args[0]]
    after = bucket_collectives(before, ctx(bucket_mb=64))
    after.graph.lint()
    assert [tuple(v.meta["val"].shape) for v in after.graph.output_node().args[0]] == shapes
    assert len(call_nodes(after, ALL_GATHER)) == 1 and len(call_nodes(after, REDUCE_SCATTER)) == 1


def test_reduced_gradients_are_views_of_their_bucket_and_gathered_parameters_are_copies():
    params = [("layers.0.a", (11, 3), torch.float32), ("layers.0.b", (5,), torch.float32),
              ("layers.0.c", (8, 7), torch.float32)]
    gm = bucket_collectives(gather_graph(4, params, backward=True), ctx(bucket_mb=64))
    views = {aten.view.default, aten.slice.Tensor, aten.split_with_sizes.default, operator.getitem}

    def through_views(node):
        while node.op == "call_function" and node.target in views:
            node = node.args[0]
        return node

    outputs = gm.graph.output_node().args[0]
    grads, products = outputs[1::2], outputs[0::2]
    # every gradient is a view of the one reduce-scatter's result: no copy per gradient
    (source,) = {through_views(g) for g in grads}
    assert is_wait(source) and source.args[0].target is REDUCE_SCATTER
    # a gathered parameter is a strided column block of its bucket: copied out, in one call
    (copy,) = {through_views(p.args[0]) for p in products}
    assert copy.target is torch.ops.graphshard.split_copy.default
    assert through_views(copy.args[0][0]).args[0].target is ALL_GATHER


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_hybrid_all_reduce_reads_the_reduce_scatter_bucket_whole(rows):
    """Hybrid sharding: the replicas' all-reduce takes the reduce-scatter bucket's output itself,
    not a concatenation copying its gradients back together, on every rank: a rank with short
    uneven shards all-reduces its padded rows too and narrows after (the same graph everywhere)."""
    params = [("layers.0.a", (rows, 3), torch.float32), ("layers.0.b", (rows,), torch.float32)]
    graph = gather_graph(2, params, backward=True, replicas=2, rank=1)  # rank 1: 3 of 7 rows
    gm = bucket_collectives(graph, ctx(bucket_mb=64))
    (scatter,), (all_reduce,) = call_nodes(gm, REDUCE_SCATTER), call_nodes(gm, ALL_REDUCE)
    assert all_reduce.args[0] is wait_of(scatter)
    grads = gm.graph.output_node().args[0][1::2]
    assert [tuple(g.meta["val"].shape) for g in grads] == [(rows // 2, 3), (rows // 2,)]


def test_a_buffer_whose_views_are_concatenated_back_is_never_freed():
    """Inductor replaces a concatenation of a split's pieces, in order, by the split buffer: a
    collective's output joined back by a concatenation that an all-reduce reads may become that
    all-reduce's input, so the freed stage must not free it after the concatenation."""
    from graphshard.passes.free_collective_buffers import free_collective_buffers
    from graphshard.passes.graph_utils import FREE_STORAGE
    from graphshard.passes.liveness import Buffers

    graph, mode = fx.Graph(), FakeTensorMode()
    grad = graph.placeholder("grad")
    with mode:
        grad.meta["val"] = torch.empty(8)
    emit = GraphEmitter(graph, mode)
    scaled = emit(aten.mul.Tensor, grad, 0.5)
    reduced = emit(WAIT, emit(REDUCE_SCATTER, scaled, "sum", 2, "0"))
    pieces = emit(aten.split_with_sizes.default, reduced, [1, 3])
    parts = [emit(operator.getitem, pieces, i) for i in range(2)]
    summed = emit(WAIT, emit(ALL_REDUCE, emit(aten.cat.default, parts), "sum", "1"))
    graph.output((summed,))
    gm = free_collective_buffers(fx.GraphModule(torch.nn.Module(), graph), ctx())
    buffers = Buffers(gm)
    freed = {buffers.owned[f.args[0]] for f in call_nodes(gm, FREE_STORAGE)}
    assert freed == {buffers.owned[scaled]}  # the reduce-scatter's input, after its wait
    assert buffers.owned[reduced] not in freed


def _compute_nodes_between(gm, start, end):
    order = node_order(gm.graph)
    return [n for n in gm.graph.nodes if order[start] < order[n] < order[end]
            and n.op == "call_function" and n.meta.get(meta_keys.ROLE) is None]


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
        assert _compute_nodes_between(gm, wait_of(previous), current) == []
        assert _compute_nodes_between(gm, current, wait_of(current))
    assert _inflight_peak(gm) == unit_bytes  # one unit ahead of the one in use, never more
    # budget 0: nothing is prefetched; no compute between a gather and its wait
    gm0 = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                              ReorderPolicy(prefetch=1, max_inflight_bytes=0))
    for gather in call_nodes(gm0, ALL_GATHER):
        assert _compute_nodes_between(gm0, gather, wait_of(gather)) == []
    # prefetch depth 2 with a budget of one unit behaves like depth 1 (never two in flight)
    gm2 = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                              ReorderPolicy(prefetch=2, max_inflight_bytes=unit_bytes))
    assert _inflight_peak(gm2) <= unit_bytes
    gm3 = reorder_collectives(bucket_collectives(gather_graph(8, params), ctx(bucket_mb=64)),
                              ReorderPolicy(prefetch=2))
    assert _inflight_peak(gm3) == 2 * unit_bytes


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
            in_flight = _compute_nodes_between(gm, current, wait_of(current))
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
    assert _compute_nodes_between(gm, gathers[1], gathers[2]) == []


def _inflight_peak(gm) -> int:
    """Most gathered bytes in flight (issued, not yet waited on) while compute runs: the
    prefetched bytes the budget bounds."""
    peak = current = 0
    for node in gm.graph.nodes:
        if is_collective(node) and node.target is ALL_GATHER:
            current += node.meta["val"].numel() * node.meta["val"].element_size()
        elif is_wait(node) and node.args[0].target is ALL_GATHER:
            current -= node.meta["val"].numel() * node.meta["val"].element_size()
        elif node.op == "call_function" and node.meta.get(meta_keys.ROLE) is None:
            peak = max(peak, current)
    return peak


# --------------------------------------------------------------------------- captured graphs


def _transformer(**kw):
    return build_model("transformer", dim=64, n_layers=4, vocab_size=64, batch=8, seq_len=8, **kw)


def _nbytes(node: fx.Node) -> int:
    return node.meta["val"].numel() * node.meta["val"].element_size()


# World size 6 leaves every dim-0 of 64 or 256 rows uneven: each shard is padded to ceil(d/6) rows.
@pytest.mark.parametrize("fake_pg", [6], indirect=True)
def test_captured_transformer_has_one_collective_per_unit(fake_pg):
    world = fake_pg
    model, inputs, loss_fn = _transformer()
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
        assert (world * _nbytes(gather.args[0]), _nbytes(gather)) == (expected, expected), gather
    for scatter in scatters:
        expected = padded_bytes(collective_params(scatter))
        assert (_nbytes(scatter.args[0]), world * _nbytes(scatter)) == (expected, expected), scatter


def test_captured_backward_prefetches_gathers_and_delays_reduce_scatter_waits(fake_pg):
    model, inputs, loss_fn = _transformer()
    bwd = capture_step(model, inputs, loss_fn)[("backward", "scheduled")]
    order = node_order(bwd.graph)
    gathers = call_nodes(bwd, ALL_GATHER)
    for previous, current in zip(gathers, gathers[1:]):
        assert _compute_nodes_between(bwd, wait_of(previous), current) == []
        assert _compute_nodes_between(bwd, current, wait_of(current))
    scatters = call_nodes(bwd, REDUCE_SCATTER)
    last_gathered = max(order[wait_of(g)] for g in gathers)
    for current, following in zip(scatters, scatters[1:]):
        wait = wait_of(current)
        assert order[current] < order[wait]
        if order[current] < last_gathered:  # one in flight at a time while gathers run
            assert order[wait] < order[following]
        # the wait does not block the next unit's compute: compute runs while it is in flight
        assert _compute_nodes_between(bwd, current, wait)


def test_predicted_peak_stays_within_baseline_plus_budget(fake_pg):
    budget_mb = 0.1
    model, inputs, loss_fn = _transformer()
    graphs = capture_step(model, inputs, loss_fn, options={"max_inflight_mb": budget_mb, "prefetch": 2})
    for kind in ("forward", "backward"):
        baseline = memory_estimate(graphs[(kind, "bucketed")]).peak_bytes
        scheduled = memory_estimate(graphs[(kind, "scheduled")]).peak_bytes
        assert scheduled <= baseline + budget_mb * MB
        assert _inflight_peak(graphs[(kind, "scheduled")]) <= budget_mb * MB


def test_overlap_within_peak_keeps_the_baseline_peak_and_still_prefetches(fake_pg):
    """overlap_within_peak=True overlaps only below the peak of the schedule without overlap
    (max_inflight_mb=0: gathers at first use, reductions waited where issued); the default
    overlaps wherever it helps and raises the backward's peak (its peak is at its start, where
    the saved activations are all still held and a gather is prefetched)."""
    runs = {name: capture_step(*_transformer(), options=options) for name, options in (
        ("none", {"max_inflight_mb": 0}), ("within", {"overlap_within_peak": True}), ("any", {}))}
    peak = {(name, kind): graph_memory(graphs[(kind, "scheduled")], kind).peak_bytes
            for name, graphs in runs.items() for kind in ("forward", "backward")}
    for kind in ("forward", "backward"):
        assert peak[("within", kind)] <= peak[("none", kind)], kind
    assert peak[("any", "backward")] > peak[("none", "backward")]
    assert _inflight_peak(runs["within"][("forward", "scheduled")]) > 0  # still prefetches
    assert _inflight_peak(runs["within"][("backward", "scheduled")]) > 0


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

    units = [c for c in gathers + scatters if _nbytes(c) > MB]  # the blocks' collectives
    last_gathered = max(order[wait_of(g)] for g in gathers)
    for node in bwd.graph.nodes:  # model compute (views do no work)
        if node.op == "call_function" and node.meta.get(meta_keys.ROLE) is None \
                and not getattr(node.target, "is_view", False) and order[node] < last_gathered:
            assert sum(order[node] in in_flight(c) for c in units) <= 1, node
    handed_over = [s for s in scatters
                   if _nbytes(s) > MB and any(order[s] < order[g] for g in gathers)]
    assert len(handed_over) == 2  # layers.3 and .2: a unit's gather follows each
    for scatter in handed_over:
        following = min((g for g in gathers if order[g] > order[scatter]), key=order.get)
        assert order[wait_of(scatter)] < order[following]
        assert _compute_nodes_between(bwd, scatter, wait_of(scatter))
        assert _compute_nodes_between(bwd, following, wait_of(following))
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
            graphs = capture_step(*_transformer(), options={"overlap_within_peak": True,
                                                            "prefetch": 2})
        finally:
            dist.destroy_process_group()
        orders.append([[("issue" if is_collective(n) else "wait", collective_params(c))
                        for n in gm.graph.nodes if is_collective(n) or is_wait(n)
                        for c in [n if is_collective(n) else n.args[0]]]
                       for gm in (graphs[(k, "scheduled")] for k in ("forward", "backward"))])
    assert orders[0] == orders[1]


@pytest.mark.parametrize("fake_pg", [64], indirect=True)
def test_world_size_64_llama_buckets_per_block(fake_pg):
    model, inputs, loss_fn = build_model("llama", n_layers=3, dim=64, n_heads=4, n_kv_heads=2,
                                         ffn_hidden=128, vocab_size=128, batch=2, seq_len=8)
    graphs = capture_step(model, inputs, loss_fn)
    fwd = graphs[("forward", "scheduled")]
    gathers = call_nodes(fwd, ALL_GATHER)
    assert len(gathers) == 3 + 2
    for gather in gathers:  # every bucket gathers over 64 ranks
        assert gather.args[1] == 64
    rs = call_nodes(graphs[("backward", "scheduled")], REDUCE_SCATTER)
    assert len(rs) == 5 and all(node.args[2] == 64 for node in rs)


def test_reduce_scatter_via_all_to_all_keeps_shapes_and_placement():
    from graphshard.passes.graph_utils import ALL_TO_ALL
    from graphshard.passes.reduce_scatter_via_all_to_all import reduce_scatter_via_all_to_all

    params = [("layers.0.a", (11, 3), torch.float32), ("layers.0.b", (5,), torch.float32)]
    gm = bucket_collectives(gather_graph(4, params, backward=True), ctx(bucket_mb=64))
    shapes = [tuple(v.meta["val"].shape) for v in gm.graph.output_node().args[0]]
    (scatter,) = call_nodes(gm, REDUCE_SCATTER)
    before, after = scatter.prev, wait_of(scatter).next
    gm = reduce_scatter_via_all_to_all(gm)
    assert call_nodes(gm, REDUCE_SCATTER) == []
    (exchange,) = call_nodes(gm, ALL_TO_ALL)
    assert exchange.args[1] == exchange.args[2] == [exchange.meta["val"].numel() // 4] * 4
    assert [tuple(v.meta["val"].shape) for v in gm.graph.output_node().args[0]] == shapes
    order = node_order(gm.graph)
    # issued where the reduce-scatter was, reduced locally where its wait was
    assert order[before] < order[exchange] < order[wait_of(exchange)] < order[after]


def test_all_gather_via_all_to_all_sends_the_shard_to_every_rank_in_place_of_the_gather():
    from graphshard.passes.all_gather_via_all_to_all import all_gather_via_all_to_all
    from graphshard.passes.graph_utils import ALL_TO_ALL

    params = [("layers.0.a", (11, 3), torch.float32), ("layers.0.b", (5,), torch.float32)]
    gm = bucket_collectives(gather_graph(4, params), ctx(bucket_mb=64))
    shapes = [tuple(v.meta["val"].shape) for v in gm.graph.output_node().args[0]]
    (gather,) = call_nodes(gm, ALL_GATHER)
    shard, wait = gather.args[0], wait_of(gather)
    gathered_shape = tuple(gather.meta["val"].shape)
    consumers, parts = list(wait.users), list(shard.args[0])
    gm = all_gather_via_all_to_all(gm)
    assert call_nodes(gm, ALL_GATHER) == []
    (exchange,) = call_nodes(gm, ALL_TO_ALL)
    rows = shard.meta["val"].shape[0]
    # every rank sends its whole shard to every rank: N copies out, rank r's shard lands at r;
    # the bucket's concatenation is written N times into the send buffer, not copied again
    copies = exchange.args[0]
    assert shard.target is torch.ops.aten.cat.default and shard not in gm.graph.nodes
    assert copies.target is torch.ops.aten.cat.default and copies.args[0] == parts * 4
    assert copies.meta["val"].shape[0] == 4 * rows
    assert exchange.args[1] == exchange.args[2] == [rows] * 4
    assert tuple(exchange.meta["val"].shape) == gathered_shape
    assert exchange.meta[meta_keys.LOWERED_FROM] == "all_gather"
    assert [tuple(v.meta["val"].shape) for v in gm.graph.output_node().args[0]] == shapes
    order = node_order(gm.graph)
    # issued where the all-gather was; its wait and the copy-outs are untouched
    assert order[parts[-1]] < order[copies] < order[exchange] < order[wait_of(exchange)]
    assert wait_of(exchange) is wait and list(wait.users) == consumers
    # a shard that is not a concatenation (one parameter, no bucket) is repeated N times
    gm = all_gather_via_all_to_all(gather_graph(4, params[:1]))
    (exchange,) = call_nodes(gm, ALL_TO_ALL)
    assert exchange.args[0].target is torch.ops.aten.repeat.default
    assert exchange.args[0].args[1][0] == 4


class SimulatedExchange:
    """all_to_all_single among `world` ranks whose graphs run in threads of this process."""

    def __init__(self, world: int):
        self.world, self.sent = world, {}
        self.barrier = threading.Barrier(world, timeout=60)

    def for_rank(self, rank: int):
        def all_to_all_single(send, output_splits, input_splits, group_name):
            self.sent[rank] = torch.split(send, input_splits)  # one chunk per destination
            self.barrier.wait()
            received = [self.sent[source][rank] for source in range(self.world)]
            self.barrier.wait()  # every rank has read this round before the next one sends
            assert [len(chunk) for chunk in received] == output_splits
            return torch.cat(received)
        return all_to_all_single


def _run_ranks(graphs: list[fx.GraphModule], inputs: list[list[torch.Tensor]]) -> list:
    """Each rank's graph on real tensors, its all-to-alls exchanging with the others'."""
    from graphshard.passes.graph_utils import ALL_TO_ALL

    exchange = SimulatedExchange(len(graphs))
    for rank, gm in enumerate(graphs):
        for node in gm.graph.nodes:
            if node.target is ALL_TO_ALL:
                node.target = exchange.for_rank(rank)
            elif node.target is WAIT:
                node.target = torch.clone
        gm.recompile()
    results: list = [None] * len(graphs)

    def run(rank):
        results[rank] = graphs[rank](*inputs[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(graphs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_keeps_each_ranks_own_chunk_local_and_the_results_unchanged(world):
    """With the rank known, an exchange leaves the rank's own chunk out: the gather's send buffer
    holds N - 1 copies and the copy-out takes the own row from it; the reduce-scatter sends all
    but its own chunk where that is the first or the last (a middle rank exchanges it all).
    Every rank's graph, run on real tensors against the others' (uneven shards at world 4),
    gives the full parameters and the averaged gradient shards."""
    from graphshard.passes.all_gather_via_all_to_all import all_gather_via_all_to_all
    from graphshard.passes.graph_utils import ALL_TO_ALL, exchange_share, unsharded_bytes
    from graphshard.passes.reduce_scatter_via_all_to_all import reduce_scatter_via_all_to_all

    params = [("layers.0.a", (11, 3), torch.float32), ("layers.0.b", (6,), torch.float32),
              ("layers.0.c", (9, 2), torch.float32)]
    full = {name: torch.randn(shape) for name, shape, _ in params}

    def rows_of(tensor, rank):  # rank's shard: ceil(rows / N) rows each, the last ranks' short
        chunk = dim0_chunk(tensor.shape[0], world)
        return tensor[rank * chunk:(rank + 1) * chunk]

    graphs, inputs = [], []
    for rank in range(world):
        gm = bucket_collectives(gather_graph(world, params, backward=True, rank=rank), ctx(bucket_mb=64))
        full_bucket = {collective_kind(c): unsharded_bytes(c) for c in gm.graph.nodes if is_collective(c)}
        context = PassContext("forward", GraphshardOptions(), group_ranks={"0": rank})
        gm = all_gather_via_all_to_all(reduce_scatter_via_all_to_all(gm, context), context)
        gather, scatter = sorted(call_nodes(gm, ALL_TO_ALL), key=collective_kind)
        own_first_or_last = rank in (0, world - 1)
        assert gather.args[1][rank] == 0 and sum(1 for size in gather.args[1] if size) == world - 1
        assert (scatter.args[1][rank] == 0) == own_first_or_last
        assert exchange_share(gather) == fractions.Fraction(world, world - 1)
        # what the memory model and the cost model see as the collective: the full bucket
        assert {collective_kind(c): unsharded_bytes(c) for c in (gather, scatter)} == full_bucket
        (copy_out,) = call_nodes(gm, torch.ops.graphshard.split_copy.default)
        assert len(copy_out.args[0]) == (2 if rank in (0, world - 1) else 3)  # row blocks
        graphs.append(gm)
        inputs.append([rows_of(full[name], rank) for name, _, _ in params])
    # the schedule check sees one schedule on every rank: first, middle and last alike
    from graphshard.passes.schedule_digest import collective_sequence, schedule_digest
    assert len({schedule_digest(collective_sequence(gm)) for gm in graphs}) == 1
    for rank, outputs in enumerate(_run_ranks(graphs, inputs)):
        for index, (name, _, _) in enumerate(params):
            product, grad = outputs[2 * index], outputs[2 * index + 1]
            torch.testing.assert_close(product, 2 * full[name], rtol=0, atol=0)
            # every rank's gradient is 2 * full: averaged, rank r keeps its rows
            torch.testing.assert_close(grad, 2 * rows_of(full[name], rank))


@pytest.mark.parametrize("on_gloo", [True, False])
def test_transport_options_choose_all_to_all_only_where_asked_or_on_gloo(on_gloo):
    auto = GraphshardOptions().via_all_to_all(on_gloo)
    assert auto == ({"all_gather", "reduce_scatter"} if on_gloo else set())
    forced = GraphshardOptions(all_gather="all_to_all", reduce_scatter="native").via_all_to_all(on_gloo)
    assert forced == {"all_gather"}
    # under a memory budget "auto" keeps the native all-gather (no send buffer of N shard copies)
    budgeted = GraphshardOptions(max_inflight_mb=8).via_all_to_all(on_gloo)
    assert budgeted == ({"reduce_scatter"} if on_gloo else set())
    with pytest.raises(ValueError, match="all_gather must be 'auto', 'native' or 'all_to_all'"):
        GraphshardOptions(all_gather="ring")


def test_a_run_closes_when_another_unit_of_the_same_kind_intervenes_even_in_another_dtype():
    # embedding (fp32), blocks (bf16), head (fp32): the head must not join the embedding's bucket
    names = [("emb.weight", torch.float32), ("layers.0.w", torch.bfloat16),
             ("layers.1.w", torch.bfloat16), ("head.weight", torch.float32)]
    gm = gather_graph(8, [(n, (8, 4), d) for n, d in names])
    plan = plan_buckets(gm, 0)
    assert [(b.unit, [collective_params(m)[0] for m in b.members]) for b in plan] == [
        ("<other 1>", ["emb.weight"]), ("layers.0", ["layers.0.w"]), ("layers.1", ["layers.1.w"]),
        ("<other 2>", ["head.weight"])]


def test_a_stage_run_out_of_order_fails_loudly(monkeypatch):
    from graphshard.compiler import pipeline
    from graphshard.compiler.cost_model import ClusterSpec

    stages = {stage.name: stage for stage in pipeline.PIPELINE}
    swapped = tuple(stages[name] for name in
                    ("merged", "tagged", "partitioned", "lowered", "scheduled", "bucketed", "transport"))
    monkeypatch.setattr(pipeline, "PIPELINE", swapped)
    graph = gather_graph(8, [("layers.0.w", (16, 4), torch.float32)])
    with pytest.raises(RuntimeError, match="stage 'scheduled' needs \\['bucketed'\\]"):
        pipeline.run_pipeline(graph, PassContext("forward", GraphshardOptions()))
    monkeypatch.undo()
    ran = pipeline.run_pipeline(gather_graph(8, [("layers.0.w", (16, 4), torch.float32)]),
                               PassContext("forward", GraphshardOptions(bucket_mb=0),
                                           cluster=ClusterSpec.default()))
    assert ran.meta[meta_keys.STAGES] == tuple(s for s in pipeline.STAGES
                                                    if s not in ("merged", "tagged"))


def test_a_pipeline_stopped_after_a_stage_resumes_where_it_stopped():
    """What the planner relies on to share the stages option sets have in common."""
    from graphshard.compiler import pipeline
    from graphshard.compiler.cost_model import ClusterSpec

    ctx = PassContext("forward", GraphshardOptions(), cluster=ClusterSpec.default())
    graph = gather_graph(8, [("layers.0.w", (16, 4), torch.float32)])
    lowered = pipeline.run_pipeline(graph, ctx, stop_after="lowered")
    assert lowered.meta[meta_keys.STAGES] == ("partitioned", "lowered")
    bucketed = pipeline.run_pipeline(lowered, ctx, stop_after="bucketed", resume=True)
    assert bucketed.meta[meta_keys.STAGES] == ("partitioned", "lowered", "bucketed")
    assert pipeline.run_pipeline(bucketed, ctx, stop_after="lowered", resume=True) is bucketed
    done = pipeline.run_pipeline(bucketed, ctx, resume=True)
    assert done.meta[meta_keys.STAGES] == tuple(s for s in pipeline.STAGES
                                                    if s not in ("merged", "tagged"))
    with pytest.raises(ValueError, match="'tagged' is not a stage of the forward graph"):
        pipeline.run_pipeline(graph, ctx, stop_after="tagged")


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
                and collective_kind(n) == "all_gather" and _nbytes(n) > MB]

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


@pytest.mark.parametrize("fake_pg, strategy, options", [
    (2, "full_shard", {"all_gather": "all_to_all", "reduce_scatter": "all_to_all"}),
    # unbucketed: each gathered weight is saved for backward as the collective's own output
    (2, "shard_grad_op", {"all_gather": "native", "reduce_scatter": "native", "bucket_mb": 0}),
    # 2 x 2: the reduce-scatter's output is all-reduced across replicas and returned
    (4, "hybrid_shard", {"all_gather": "native", "reduce_scatter": "native"}),
], indirect=["fake_pg"])
def test_each_collective_buffer_is_freed_after_its_last_reader_and_no_other(fake_pg, strategy, options):
    """A finished collective's buffers may be held by the backend's thread after its wait (gloo:
    until that thread runs again); the graph frees their storage itself, right after the last
    node that reads them: a collective's input after its wait, its output after the last reader
    of anything sharing it (a collective reads until its wait). Never a graph input, a buffer an
    output shares (shard_grad_op's forward keeps its gathered weights for backward), one an
    all-reduce reads (Inductor may make it the result) or one whose views a concatenation
    joins back whole (Inductor may make it the concatenation). The predicted peak does not change."""
    from graphshard.passes.graph_utils import FREE_STORAGE
    from graphshard.passes.liveness import Buffers

    model, inputs, loss_fn = _transformer()
    shard_kwargs = {}
    if strategy == "hybrid_shard":
        from torch.distributed.device_mesh import init_device_mesh
        shard_kwargs["mesh"] = init_device_mesh("cpu", (2, fake_pg // 2))
    graphs = capture_step(model, inputs, loss_fn, strategy=strategy, options=options,
                          shard_kwargs=shard_kwargs)
    for kind in ("forward", "backward"):
        gm = graphs[(kind, "freed")]
        before = graphs.get((kind, "transport"), graphs[(kind, "lowered")])  # the stage before
        assert graph_memory(gm, kind).peak_bytes == graph_memory(before, kind).peak_bytes
        buffers, order = Buffers(gm), node_order(gm.graph)
        outputs = {b for n in gm.graph.output_node().all_input_nodes for b in buffers.owned[n]}
        frees = {buffers.owned[f.args[0]]: f for f in call_nodes(gm, FREE_STORAGE)}
        assert len(frees) == len(call_nodes(gm, FREE_STORAGE))  # one free per buffer
        collectives = [n for n in gm.graph.nodes if is_collective(n)]
        assert collectives
        all_reduced = {b for c in collectives if c.target is ALL_REDUCE
                       for v in c.all_input_nodes for b in buffers.owned[v]}
        assert not {b for (b,) in frees} & all_reduced
        # a buffer whose views are concatenated back whole: Inductor may use it for the cat
        rejoined = {buffers.owned[c.args[0][0]][0] for c in call_nodes(gm, aten.cat.default)
                    if len({buffers.owned[p] for p in c.args[0]}) == 1
                    and len(buffers.owned[c.args[0][0]]) == 1}
        if strategy == "hybrid_shard" and kind == "backward":  # the case exists: the all-reduce
            # reads the reduce-scatter's output itself (it is never freed)
            assert all_reduced & {b for c in collectives if c.target is REDUCE_SCATTER
                                  for b in buffers.owned[wait_of(c)]}
        for collective in collectives:
            for value, done in [*((v, wait_of(collective)) for v in collective.all_input_nodes),
                                (collective, collective)]:
                (buffer,) = buffers.owned[value]
                if buffer in buffers.inputs | outputs | all_reduced | rejoined:
                    assert (buffer,) not in frees, (kind, value.name)
                    continue
                free = frees[(buffer,)]
                sharing = [n for n in gm.graph.nodes if buffer in buffers.owned.get(n, ())]
                readers = {wait_of(u) if is_collective(u) else u for n in sharing for u in n.users}
                assert order[free] > max([order[done], *(order[r] for r in readers - {free})]), \
                    (kind, value.name)
        if strategy == "shard_grad_op" and kind == "forward":  # the case of a kept gather exists
            assert any(set(buffers.owned[c]) & outputs for c in collectives)
        if strategy == "full_shard":  # all-to-all: whatever the collectives allocate is freed
            assert {buffers.owned[c] for c in collectives} <= set(frees)


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_a_send_buffer_outlives_every_reader_of_the_parts_concatenated_into_it(fake_pg):
    """Inductor computes a concatenation's parts straight into its buffer, so a part read after
    the collective's wait is read from the send buffer: the buffer is freed only after that read
    (and, without such a read, right after the wait)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphshard.passes.free_collective_buffers import free_collective_buffers
    from graphshard.passes.graph_utils import ALL_TO_ALL, FREE_STORAGE, WAIT

    group = dist.group.WORLD.group_name

    def step(x, part_read_late):
        part = x * 2
        received = WAIT(ALL_TO_ALL(torch.cat([part, part]), [8, 8], [8, 8], group))
        return (received.sum() + part.sum(),) if part_read_late else (received.sum(),)

    for late in (True, False):
        gm = make_fx(lambda x: step(x, late), tracing_mode="fake")(torch.randn(8, 4))
        for node in call_nodes(gm, ALL_TO_ALL):  # as the transport stage marks what it emits
            node.meta[meta_keys.LOWERED_FROM] = "all_gather"
        gm = free_collective_buffers(gm)
        order = node_order(gm.graph)
        (cat,) = call_nodes(gm, aten.cat.default)
        (free,) = [f for f in call_nodes(gm, FREE_STORAGE) if f.args[0] is cat]
        (wait,) = call_nodes(gm, WAIT)
        part_readers = [u for u in cat.args[0][0].users if u is not cat]
        assert bool(part_readers) == late
        assert order[free] > max([order[wait], *(order[u] for u in part_readers)])
        if not late:
            assert free.prev is wait


def test_the_schedule_digest_tells_apart_schedules_that_would_pair_wrongly():
    """Another bucket size, another order of the same collectives (equal sizes: they would pair
    without error and mix two parameters' shards), or one collective more: each is another
    digest, and the record names the parameters each collective serves."""
    from graphshard.passes.schedule_digest import collective_sequence, schedule_digest

    params = [("layers.0.a", (8, 4), torch.float32), ("layers.1.a", (8, 4), torch.float32)]
    base = collective_sequence(bucket_collectives(gather_graph(4, params), ctx(bucket_mb=64)))
    assert [r.params for r in base] == [("layers.0.a",), ("layers.1.a",)]
    wider = collective_sequence(bucket_collectives(
        gather_graph(4, [("layers.0.a", (8, 8), torch.float32), params[1]]), ctx(bucket_mb=64)))
    more = collective_sequence(bucket_collectives(
        gather_graph(4, params + [("layers.2.a", (8, 4), torch.float32)]), ctx(bucket_mb=64)))
    digests = {schedule_digest(base), schedule_digest(wider), schedule_digest(more),
               schedule_digest(base[::-1])}
    assert len(digests) == 4


def _step_digests(batch: int) -> dict[str, str]:
    from graphshard.passes.schedule_digest import collective_sequence, schedule_digest

    torch.manual_seed(0)
    model, inputs, loss_fn = build_model("transformer", dim=64, n_layers=3, vocab_size=64,
                                         batch=batch, seq_len=16)
    graphs = capture_step(model, inputs, loss_fn)
    return {kind: schedule_digest(collective_sequence(graphs[(kind, "freed")]))
            for kind in ("forward", "backward")}


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_ranks_with_different_batches_issue_collectives_in_one_order(fake_pg, monkeypatch):
    """Two ranks, one given 4 rows and one 16: planned alone, the scheduler's compute and memory
    weights (local activations) order the backward's prefetches and reductions differently;
    through one store (the default process group's, here an in-process one) the second rank
    adopts the first one's order, and its step still runs."""
    from graphshard.compiler import rank_agreement

    alone = [_step_digests(4), _step_digests(16)]
    assert alone[0]["backward"] != alone[1]["backward"]  # what would pair wrongly
    store = dist.HashStore()
    monkeypatch.setattr(rank_agreement, "agreement_store", lambda: store)
    agreed = [_step_digests(4), _step_digests(16)]
    assert agreed[0] == agreed[1] == alone[0]
    # the other way round: the 16-row rank plans first, the 4-row rank follows it
    monkeypatch.setattr(rank_agreement, "agreement_store", lambda store=dist.HashStore(): store)
    assert [_step_digests(16), _step_digests(4)] == [alone[1], alone[1]]


def test_a_graph_follows_a_given_collective_order_where_its_data_allows():
    from graphshard.passes.collective_order import follow_collective_order, issue_order

    params = [("layers.0.a", (8, 4), torch.float32), ("layers.1.a", (8, 4), torch.float32)]
    gm = bucket_collectives(gather_graph(4, params), ctx(bucket_mb=64))
    mine = issue_order(gm)
    swapped = follow_collective_order(gm, mine[::-1])
    assert swapped is not None and issue_order(swapped) == mine[::-1]
    swapped.graph.lint()
    assert follow_collective_order(gm, mine[:1]) is None  # not the graph it was planned on


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_two_models_of_one_architecture_take_their_decisions_apart(fake_pg, monkeypatch):
    """shard() numbers the models it makes in program order (alike on every rank), and the
    key of a decision shared through the store names the model: a second model of the same
    architecture, given another batch, does not adopt the first one's decision."""
    import graphshard
    from graphshard.compiler import rank_agreement
    from graphshard.passes.graph_utils import unshard_specs

    store = dist.HashStore()
    monkeypatch.setattr(rank_agreement, "agreement_store", lambda: store)
    keys, indices = [], []
    for batch in (1, 4):
        torch.manual_seed(0)
        model, inputs, loss_fn = build_model("transformer", dim=32, n_layers=2, vocab_size=32,
                                             batch=batch, seq_len=8)
        graphshard.shard(model)
        joint = capture_step(model, inputs, loss_fn)[("joint", "tagged")]
        names = sorted(unshard_specs(joint))
        keys.append(rank_agreement.decision_key(joint, names, "default"))
        indices.append({spec.model for spec in unshard_specs(joint).values()})
    assert indices == [{0}, {1}]
    assert keys[0] != keys[1]
