"""Mixed precision: gather in param_dtype (cast once, before the gather), compute in
param_dtype, reduce gradients in reduce_dtype, fp32 master parameters and optimizer state."""

from __future__ import annotations

import functools

import pytest
import torch

import graphshard
from graphshard.tools.launch import run_local
from graphshard.tools.models import build_llama, cross_entropy_loss
from graphshard.passes.graph_utils import ALL_GATHER, REDUCE_SCATTER
from graphshard.passes.lowering import CAST
from tests.capture import GraphCapture
from tests.workers import EAGER, Training, reference, train

TINY = dict(batch=4, seq_len=8, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
            vocab_size=64)
STEPS, LR = 3, 0.5
# bf16 has an 8-bit mantissa (eps 2^-8 ~ 3.9e-3). Sharded and reference runs round at different
# points (per-rank half batches, fp32 reduction), so they agree to a few bf16 ulps, not bitwise.
LOSS_RTOL, PARAM_ATOL = 2e-2, 1e-2


def _tiny_llama():
    torch.manual_seed(0)
    model, (tokens,), _ = build_llama(**TINY)
    return model, tokens


@pytest.mark.parametrize("policy", ["kwargs", "object"])
def test_graph_dtypes_and_one_cast_per_gather(fake_pg, policy):
    model, tokens = _tiny_llama()
    kwargs = (dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy == "kwargs"
              else dict(mixed_precision=graphshard.MixedPrecisionPolicy(torch.bfloat16,
                                                                        torch.float32)))
    graphshard.shard(model, **kwargs)
    capture = GraphCapture(stages=("lowered",))
    out = capture.compile(model)(tokens)
    assert out.dtype == torch.bfloat16  # compute ran in param_dtype
    cross_entropy_loss(out, tokens).backward()
    n_params = len(list(model.parameters()))
    for kind in ("forward", "backward"):
        gm = capture.graphs[(kind, "lowered")]
        gathers = [n for n in gm.graph.nodes if n.target is ALL_GATHER]
        assert len(gathers) == n_params if kind == "forward" else gathers
        for gather in gathers:
            source = gather.args[0]
            assert source.meta["val"].dtype == torch.bfloat16, gather.name
            # exactly one cast, straight from the fp32 shard (a graph input) to the gather
            assert source.target is CAST and source.args[0].op == "placeholder"
            assert source.args[0].meta["val"].dtype == torch.float32
        casts_of_inputs = [n for n in gm.graph.nodes if n.target is CAST
                           and n.args[0].op == "placeholder"
                           and n.meta["val"].dtype == torch.bfloat16]
        assert len(casts_of_inputs) == len(gathers)  # once per gather, not once per use
    scatters = [n for n in capture.graphs[("backward", "lowered")].graph.nodes
                if n.target is REDUCE_SCATTER]
    assert len(scatters) == n_params
    assert all(n.args[0].meta["val"].dtype == torch.float32 for n in scatters)
    for param in model.parameters():  # master weights and gradients stay fp32, sharded
        assert param.dtype == param.to_local().dtype == torch.float32
        assert param.grad.dtype == torch.float32 and param.grad.to_local().shape == \
            param.to_local().shape
    torch._dynamo.reset()


# --------------------------------------------------------------------------- gloo numerics


def _llama_model():
    return _tiny_llama()[0]


def _llama_data(step):
    return (_tiny_llama()[1],)


def _training(compile: dict | None) -> Training:
    """SGD with bf16 parameters for compute, fp32 reduction."""
    return Training(model=_llama_model, data=_llama_data, loss=cross_entropy_loss,
                    optimizer=functools.partial(torch.optim.SGD, lr=LR), steps=STEPS,
                    compile=compile, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_bf16_matches_bf16_reference():
    # Single process, fp32 master weights; each step computes with a bf16 copy of them.
    ref = reference(_training(None))
    configs = [None, EAGER]
    per_rank = run_local(train, 2, [_training(compile) for compile in configs])
    for rank_results in per_rank:
        for compile, result in zip(configs, rank_results):
            # fp32 gradients (each step) and master parameters, sharded like the parameters
            assert result.grad_problems == [], compile
            assert all(p.dtype == torch.float32 for p in result.params.values()), compile
            for a, b in zip(result.losses, ref.losses):
                assert abs(a - b) <= LOSS_RTOL * abs(b), (compile, result.losses, ref.losses)
            for name, expected in ref.params.items():
                assert (result.params[name] - expected).abs().max().item() < PARAM_ATOL, (compile, name)
    # The eager and compiled paths run the same lowering: they agree far more tightly.
    eager, compiled = per_rank[0]
    assert max(abs(a - b) for a, b in zip(eager.losses, compiled.losses)) < 1e-3


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 3))


def _float_input_outputs(rank, world):
    """Eager, then compiled: (output, every parameter got a gradient) of each."""
    outputs = []
    for compiled in (False, True):
        model = graphshard.shard(_mlp(), param_dtype=torch.bfloat16)
        fn = (torch.compile(model, backend="graphshard", options={"compiler": "eager"})
              if compiled else model)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))  # fp32 input
        out = fn(x)
        out.float().square().mean().backward()
        outputs.append((out.detach(), all(p.grad is not None for p in model.parameters())))
    return outputs


def test_float_inputs_are_cast_to_param_dtype_like_fsdp2():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    expected = _mlp().to(torch.bfloat16)(x.to(torch.bfloat16))
    for per_rank in run_local(_float_input_outputs, 2):  # one launch for both
        for compiled, (out, has_grads) in zip((False, True), per_rank):
            assert out.dtype == torch.bfloat16 and has_grads
            assert torch.allclose(out.float(), expected.float(), atol=1e-2), compiled
    with pytest.raises(ValueError, match="cast_forward_inputs must be a bool"):
        graphshard.MixedPrecisionPolicy(torch.bfloat16, cast_forward_inputs="yes")
