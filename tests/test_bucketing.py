"""Bucketing: which parameters share a collective's buffer, and when each collective buffer is
freed; hand-built graphs and graphs captured with a fake process group at world sizes up to 64."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
import torch.distributed as dist

from graphshard.passes import meta_keys
from graphshard.tools.models import build_model
from graphshard.compiler.options import GraphshardOptions
from graphshard.passes.context import PassContext
from graphshard.passes.bucket_collectives import bucket_collectives, plan_buckets
from graphshard.passes.graph_utils import (
    ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, GraphEmitter, aten, collective_params,
    is_collective, is_wait, node_order, wait_of,
)
from graphshard.passes.units import block_of
from graphshard.passes.liveness import graph_memory
from tests.capture import call_nodes, capture_step
from tests.pass_graphs import MB, gather_graph, ctx, small_transformer


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


def test_a_run_closes_when_another_unit_of_the_same_kind_intervenes_even_in_another_dtype():
    # embedding (fp32), blocks (bf16), head (fp32): the head must not join the embedding's bucket
    names = [("emb.weight", torch.float32), ("layers.0.w", torch.bfloat16),
             ("layers.1.w", torch.bfloat16), ("head.weight", torch.float32)]
    gm = gather_graph(8, [(n, (8, 4), d) for n, d in names])
    plan = plan_buckets(gm, 0)
    assert [(b.unit, [collective_params(m)[0] for m in b.members]) for b in plan] == [
        ("<other 1>", ["emb.weight"]), ("layers.0", ["layers.0.w"]), ("layers.1", ["layers.1.w"]),
        ("<other 2>", ["head.weight"])]


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


class _UsedOutOfOrder(torch.nn.Module):
    """Six equal blocks, run in an order that is not their registration order."""
    USE = (3, 0, 5, 1, 4, 2)

    def __init__(self, width: int = 32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in self.USE)

    def forward(self, x):
        for index in self.USE:
            x = torch.tanh(self.layers[index](x))
        return x


def _backward_graph(model, strategy, **kw):
    width = model.layers[0].in_features
    return capture_step(model, (torch.randn(4, width),), lambda out, x: out.sum(),
                        strategy=strategy, **kw)[("backward", "bucketed")]


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_no_shard_gradient_buckets_span_units_and_close_in_backward_order(fake_pg):
    """no_shard's gradient all-reduces share buckets across units, as DDP's: one bucket under a
    cap that holds every gradient; under a cap of two blocks, each bucket takes the gradients
    of the blocks backward finishes one after the other (registration order would pair a block
    backward finishes first with one it finishes last, holding that all-reduce to the end),
    packed by ATen where it is issued. Hybrid sharding's all-reduces stay one per unit's
    reduce-scatter bucket, read whole."""
    from torch.distributed.device_mesh import init_device_mesh

    (whole,) = call_nodes(_backward_graph(_UsedOutOfOrder(), "no_shard"), ALL_REDUCE)
    assert {block_of(p) for p in collective_params(whole)} == {f"layers.{i}" for i in range(6)}
    block_bytes = 33 * 32 * 4
    bwd = _backward_graph(_UsedOutOfOrder(), "no_shard", options={"bucket_mb": 2 * block_bytes / MB})
    buckets = call_nodes(bwd, ALL_REDUCE)
    finished = [f"layers.{i}" for i in reversed(_UsedOutOfOrder.USE)]
    assert [sorted({block_of(p) for p in collective_params(b)}) for b in buckets] == [
        sorted(finished[i:i + 2]) for i in (0, 2, 4)]
    assert all(b.args[0].target is torch.ops.graphshard.concat.default for b in buckets)

    model, inputs, loss_fn = small_transformer()
    hybrid = capture_step(model, inputs, loss_fn, strategy="hybrid_shard",
                          shard_kwargs={"mesh": init_device_mesh("cpu", (2, 4))})[("backward", "bucketed")]
    units = [{block_of(p) for p in collective_params(c)} for c in call_nodes(hybrid, ALL_REDUCE)]
    assert len(units) > 1 and all(len(unit) == 1 for unit in units)


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_no_shard_leaves_at_most_a_quarter_of_the_gradients_to_all_reduce_after_backward(fake_pg):
    """Under the default cap (64 MiB), gradients of 6.3 MiB in all are all-reduced in buckets
    of at most a quarter of them, in the order backward produces them: the first is issued
    while backward still computes the last. Gradients of 1.5 MiB keep buckets of 1 MiB (DDP's
    first), not four latency-bound ones."""
    model = _UsedOutOfOrder(width=512)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    bwd = _backward_graph(model, "no_shard")
    buckets = call_nodes(bwd, ALL_REDUCE)
    sizes = [b.args[0].meta["val"].numel() * 4 for b in buckets]
    assert len(buckets) >= 4 and max(sizes) <= total / 4 and sum(sizes) == total, sizes
    finished = [f"layers.{i}" for i in reversed(_UsedOutOfOrder.USE)]
    first_bucket_of = {}
    for index, bucket in enumerate(buckets):
        for param in collective_params(bucket):
            first_bucket_of.setdefault(block_of(param), index)
    assert sorted(finished, key=first_bucket_of.__getitem__) == finished
    order = node_order(bwd.graph)
    assert order[buckets[0]] < order[buckets[-1].args[0]]  # issued before the last is packed

    small = _UsedOutOfOrder(width=256)  # 6 x 257 KiB
    sizes = [b.args[0].meta["val"].numel() * 4
             for b in call_nodes(_backward_graph(small, "no_shard"), ALL_REDUCE)]
    assert len(sizes) == 2 and max(sizes) <= MB < sum(sizes), sizes


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

    model, inputs, loss_fn = small_transformer()
    shard_kwargs = {}
    if strategy == "hybrid_shard":
        from torch.distributed.device_mesh import init_device_mesh
        shard_kwargs["mesh"] = init_device_mesh("cpu", (2, fake_pg // 2))
    graphs = capture_step(model, inputs, loss_fn, strategy=strategy, options=options,
                          shard_kwargs=shard_kwargs)
    for kind in ("forward", "backward"):
        gm = graphs[(kind, "freed")]
        before = graphs[(kind, "packed")]  # the stage before
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
