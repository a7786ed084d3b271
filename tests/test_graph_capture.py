"""Graph tests of the core lowering: fake process group, world size 8, one process."""

from __future__ import annotations

import pytest
import torch

from graphshard.passes import meta_keys
from graphshard.tools.models import build_model
from graphshard.passes.graph_utils import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, is_wait
from tests.capture import call_nodes, capture_step
from tests.zoo import Zoo, zoo_batch, zoo_loss

UNBUCKETED = {"bucket_mb": 0, "reorder": False}


def _params(node) -> tuple[str, ...]:
    return tuple(node.meta[meta_keys.PARAMS])


def _derived_from_gather(node, seen=None) -> bool:
    """True if `node` is, or is a view chain of, an all-gather's result."""
    views = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.permute.default,
             torch.ops.aten.t.default, torch.ops.aten.expand.default, torch.ops.aten.alias.default,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.transpose.int}
    if node.op != "call_function":
        return False
    if node.target in (WAIT, ALL_GATHER):
        return True
    return node.target in views and _derived_from_gather(node.args[0])


def test_one_all_gather_per_parameter_use_and_one_reduce_scatter_per_trainable(fake_pg):
    model = Zoo()
    graphs = capture_step(model, (zoo_batch(8),), zoo_loss, options=UNBUCKETED)
    fwd = graphs[("forward", "lowered")]
    gathers = call_nodes(fwd, ALL_GATHER)
    gathered = [_params(n) for n in gathers]
    # every sharded parameter read in forward is gathered exactly once (tied emb/head and the
    # twice-called block merged); the 0-dim `scale` is replicated and needs no gather
    sharded = {name for name, p in model.named_parameters() if p.dim() > 0}
    assert sorted(p for (p,) in gathered) == sorted(sharded)
    for node in gathers:  # each gather feeds only its own parameter's uses
        for user in node.users:
            assert is_wait(user)
            for use in user.users:
                assert use.meta.get(meta_keys.PARAMS, _params(node)) == _params(node)

    bwd = graphs[("backward", "lowered")]
    trainable_sharded = {n for n, p in model.named_parameters() if p.requires_grad and p.dim() > 0}
    scatters = [_params(n)[0] for n in call_nodes(bwd, REDUCE_SCATTER)]
    assert sorted(scatters) == sorted(trainable_sharded)  # one per trainable param, tied once
    assert [_params(n) for n in call_nodes(bwd, ALL_REDUCE)] == [("scale",)]  # the 0-dim param
    # frozen parameters are gathered but never reduced
    assert not any("frozen" in p for p in scatters)
    assert ("frozen.weight",) in gathered


def test_full_shard_regathers_in_backward_and_saves_no_full_weight(fake_pg):
    model, inputs, loss_fn = build_model("transformer", dim=64, n_layers=2, vocab_size=64, batch=2, seq_len=8)
    # reshard_after_forward=True: no unit kept, not even the last of forward (the default's).
    graphs = capture_step(model, inputs, loss_fn, strategy="full_shard",
                          options={**UNBUCKETED, "reshard_after_forward": True})
    fwd, bwd = graphs[("forward", "lowered")], graphs[("backward", "lowered")]
    assert len(call_nodes(bwd, ALL_GATHER)) > 0
    saved = list(fwd.graph.output_node().args[0])[1:]  # outputs after the loss are saved tensors
    offenders = [n.name for n in saved if isinstance(n, torch.fx.Node) and _derived_from_gather(n)]
    assert offenders == []
    # backward gathers exactly the weights needed for input gradients: every matmul weight
    bwd_gathered = {_params(n)[0] for n in call_nodes(bwd, ALL_GATHER)}
    assert "layers.0.attention.wq.weight" in bwd_gathered
    assert "output.weight" in bwd_gathered


def test_shard_grad_op_keeps_forward_gathers_for_backward(fake_pg):
    model, inputs, loss_fn = build_model("transformer", dim=64, n_layers=2, vocab_size=64, batch=2, seq_len=8)
    graphs = capture_step(model, inputs, loss_fn, strategy="shard_grad_op", options=UNBUCKETED)
    fwd, bwd = graphs[("forward", "lowered")], graphs[("backward", "lowered")]
    assert call_nodes(bwd, ALL_GATHER) == []
    saved = list(fwd.graph.output_node().args[0])[1:]
    assert any(isinstance(n, torch.fx.Node) and _derived_from_gather(n) for n in saved)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert len(call_nodes(bwd, REDUCE_SCATTER)) == trainable


def test_no_shard_all_reduces_gradients_and_gathers_nothing(fake_pg):
    model = Zoo()
    graphs = capture_step(model, (zoo_batch(8),), zoo_loss, strategy="no_shard", options=UNBUCKETED)
    fwd, bwd = graphs[("forward", "lowered")], graphs[("backward", "lowered")]
    assert call_nodes(fwd, ALL_GATHER) == [] and call_nodes(bwd, REDUCE_SCATTER) == []
    reduced = sorted(_params(n)[0] for n in call_nodes(bwd, ALL_REDUCE))
    assert reduced == sorted(n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("fake_pg", [64], indirect=True)
def test_uneven_and_empty_shards_pad_to_chunk_and_narrow(fake_pg):
    # At world size 64, rank 0 holds ceil(11/64)=1 row of emb; gate.weight has 1 row in total.
    model = Zoo()
    graphs = capture_step(model, (zoo_batch(64),), zoo_loss, options=UNBUCKETED)
    fwd = graphs[("forward", "lowered")]
    by_param = {_params(n)[0]: n for n in call_nodes(fwd, ALL_GATHER)}
    emb = by_param["emb.weight"]
    assert tuple(emb.meta["val"].shape) == (64, 6)  # 64 ranks x 1 padded row
    narrowed = [u for u in next(iter(emb.users)).users if u.target is torch.ops.aten.slice.Tensor]
    assert narrowed and tuple(narrowed[0].meta["val"].shape) == (11, 6)
    bwd = graphs[("backward", "lowered")]
    rs = {_params(n)[0]: n for n in call_nodes(bwd, REDUCE_SCATTER)}
    assert tuple(rs["emb.weight"].args[0].meta["val"].shape) == (64, 6)  # padded to N x chunk


def test_graphs_read_plain_local_shards_not_dtensors(fake_pg):
    # A DTensor input brings its DeviceMesh into the graph as an opaque object; saved for
    # backward inside a checkpointed SDPA region it broke AOTAutograd's runtime ("expected all
    # tensors_saved_with_vc_check to be Tensors ... DeviceMesh").
    from tests.zoo import TinyGPT, gpt_batch

    model = TinyGPT("full")
    graphs = capture_step(model, (gpt_batch(8),), zoo_loss)
    for (kind, stage), gm in graphs.items():
        inputs = [n.meta.get("val", n.meta.get("example_value"))  # Dynamo graphs: example_value
                  for n in gm.graph.find_nodes(op="placeholder")]
        odd = [type(v).__name__ for v in inputs
               if not isinstance(v, (torch.SymInt, int)) and type(v) is not torch._subclasses.FakeTensor]
        assert not odd, (kind, stage, odd)
    assert all(isinstance(p.grad, torch.distributed.tensor.DTensor) for p in model.parameters()
               if p.requires_grad)


class _ReadsInReverse(torch.nn.Module):
    """Registers `late` before `early` but uses `early` first: registration order differs
    from graph order."""

    def __init__(self):
        super().__init__()
        self.late = torch.nn.Linear(8, 8)
        self.early = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


def test_materialized_parameters_keep_registration_order_for_bucketing(fake_pg):
    import graphshard

    def bucket_order(model):
        x = torch.randn(4, 8)
        graphs = capture_step(model, (x,), lambda out, x: out.square().mean())
        return [_params(n) for n in call_nodes(graphs[("forward", "bucketed")], ALL_GATHER)]

    torch.manual_seed(0)
    built = bucket_order(_ReadsInReverse())
    with torch.device("meta"):
        model = _ReadsInReverse()
    graphshard.shard(model)
    graphshard.materialize(model)
    materialized = bucket_order(model)
    registration = ("late.weight", "late.bias", "early.weight", "early.bias")
    assert built == materialized == [registration]


def test_shards_keep_static_shapes_under_dynamic_true(fake_pg):
    # Dynamo gives nn.Parameters static shapes even under dynamic=True; the local shards the
    # graphs read get them too. Symbolic shard sizes reached the padding of uneven shards, in
    # code that never bound them (compiler="eager": "NameError: name 's42' is not defined").
    import graphshard
    from tests.capture import GraphCapture

    model = graphshard.shard(Zoo())
    capture = GraphCapture(UNBUCKETED)
    step = torch.compile(model, backend=capture.backend, fullgraph=True, dynamic=True)
    tokens = zoo_batch(64)
    zoo_loss(step(tokens), tokens).backward()
    forward = capture.graphs[("forward", "lowered")]
    shapes = [tuple(n.meta["val"].shape) for n in forward.graph.find_nodes(op="placeholder")
              if isinstance(n.meta.get("val"), torch.Tensor)]
    assert any(isinstance(d, torch.SymInt) for shape in shapes for d in shape)  # the batch
    gathered = [tuple(n.args[0].meta["val"].shape) for n in call_nodes(forward, ALL_GATHER)]
    assert len(gathered) == 7 and all(isinstance(d, int) for shape in gathered for d in shape), gathered
