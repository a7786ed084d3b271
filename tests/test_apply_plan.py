"""graphshard.apply_plan on a fake process group: a configuration of `graphshard plan` (its
JSON) sets the model up as it says, and a plan for another job is a clear error. The planner's
own output is applied in tests/test_plan.py (TP, float8, its best configuration)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import graphshard
from graphshard.tools.models import build_model

HYBRID = {"shard": {"strategy": "hybrid_shard", "mesh_shape": [2, 4],
                    "mesh_dim_names": ["replicate", "shard"], "tensor_parallel": 1,
                    "param_dtype": "bfloat16", "reduce_dtype": "float32"},
          "options": {"prefetch": 2, "bucket_mb": 25.0},
          "activation_checkpointing": "full", "micro_batch": 2, "accumulation_steps": 3,
          "fits": True}


def _model():
    model, _, _ = build_model("transformer", dim=32, n_layers=2, vocab_size=64)
    return model


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_a_hybrid_plan_read_from_its_file_sets_the_model_up_as_it_says(fake_pg, tmp_path):
    path = tmp_path / "best.json"
    path.write_text(json.dumps(HYBRID))
    model = _model()
    applied = graphshard.apply_plan(model, str(path))
    assert (applied.options, applied.micro_batch, applied.accumulation_steps) == (
        {"prefetch": 2, "bucket_mb": 25.0}, 2, 3)
    assert applied.mesh.mesh_dim_names == ("replicate", "shard") and applied.mesh.shape == (2, 4)
    weight = model.layers[0].attention.wq._parameters["weight"]
    assert isinstance(weight, DTensor) and weight.device_mesh == applied.mesh
    assert weight.placements[0].is_replicate() and weight.placements[1].is_shard(0)
    assert isinstance(model.layers[0].forward, functools.partial)  # checkpointed blocks
    # bf16 compute: the weight a forward reads
    assert model.layers[0].attention.wq.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_a_no_shard_plan_replicates_every_parameter(fake_pg):
    """The planner's no_shard rows (DDP's layout): every rank holds every parameter whole, or
    its TP piece whole over the data-parallel dim (DDP over TP)."""
    plan = {"shard": {"strategy": "no_shard", "mesh_shape": [8], "mesh_dim_names": ["dp"],
                      "tensor_parallel": 1},
            "options": {"bucket_mb": 25.0}, "activation_checkpointing": "none",
            "micro_batch": 4, "accumulation_steps": 1, "fits": True}
    model = _model()
    applied = graphshard.apply_plan(model, plan)
    assert applied.options == {"bucket_mb": 25.0} and applied.mesh.shape == (8,)
    weight = model.layers[0].attention.wq._parameters["weight"]
    assert isinstance(weight, DTensor) and weight.placements[0].is_replicate()
    assert weight.to_local().shape == weight.shape == (32, 32)

    with_tp = {**plan, "shard": {**plan["shard"], "mesh_shape": [4, 2],
                                 "mesh_dim_names": ["dp", "tp"], "tensor_parallel": 2}}
    model, _, _ = build_model("llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              vocab_size=64, ffn_hidden=128)
    applied = graphshard.apply_plan(model, with_tp)
    assert applied.mesh.mesh_dim_names == ("dp", "tp") and applied.mesh.shape == (4, 2)
    weight = model.layers[0].attention.wq._parameters["weight"]  # colwise on tp, whole on dp
    assert weight.placements[0].is_replicate() and weight.placements[1].is_shard(0)
    assert weight.to_local().shape == (weight.shape[0] // 2, weight.shape[1])
    norm = model.layers[0].attention_norm._parameters["weight"]  # not in the TP plan
    assert norm.placements[0].is_replicate() and norm.placements[1].is_replicate()


def test_a_plan_for_another_job_is_a_clear_error(fake_pg, tmp_path):
    plan = {**HYBRID, "shard": {**HYBRID["shard"], "mesh_shape": [4, 4]}}
    with pytest.raises(ValueError, match=r"the plan is for 16 devices .* this job has 8 ranks: "
                                         r"plan again with --devices 8"):
        graphshard.apply_plan(_model(), plan)
    missing = {key: value for key, value in HYBRID.items() if key != "micro_batch"}
    with pytest.raises(ValueError, match="has no 'micro_batch'"):
        graphshard.apply_plan(_model(), missing)
    with pytest.raises(ValueError, match=r"not a configuration of `graphshard plan` \(no 'shard'\)"):
        graphshard.apply_plan(_model(), {"options": {}})
    with pytest.raises(ValueError, match="lists no configuration"):
        graphshard.apply_plan(_model(), {"configs": []})
    with pytest.raises(ValueError, match="does not fit in memory"):
        graphshard.apply_plan(_model(), {**HYBRID, "fits": False, "why": "over by 2 GiB"})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read the plan"):
        graphshard.apply_plan(_model(), tmp_path / "bad.json")


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
@pytest.mark.parametrize("change, match", [
    ({"shard": {**HYBRID["shard"], "mesh_dim_names": ["replicate", "tp"]}},
     r"dims \['replicate', 'tp'\] does not fit strategy 'hybrid_shard' with tensor_parallel 1"),
    ({"shard": {**HYBRID["shard"], "tensor_parallel": 2}}, "does not fit strategy"),
    ({"shard": {**HYBRID["shard"], "bucket_mb": 4}}, r"shard arguments \['bucket_mb'\] are not"),
    ({"shard": {**HYBRID["shard"], "param_dtype": "bfloat17"}}, "bfloat17"),
    ({"activation_checkpointing": "most"}, "activation_checkpointing 'most' is not one of"),
    ({"options": {"prefetch": 2, "bucket": 1}}, r"unknown graphshard option\(s\) \['bucket'\]"),
    ({"micro_batch": 0}, "must be positive integers"),
])
def test_a_plan_graphshard_would_refuse_leaves_the_model_as_it_was(fake_pg, change, match):
    model = _model()
    forward = model.layers[0].forward
    with pytest.raises(ValueError, match=match):
        graphshard.apply_plan(model, {**HYBRID, **change})
    assert not graphshard.is_sharded(model)
    assert model.layers[0].forward == forward  # not checkpointed either


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_a_tp_degree_the_heads_refuse_leaves_a_float8_model_unconverted(fake_pg):
    plan = {**HYBRID, "shard": {**HYBRID["shard"], "mesh_shape": [1, 2, 4],
                                "mesh_dim_names": ["replicate", "shard", "tp"],
                                "tensor_parallel": 4},
            "float8": {"config": {"enable_fsdp_float8_all_gather": True}}}
    model, _, _ = build_model("llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              vocab_size=64, ffn_hidden=128)
    with pytest.raises(ValueError, match=r"TP degree 4 does not divide the model's head counts"):
        graphshard.apply_plan(model, plan)
    assert type(model.layers[0].attention.wq) is torch.nn.Linear  # not converted to float8
    assert not graphshard.is_sharded(model)


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_hybrid_shard_with_tensor_parallelism_lays_out_a_3d_mesh(fake_pg):
    plan = {**HYBRID, "shard": {**HYBRID["shard"], "mesh_shape": [2, 2, 2],
                                "mesh_dim_names": ["replicate", "shard", "tp"],
                                "tensor_parallel": 2}}
    model, _, _ = build_model("llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              vocab_size=64, ffn_hidden=128)
    applied = graphshard.apply_plan(model, plan)
    assert applied.mesh.mesh_dim_names == ("replicate", "shard", "tp")
    weight = model.layers[0].attention.wq._parameters["weight"]  # colwise on tp, then sharded
    assert weight.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")
    assert weight.placements[0].is_replicate() and weight.placements[2].is_shard(0)
    norm = model.layers[0].attention_norm._parameters["weight"]  # not in the TP plan
    assert norm.placements[1].is_shard(0) and norm.placements[2].is_replicate()


def test_apply_plan_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        graphshard.apply_plan(_model(), HYBRID)
