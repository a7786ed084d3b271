"""Hybrid sharding on a 2-D mesh (replicate, shard): sharded within each shard group, replicated
across groups; gradients reduce-scattered in the group, then all-reduced across groups."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from graphshard import _torch_compat as compat
from graphshard.tools.launch import run_local
from graphshard.passes.graph_utils import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, collective_group, wait_of
from tests.capture import GraphCapture
from tests.workers import EAGER, reference, train, zoo_training
from tests.zoo import Zoo, zoo_batch, zoo_loss

STEPS, BATCH, K = 2, 12, 3


def _ancestors(node):
    found, frontier = set(), [node]
    while frontier:
        for parent in frontier.pop().all_input_nodes:
            if parent not in found:
                found.add(parent)
                frontier.append(parent)
    return found


def _collectives(gm):
    return [(n, n.target, collective_group(n)) for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)]


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_hybrid_graph_groups(fake_pg):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    # the graphs name each group by a name alike on every rank, which resolves to the rank's own
    replicate, shard = (compat.rank_invariant_group_name(mesh, dim) for dim in (0, 1))
    assert compat.process_group(replicate) is mesh.get_group("replicate")
    assert compat.process_group(shard) is mesh.get_group("shard")
    model = Zoo()
    graphshard.shard(model, mesh, strategy="hybrid_shard")
    tokens = zoo_batch(4)
    capture = GraphCapture(stages=("lowered", "scheduled"))
    compiled = capture.compile(model)
    graphs = capture.graphs
    zoo_loss(compiled(tokens), tokens).backward()
    forward = _collectives(graphs[("forward", "lowered")])
    backward = _collectives(graphs[("backward", "lowered")])
    # Gathers only within the shard group, in both forward and (recomputed) backward.
    assert forward and all(t is ALL_GATHER and g == (shard, 4) for _, t, g in forward)
    assert all(g == (shard, 4) for _, t, g in backward if t is ALL_GATHER)
    scatters = [n for n, t, _ in backward if t is REDUCE_SCATTER]
    assert scatters and all(collective_group(n) == (shard, 4) for n in scatters)
    # Each reduce-scatter's result is then all-reduced across the replica groups.
    for rs in scatters:
        users = list(wait_of(rs).users)
        while users and users[0].target is not ALL_REDUCE:
            users = list(users[0].users)
        assert users and collective_group(users[0]) == (replicate, 2), rs.name
    # The 0-dim parameter (replicated): all-reduce in the shard group, then across groups.
    all_reduces = [g for _, t, g in backward if t is ALL_REDUCE]
    assert all_reduces.count((shard, 4)) == 1
    assert all_reduces.count((replicate, 2)) == len(scatters) + 1
    # Scheduled: each all-reduce follows its reduce-scatter's wait with no other reduction
    # issued between (a wait delayed past the all-reduce that needs it would stall it).
    scheduled = graphs[("backward", "scheduled")]
    order = {n: i for i, n in enumerate(scheduled.graph.nodes)}
    reductions = [n for n, t, _ in _collectives(scheduled) if t is not ALL_GATHER]
    for rs in (n for n in reductions if n.target is REDUCE_SCATTER):
        dependent = [n for n in reductions if order[n] > order[rs] and wait_of(rs) in _ancestors(n)]
        assert dependent, rs.name
        between = [n for n in reductions if order[wait_of(rs)] < order[n] < order[dependent[0]]]
        assert between == [], (rs.name, [n.name for n in between])

    # replica_only accumulation: reduce-scatter in the group each micro-batch, no all-reduce.
    graphs.clear()
    with graphshard.no_sync(model, replica_only=True):
        zoo_loss(compiled(tokens), tokens).backward()
    partial = _collectives(graphs[("backward", "lowered")])
    # One reduce-scatter per parameter *read* here (tied / twice-called ones are not merged).
    assert sum(t is REDUCE_SCATTER for _, t, _ in partial) >= len(scatters)
    assert all(g[0] == shard for _, t, g in partial)  # nothing across replica groups
    graphs.clear()
    zoo_loss(compiled(tokens), tokens).backward()  # synced: the ordinary graph (above), reused
    assert graphs == {}
    torch._dynamo.reset()


def _lowered_graphs_on(rank: int) -> dict[str, str]:
    compat.init_fake_process_group(8, rank=rank)
    try:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = Zoo()
        graphshard.shard(model, mesh, strategy="hybrid_shard")
        capture = GraphCapture(stages=("lowered",))
        tokens = zoo_batch(4)
        zoo_loss(capture.compile(model)(tokens), tokens).backward()
        torch._dynamo.reset()
        return {kind: gm.code for (kind, _), gm in capture.graphs.items()}
    finally:
        torch.distributed.destroy_process_group()


def test_hybrid_graphs_are_alike_on_ranks_of_other_groups():
    """Rank 0 (shard group 0-3, replica group 0, 4) and rank 5 (4-7; 1, 5) lower one graph:
    a host whose ranks sit in other groups compiles it once."""
    first, other = _lowered_graphs_on(0), _lowered_graphs_on(5)
    assert set(first) == {"forward", "backward"}
    assert first == other


# --------------------------------------------------------------------------- gloo, 2 x 2


@pytest.mark.slow  # four ranks on two cores; the combination matrix covers hybrid too
def test_hybrid_2x2_matches_single_process():
    ref = reference(zoo_training(STEPS))
    # 4 processes on 2 cores: few configs (full no-sync is covered at world size 2 elsewhere).
    configs = [(None, 1), (EAGER, 1), (None, K), (EAGER, K)]  # (compile, micro-batches)
    runs = [zoo_training(STEPS, strategy="hybrid_shard", mesh_shape=(2, 2), compile=compile,
                         micro_batches=micro, accumulation="replica_only")
            for compile, micro in configs]
    for rank_results in run_local(train, 4, runs):
        for config, result in zip(configs, rank_results):
            assert max(abs(a - b) for a, b in zip(result.losses, ref.losses)) < 1e-5, config
            # Replicas agree: the shards of each shard group equal the other group's.
            for name, expected in ref.params.items():
                assert (result.params[name] - expected).abs().max().item() < 1e-5, (config, name)
