"""Elementwise cost: how often Inductor's fused kernels compute each elementwise node (a table
inlined into its readers is recomputed per reader's element), and the measured rates on top of
the roofline, on make_fx graphs with Inductor's decompositions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from graphshard.compiler.cost_model import ClusterSpec, compute_seconds, node_cost
from graphshard.compiler.elementwise_cost import ARITH, FAMILIES, family, kernel_evaluations
from graphshard.compiler.simulator import graph_estimate

aten = torch.ops.aten
SPEC = ClusterSpec(latency_s=1e-3, bandwidth_Bps=1e9, flops_per_s=1e9,
                   memory_bandwidth_Bps=1e10, kernel_overhead_s=0.0)
RATES = (("arith", 1e-11), ("pow", 3e-9), ("trig", 1e-9), ("exp", 1e-9))
BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 16, 8


def _graph(fn, *args):
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _rotary(q, w):
    """A Llama's rotary embedding with its tables computed in forward, then a matmul."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(SEQ).float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    q1, q2 = q[..., ::2], q[..., 1::2]
    rotated = torch.stack((q1 * cos - q2 * sin, q1 * sin + q2 * cos), dim=-1).flatten(-2)
    return rotated @ w


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


@pytest.fixture(scope="module")
def rotary():
    return _graph(_rotary, torch.randn(BATCH, HEADS, SEQ, HEAD_DIM), torch.randn(HEAD_DIM, HEAD_DIM))


def test_a_table_inlined_into_a_kernel_is_computed_once_per_element_of_that_kernel(rotary):
    """Inductor's code for _rotary (torch 2.13, CPU): one loop over the pairs of elements
    rotated, computing the power, cos and sin once per pair and writing both halves."""
    evaluations = kernel_evaluations(rotary.graph)
    pairs = BATCH * HEADS * SEQ * HEAD_DIM // 2
    (cos,), (sin,) = _nodes(rotary, aten.cos.default), _nodes(rotary, aten.sin.default)
    (power,) = _nodes(rotary, aten.pow.Scalar)
    assert cos.meta["val"].numel() == SEQ * HEAD_DIM // 2  # written as 16 x 4 values
    assert evaluations[cos] == evaluations[sin] == evaluations[power] == pairs
    # the two halves the stack (and so the matmul) reads are written, once per element
    (difference,) = _nodes(rotary, aten.sub.Tensor)
    assert evaluations[difference] == pairs


def test_a_table_read_by_kernels_of_two_sizes_is_computed_in_each():
    def rotate_query_and_key(q, k):
        cos = torch.outer(torch.arange(SEQ).float(), torch.arange(HEAD_DIM).float()).cos()
        return (q * cos) @ q.transpose(-1, -2), (k * cos) @ k.transpose(-1, -2)

    gm = _graph(rotate_query_and_key, torch.randn(2, 4, SEQ, HEAD_DIM), torch.randn(2, 2, SEQ, HEAD_DIM))
    (cos,) = _nodes(gm, aten.cos.default)
    assert kernel_evaluations(gm.graph)[cos] == (2 * 4 + 2 * 2) * SEQ * HEAD_DIM


def test_a_value_read_by_a_matmul_or_reused_past_inductors_thresholds_is_written_once():
    def silu_then_matmul(x, w):
        return torch.nn.functional.silu(x) @ w

    gm = _graph(silu_then_matmul, torch.randn(32, 16), torch.randn(16, 8))
    evaluations = kernel_evaluations(gm.graph)
    assert [evaluations[n] for n in _nodes(gm, aten.exp.default)] == [32 * 16]

    def long_then_reused(x, y):
        for _ in range(60):  # past Inductor's 50 ops on a CPU: cheaper to write out than recompute
            x = x * 1.01 + 0.5
        return x + y, x * y

    gm = _graph(long_then_reused, torch.randn(64), torch.randn(8, 64))
    last = max((n for n in gm.graph.nodes if n.target == aten.add.Tensor and len(n.users) == 2),
               key=lambda n: list(gm.graph.nodes).index(n))
    assert kernel_evaluations(gm.graph)[last] == 64

    def short_then_reused(x, y, z):
        x = x * 1.01 + 0.5
        return (x + y).sum(), (x * z - 1).sum(0)

    gm = _graph(short_then_reused, torch.randn(64), torch.randn(8, 64), torch.randn(4, 64))
    shared = next(n for n in gm.graph.nodes if n.target == aten.add.Tensor and len(n.users) == 2)
    # inlined into both reductions, kernels of 8 x 64 and 4 x 64 elements
    assert kernel_evaluations(gm.graph)[shared] == 8 * 64 + 4 * 64

    def heavy_then_reused(x, y):
        x = torch.exp(x)  # exp read twice is written out on a CPU, however short
        return (x + y).sum(), (x * y).sum(0)

    gm = _graph(heavy_then_reused, torch.randn(64), torch.randn(8, 64))
    (exp,) = _nodes(gm, aten.exp.default)
    assert kernel_evaluations(gm.graph)[exp] == 64

    def table_viewed_then_reused(a, x, y):
        table = torch.sin(a * 2.0 + 1.0)
        wide = table.expand(100, 64)  # the view's readers make the table's, written at its size
        big = wide * x + (wide + y) * 2.0 + 7.0
        return [big * i for i in range(60)]

    gm = _graph(table_viewed_then_reused, torch.randn(64), torch.randn(100, 64), torch.randn(100, 64))
    (sin,) = _nodes(gm, aten.sin.default)
    assert kernel_evaluations(gm.graph)[sin] == 100 * 64


def test_families_follow_what_inductor_computes():
    gm = _graph(lambda x: (x.pow(2), x.pow(0.5), x.pow(2.5), x.pow(17), 3.0 ** x, 2.0 ** x,
                           torch.sigmoid(x), x + 1, x @ x.t(), torch.tanh(x)), torch.randn(4, 4))
    kinds = {n.target: family(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert kinds[aten.mm.default] is None
    assert kinds[aten.add.Tensor] == ARITH
    assert kinds[aten.tanh.default] == "tanh"
    # x ** n (integer |n| < 32) is multiplications, x ** 0.5 a square root; 2 ** x an exp2
    assert sorted(family(n) for n in _nodes(gm, aten.pow.Tensor_Scalar)) == [ARITH, ARITH, "pow", "sqrt"]
    assert sorted(family(n) for n in _nodes(gm, aten.pow.Scalar)) == ["exp", "pow"]
    # sigmoid decomposes to exp, whose family it is
    assert "exp" in {family(n) for n in gm.graph.nodes if n.op == "call_function"}


def test_node_cost_is_at_least_the_evaluations_at_their_rate_and_the_estimate_adds_it(rotary):
    spec = dataclasses.replace(SPEC, elementwise_s=RATES)
    (cos,) = _nodes(rotary, aten.cos.default)
    roofline = node_cost(cos, spec).seconds
    assert node_cost(cos, SPEC, evaluations=10**6).seconds == roofline  # no rates: the roofline
    assert node_cost(cos, spec, evaluations=10**6).seconds == pytest.approx(max(roofline, 1e-3))
    evaluations = kernel_evaluations(rotary.graph)
    # the scheduler and "auto" price a node as the simulator does
    priced = compute_seconds(spec, rotary)
    assert priced(cos) == node_cost(cos, spec, evaluations=evaluations[cos]).seconds > roofline
    assert compute_seconds(SPEC, rotary)(cos) == roofline
    added = graph_estimate(rotary, spec).compute_s - graph_estimate(rotary, SPEC).compute_s
    # the trig and power evaluations alone, at their rates, bound it from below
    floor = sum(evaluations[n] * dict(RATES)[family(n)] for n in rotary.graph.nodes
                if family(n) in ("pow", "trig"))
    assert added >= floor * 0.9 > 0


def test_cluster_spec_elementwise_rows_are_checked_scaled_and_round_trip(tmp_path):
    spec = dataclasses.replace(SPEC, elementwise_s=RATES, compute_slots_per_node=2)
    assert [name for name, _ in spec.elementwise_s] == sorted(name for name, _ in RATES)
    spec.to_json(tmp_path / "spec.json")
    assert ClusterSpec.from_json(tmp_path / "spec.json") == spec
    shared = dict(spec.shared_by(3).elementwise_s)  # 3 ranks on 2 slots: 1.5x as long
    assert shared["pow"] == pytest.approx(1.5 * 3e-9)
    for bad in ((("cosine", 1e-9),), (("pow", -1.0),), (("pow",),), (("pow", True),),
                (("pow", 1e-9), ("pow", 2e-9))):
        with pytest.raises(ValueError, match="elementwise_s"):
            dataclasses.replace(SPEC, elementwise_s=bad)
    assert set(FAMILIES) | {ARITH} >= {name for name, _ in RATES}


def test_symbolic_sizes_count_at_their_hints():
    gm = make_fx(lambda x: torch.cos(x) * x, tracing_mode="symbolic")(torch.randn(12, 5))
    (cos,) = _nodes(gm, aten.cos.default)
    assert kernel_evaluations(gm.graph)[cos] == 60
