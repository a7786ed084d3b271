"""Hybrid sharding on a 2-D mesh (replicate, shard): sharded within each shard group, replicated
across groups; gradients reduce-scattered in the group, then all-reduced across groups."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from graphshard.backend import GraphshardCompiler
from graphshard.launch import run_local
from graphshard.options import GraphshardOptions
from passes.graph_utils import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, collective_group, wait_of
from tests.workers import ADAMW_DEFAULT_EPS, LR, reference_zoo
from tests.zoo import Zoo, zoo_batch, zoo_loss

STEPS, BATCH, K = 2, 12, 3


def _collectives(gm):
    return [(n, n.target, collective_group(n)) for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)]


def _capture(model, tokens):
    graphs = {}
    compiler = GraphshardCompiler(
        GraphshardOptions(compiler="eager"),
        observer=lambda kind, stage, gm: graphs.__setitem__(kind, copy.deepcopy(gm))
        if stage == "lowered" else None)
    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    zoo_loss(compiled(tokens), tokens).backward()
    return graphs, compiled


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_hybrid_graph_groups(fake_pg):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    replicate, shard = mesh.get_group("replicate").group_name, mesh.get_group("shard").group_name
    model = Zoo()
    graphshard.shard(model, mesh, strategy="hybrid_shard")
    tokens = zoo_batch(4)
    graphs, compiled = _capture(model, tokens)
    forward, backward = _collectives(graphs["forward"]), _collectives(graphs["backward"])
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

    # replica_only accumulation: reduce-scatter in the group each micro-batch, no all-reduce.
    graphs.clear()
    with graphshard.no_sync(model, replica_only=True):
        zoo_loss(compiled(tokens), tokens).backward()
    partial = _collectives(graphs["backward"])
    # One reduce-scatter per parameter *read* here (tied / twice-called ones are not merged).
    assert sum(t is REDUCE_SCATTER for _, t, _ in partial) >= len(scatters)
    assert all(g[0] == shard for _, t, g in partial)  # nothing across replica groups
    graphs.clear()
    zoo_loss(compiled(tokens), tokens).backward()  # synced: the ordinary graph (above), reused
    assert graphs == {}
    torch._dynamo.reset()


# --------------------------------------------------------------------------- gloo, 2 x 2


def _train(rank, world, configs):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    per = BATCH // world
    tokens = zoo_batch(BATCH)[rank * per:(rank + 1) * per]
    results = []
    for compiled, accumulate in configs:
        torch.manual_seed(0)
        model = Zoo()
        graphshard.shard(model, mesh, strategy="hybrid_shard")
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        fn = torch.compile(model, backend="graphshard", options={"compiler": "eager"},
                           fullgraph=True) if compiled else model
        losses = []
        for _ in range(STEPS):
            if accumulate is None:
                loss = zoo_loss(fn(tokens), tokens)
                loss.backward()
            else:
                micro, loss = tokens.chunk(K), 0.0
                with graphshard.no_sync(model, replica_only=accumulate == "replica_only"):
                    for batch in micro[:-1]:
                        part = zoo_loss(fn(batch), batch) / K
                        part.backward()
                        loss += part.detach()
                part = zoo_loss(fn(micro[-1]), micro[-1]) / K
                part.backward()
                loss = loss + part.detach()
            opt.step()
            opt.zero_grad()
            torch.distributed.all_reduce(loss)
            losses.append(loss.item() / world)
        # Replicas agree: the shards of each shard group equal the other group's.
        results.append((losses, {n: p.full_tensor() for n, p in model.named_parameters()}))
        torch._dynamo.reset()
    return results


def test_hybrid_2x2_matches_single_process():
    reference = reference_zoo(STEPS, BATCH, eps=ADAMW_DEFAULT_EPS, max_norm=None)
    ref_losses, ref_params = reference.losses, reference.params
    # 4 processes on 2 cores: few configs (full no-sync is covered at world size 2 elsewhere).
    configs = [(False, None), (True, None), (False, "replica_only"), (True, "replica_only")]
    for rank_results in run_local(_train, 4, configs):
        for config, (losses, params) in zip(configs, rank_results):
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, config
            for name, ref in ref_params.items():
                assert (params[name] - ref).abs().max().item() < 1e-5, (config, name)
