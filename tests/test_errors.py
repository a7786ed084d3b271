"""Bad input gets a clear error, never a hang or a silent wrong answer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import graphshard
from graphshard.compiler.options import GraphshardOptions, parse_option_strings


def test_shard_without_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="torchrun.*init_process_group"):
        graphshard.shard(nn.Linear(4, 4))


def test_unknown_strategy_lists_valid_ones(fake_pg):
    with pytest.raises(ValueError, match="unknown sharding strategy 'zero9'.*full_shard.*"
                                         "shard_grad_op.*no_shard.*hybrid_shard"):
        graphshard.shard(nn.Linear(4, 4), strategy="zero9")


def test_sharding_twice_is_refused(fake_pg):
    model = graphshard.shard(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="already sharded"):
        graphshard.shard(model)


def test_parameters_on_different_devices_are_refused(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with pytest.raises(ValueError, match="different devices.*cpu.*meta"):
        graphshard.shard(model)


def test_mesh_of_wrong_dimension_is_refused(fake_pg):
    mesh_2d = init_device_mesh("cpu", (2, 4))
    with pytest.raises(ValueError, match="'full_shard' needs a 1-D DeviceMesh, got a 2-D"):
        graphshard.shard(nn.Linear(4, 4), mesh_2d)
    mesh_1d = init_device_mesh("cpu", (8,))
    with pytest.raises(ValueError, match="'hybrid_shard' needs a 2-D DeviceMesh"):
        graphshard.shard(nn.Linear(4, 4), mesh_1d, strategy="hybrid_shard")


def test_a_mesh_without_this_rank_is_refused(fake_pg):
    from torch.distributed.device_mesh import DeviceMesh

    with pytest.raises(ValueError, match=r"this rank \(0\) is not in the DeviceMesh over ranks "
                                         r"\[1, 2\]: call graphshard.shard only on the ranks"):
        graphshard.shard(nn.Linear(4, 4), DeviceMesh("cpu", [1, 2]))


def test_shard_returns_the_same_module_with_dtensor_parameters(fake_pg):
    model = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3))
    model.register_buffer("steps", torch.zeros(2))
    out = graphshard.shard(model)
    assert out is model
    from torch.distributed.tensor import DTensor, Shard
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
        assert p.placements == (Shard(0),)
    assert not isinstance(model.steps, DTensor)  # buffers are not sharded
    assert model[0].weight.shape == (3, 5) and not isinstance(model[0].weight, DTensor)


def test_unknown_backend_option_is_refused():
    with pytest.raises(ValueError, match="unknown graphshard option.*'bucket_size'.*bucket_mb"):
        GraphshardOptions.from_dict({"bucket_size": 1})
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        GraphshardOptions.from_dict({"prefetch": -1})
    assert parse_option_strings(["bucket_mb=0", "reorder=false", "max_inflight_mb=none"]) == {
        "bucket_mb": 0.0, "reorder": False, "max_inflight_mb": None}
    with pytest.raises(ValueError, match="reorder expects true/false"):
        parse_option_strings(["reorder=maybe"])


def test_unknown_option_through_torch_compile_fails_clearly(fake_pg):
    model = graphshard.shard(nn.Linear(4, 4))
    compiled = torch.compile(model, backend="graphshard", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown graphshard option"):
        compiled(torch.randn(2, 4))


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_a_torch_compile_mode_is_refused_by_name(fake_pg, mode):
    # torch.compile hands mode= to the backend; it failed with "unexpected keyword argument"
    model = graphshard.shard(nn.Linear(4, 4))
    with pytest.raises(Exception, match=f"graphshard takes no torch.compile mode= \\(got '{mode}'\\)"):
        torch.compile(model, backend="graphshard", mode=mode)(torch.randn(2, 4))


class _RenormalisedEmbedding(nn.Module):
    def __init__(self, max_norm: float | None, checkpointed: bool = False):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 7, max_norm=max_norm), nn.Linear(7, 3)
        self.checkpointed = checkpointed

    def forward(self, x):
        if self.checkpointed:  # the read inside an activation-checkpoint region's subgraph
            h = checkpoint(self.emb, x, use_reentrant=False)
        else:
            h = self.emb(x)
        return self.head(h.mean(1))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_an_in_place_edit_of_a_gathered_weight_in_a_compiled_forward_is_refused(fake_pg,
                                                                               checkpointed):
    # nn.Embedding(max_norm=) renormalises the rows it reads in place: under compile that edits
    # the gathered copy, never the shard (the shard silently kept its old rows).
    x = torch.randint(0, 20, (4, 6))
    eager = {"compiler": "eager"}
    model = graphshard.shard(_RenormalisedEmbedding(max_norm=1.0, checkpointed=checkpointed))
    with pytest.raises(Exception, match=r"forward edits parameter\(s\) emb.weight in place"):
        torch.compile(model, backend="graphshard", options=eager)(x)
    torch._dynamo.reset()
    plain = graphshard.shard(_RenormalisedEmbedding(max_norm=None, checkpointed=checkpointed))
    compiled = torch.compile(plain, backend="graphshard", options=eager)
    compiled(x).sum().backward()  # reads only: compiles
    with torch.inference_mode():  # inference tensors have no version counter to read
        compiled(x)
    torch._dynamo.reset()


def test_cluster_option_must_name_a_calibration_file(tmp_path):
    with pytest.raises(ValueError, match="cluster must be the path of a JSON file"):
        GraphshardOptions.from_dict({"cluster": str(tmp_path / "missing.json")})
    from graphshard.compiler.cost_model import ClusterSpec
    from graphshard.compiler.backend import GraphshardCompiler
    path = tmp_path / "cluster.json"
    spec = ClusterSpec(latency_s=1e-5, bandwidth_Bps=1e10, flops_per_s=1e12,
                       memory_bandwidth_Bps=1e11, kernel_overhead_s=1e-6)
    path.write_text(spec.to_json())
    assert GraphshardCompiler(GraphshardOptions.from_dict({"cluster": str(path)})).cluster == spec


def test_sparse_embedding_gradients_are_refused_at_shard(fake_pg):
    # A sparse gradient cannot be reduce-scattered: refused at shard(), not inside backward.
    model = nn.Sequential(nn.Embedding(16, 8, sparse=True), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"'0' is an nn.Embedding with sparse=True.*sparse=False"):
        graphshard.shard(model)
    bag = nn.EmbeddingBag(16, 8, sparse=True)
    with pytest.raises(ValueError, match="the model is an nn.EmbeddingBag with sparse=True"):
        graphshard.shard(bag)
    frozen = nn.Embedding(16, 8, sparse=True).requires_grad_(False)  # no gradient: nothing to reduce
    assert isinstance(graphshard.shard(frozen).weight, torch.Tensor)


class _PenalisedInForward(nn.Module):
    """An L2 penalty over self.lin.parameters() inside forward (the sharded DTensors)."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        penalty = sum(p.pow(2).sum() for p in self.lin.parameters())
        return self.head(torch.tanh(self.lin(x))).sum() + penalty


def test_parameters_read_through_parameters_in_forward_are_named(fake_pg):
    # They are this rank's shards, not the weights: without the check the error comes from
    # torch, in backward, as "got mixed torch.Tensor and DTensor". Default options (Inductor):
    # the check runs before anything is compiled.
    compiled = torch.compile(graphshard.shard(_PenalisedInForward()), backend="graphshard")
    with pytest.raises(Exception, match=r"forward reads parameter\(s\) lin.weight, lin.bias "
                                        r"through module.parameters\(\).*module attributes"):
        compiled(torch.randn(2, 8))
