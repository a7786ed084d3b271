"""The all-to-all transports: all-gather and reduce-scatter rewritten as all-to-all, each rank's
own chunk kept out of the exchange, and where the options choose them."""

from __future__ import annotations

import fractions
import threading

import pytest
import torch
import torch.fx as fx

from graphshard.passes import meta_keys
from graphshard.compiler.options import GraphshardOptions
from graphshard.passes.context import PassContext
from graphshard.passes.bucket_collectives import bucket_collectives
from graphshard.passes.graph_utils import (
    ALL_GATHER, REDUCE_SCATTER, WAIT, collective_kind, dim0_chunk, is_collective, node_order,
    wait_of,
)
from tests.capture import call_nodes
from tests.pass_graphs import gather_graph, ctx


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


def _run_ranks(graphs: list[fx.GraphModule], inputs: list[list[torch.Tensor]],
               monkeypatch) -> list:
    """Each rank's graph on real tensors in a thread of its own, its all-to-alls exchanging
    with the others' (each thread's process-group rank is its own)."""
    from graphshard import _torch_compat
    from graphshard.compiler.ops import peer_exchange
    from graphshard.passes.graph_utils import ALL_TO_ALL, is_exchange_with_peers

    exchange, local = SimulatedExchange(len(graphs)), threading.local()
    monkeypatch.setattr(_torch_compat, "process_group_rank", lambda group_name: local.rank)

    def with_peers(rank):
        def run(buffer, group_size, group_name, holds_own_chunk):
            send, splits = peer_exchange(buffer, group_size, holds_own_chunk, rank)
            return exchange.for_rank(rank)(send, splits, splits, group_name)
        return run

    for rank, gm in enumerate(graphs):
        for node in gm.graph.nodes:
            if node.target is ALL_TO_ALL:
                node.target = exchange.for_rank(rank)
            elif is_exchange_with_peers(node):
                node.target = with_peers(rank)
            elif node.target is WAIT:
                node.target = torch.clone
        gm.recompile()
    results: list = [None] * len(graphs)

    def run(rank):
        local.rank = rank
        results[rank] = graphs[rank](*inputs[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(graphs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_keeps_each_ranks_own_chunk_local_in_one_graph_for_every_rank(world, monkeypatch):
    """An exchange leaves the rank's own chunk out, found when it runs, so every rank's graph
    is the same: the gather's send buffer holds N - 1 copies and the copy-out puts the own row
    from it in the rank's place; at world size 2 the reduce-scatter sends the chunk that is not
    the rank's (larger groups exchange it all: their middle ranks' chunks are not first or
    last). Every rank's graph, run on real tensors against the others' (uneven shards), gives
    the full parameters and the averaged gradient shards."""
    from graphshard.passes.all_gather_via_all_to_all import all_gather_via_all_to_all
    from graphshard.passes.graph_utils import (ALL_TO_ALL, exchange_share, is_exchange_with_peers,
                                              unsharded_bytes)
    from graphshard.passes.reduce_scatter_via_all_to_all import reduce_scatter_via_all_to_all
    from graphshard.passes.pack_graph_inputs import pack_graph_inputs
    from graphshard.compiler.cost_model import ClusterSpec, collective_node_cost

    params = [("layers.0.a", (11, 3), torch.float32), ("layers.0.b", (6,), torch.float32),
              ("layers.0.c", (9, 2), torch.float32)]
    full = {name: torch.randn(shape) for name, shape, _ in params}

    def rows_of(tensor, rank):  # rank's shard: ceil(rows / N) rows each, the last ranks' short
        chunk = dim0_chunk(tensor.shape[0], world)
        return tensor[rank * chunk:(rank + 1) * chunk]

    def rank_free(gm):  # what the exchanges and the copy-out are told: nothing of the rank
        return [(str(n.target), fx.node.map_arg(n.args, lambda arg: tuple(arg.meta["val"].shape)))
                for n in gm.graph.nodes if n.target is ALL_TO_ALL or is_exchange_with_peers(n)
                or n.target is torch.ops.graphshard.split_copy.default]

    graphs, inputs = [], []
    for rank in range(world):
        gm = bucket_collectives(gather_graph(world, params, backward=True, rank=rank), ctx(bucket_mb=64))
        full_bucket = {collective_kind(c): unsharded_bytes(c) for c in gm.graph.nodes if is_collective(c)}
        context = PassContext("forward", GraphshardOptions(), own_chunk_local=True)
        gm = all_gather_via_all_to_all(reduce_scatter_via_all_to_all(gm, context), context)
        gm = pack_graph_inputs(gm, context)
        gather, scatter = sorted((n for n in gm.graph.nodes if is_collective(n)), key=collective_kind)
        # the shards' send buffer and the local sum run in ATen: no kernel to generate for them;
        # the last rank pads its short shards first, and Inductor fuses the padding into the copy
        packed_by_aten = rank < world - 1
        assert (gather.args[0].target is torch.ops.graphshard.concat.default) == packed_by_aten
        (local_sum,) = call_nodes(gm, torch.ops.graphshard.sum_received.default)
        assert local_sum.args[1:] == ((1, scatter.args[0], "0") if world == 2 else (world, None, None))
        # the gradients' bucket stays Inductor's to fuse with the ops that compute them
        reduced = scatter.args[0]
        while reduced.target is not torch.ops.aten.cat.default:
            reduced = reduced.args[0]  # through the flattening views
        assert set(call_nodes(gm, torch.ops.aten.cat.default)) == {reduced} | (
            set() if packed_by_aten else {gather.args[0]})
        assert is_exchange_with_peers(gather) and gather.args[1:] == (world, "0", False)
        assert exchange_share(gather) == fractions.Fraction(world, world - 1)
        if world == 2:
            assert is_exchange_with_peers(scatter) and scatter.args[1:] == (2, "0", True)
        else:
            assert scatter.target is ALL_TO_ALL and exchange_share(scatter) == 1
        # what the memory model and the cost model see as the collective: the full bucket
        assert {collective_kind(c): unsharded_bytes(c) for c in (gather, scatter)} == full_bucket
        assert {collective_kind(c): collective_node_cost(c, ClusterSpec.default()).nbytes
                for c in (gather, scatter)} == full_bucket
        (copy_out,) = call_nodes(gm, torch.ops.graphshard.split_copy.default)
        assert len(copy_out.args[0]) == 2 and copy_out.args[2] == "0"  # received rows, own row
        graphs.append(gm)
        inputs.append([rows_of(full[name], rank) for name, _, _ in params])
    assert all(rank_free(gm) == rank_free(graphs[0]) for gm in graphs)
    # the schedule check sees one schedule on every rank
    from graphshard.passes.schedule_digest import collective_sequence, schedule_digest
    assert len({schedule_digest(collective_sequence(gm)) for gm in graphs}) == 1
    for rank, outputs in enumerate(_run_ranks(graphs, inputs, monkeypatch)):
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
