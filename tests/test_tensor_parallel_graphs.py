"""Tensor parallelism in graphshard's graphs and its bad inputs: one process, a fake process
group (graph structure only; the numerics are in tests/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import graphshard
from graphshard.compiler.host_compile import TENSOR_PARALLEL
from graphshard.tools.dump.analysis import dump
from graphshard.tools.dump.loading import load_workload


@pytest.fixture(scope="module")
def llama_tp2_dump():
    workload = load_workload("llama", meta=True, batch=2, seq_len=16,
                             model_args={"n_layers": 2, "dim": 64, "n_heads": 4,
                                         "n_kv_heads": 2, "vocab_size": 128})
    return dump(workload, world_size=8, tp=2).report, workload.model.config


def test_dump_shows_tp_collectives_beside_graphshards_on_their_own_group(llama_tp2_dump):
    report, config = llama_tp2_dump
    assert report.mesh == [4, 2]
    ours = [c for c in report.collectives if c.purpose == "fsdp"]
    tp = [c for c in report.collectives if c.purpose == "tensor_parallel"]
    # rowwise wo and w2 all-reduce their partial outputs: 2 per block in forward; backward
    # all-reduces the column-parallel inputs' gradients (q/k/v's and w1/w3's)
    assert [c.op for c in tp if c.graph == "forward"] == ["all_reduce"] * 4
    assert sum(c.graph == "backward" for c in tp) >= 4
    assert {c.group for c in tp}.isdisjoint({c.group for c in ours})
    assert all(c.group_size == 2 for c in tp) and all(c.group_size == 4 for c in ours)
    # graphshard still buckets per block: one gather of each block's TP pieces
    forward_gathers = [c for c in ours if c.graph == "forward" and c.op == "all_gather"]
    layer0 = [c for c in forward_gathers if any(p.startswith("layers.0.") for p in c.params)]
    assert len(layer0) == 1 and len(layer0[0].params) == 9
    # what graphshard gathers is the TP piece: half of each column/row-parallel weight
    assert report.comm.symbols["N"] == 4
    dim, kv_dim, hidden = config.dim, config.dim // 2, config.ffn_hidden  # fp32: 4 bytes
    whole = 4 * (2 * dim * dim + 2 * dim * kv_dim + 3 * dim * hidden)
    assert layer0[0].bytes == whole // 2 + 4 * 2 * dim  # + the two norms, not parallelised
    assert report.comm.tensor_parallel.count == len(tp)
    # the graph takes the TP plan's DeviceMesh, whose rank's place AOTAutograd's cache key and
    # the compiled graphs hold: each rank compiles its own, and the dump says so
    assert report.compile == f"per rank: {TENSOR_PARALLEL}"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_bad_tensor_parallel_inputs_get_clear_errors(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="names no module"):
        graphshard.parallelize(_mlp(), mesh["tp"], {"3": "colwise"})
    with pytest.raises(ValueError, match="does not translate"):
        graphshard.parallelize(_mlp(), mesh["tp"], {"0": "packed_colwise"})
    with pytest.raises(ValueError, match="one named dimension"):
        graphshard.parallelize(_mlp(), mesh, {"0": "colwise"})
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        graphshard.parallelize(_mlp(), mesh["tp"])

    from graphshard.tools.models import Llama, LlamaConfig
    with torch.device("meta"):
        llama = Llama(LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2))
    four = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp4", "tp4"))
    with pytest.raises(ValueError, match="does not divide the model's head counts"):
        graphshard.parallelize(llama, four["tp4"])

    # a width TP cannot split evenly
    uneven = nn.Sequential(nn.Linear(16, 6))
    parallelize_module(uneven, four["tp4"], {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="not divisible by 4"):
        graphshard.shard(uneven, four["dp4"])

    # parallelised on one mesh, sharded on a mesh that is not its sibling
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("data",))
    model = graphshard.parallelize(_mlp(), mesh["tp"], {"0": "colwise", "2": "rowwise"})
    with pytest.raises(ValueError, match="not a sibling"):
        graphshard.shard(model, other)

    # TP outermost: the data-parallel dims must come first
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp_outer", "dp_inner"))
    model = graphshard.parallelize(_mlp(), swapped["tp_outer"], {"0": "colwise"})
    with pytest.raises(ValueError, match="must come before the TP dims"):
        graphshard.shard(model, swapped["dp_inner"])


def test_clusters_one_after_another_in_one_process_use_their_own_groups():
    """plan captures one layout after another, each on a new fake process group: DTensor's
    cached sharding results (keyed by mesh equality) must not hand a layout a dead group."""
    args = {"n_layers": 1, "dim": 64, "n_heads": 8, "n_kv_heads": 8, "vocab_size": 128}
    for strategy, shard_size, mesh in (("full_shard", None, [32, 2]),
                                       ("hybrid_shard", 4, [8, 4, 2])):
        workload = load_workload("llama", meta=True, batch=1, seq_len=16, model_args=args)
        report = dump(workload, world_size=64, tp=2, strategy=strategy,
                      shard_size=shard_size).report
        assert report.mesh == mesh
        assert any(c.purpose == "tensor_parallel" for c in report.collectives)
