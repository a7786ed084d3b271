"""What an elementwise op costs once Inductor has fused it: its evaluations, at its own rate.

The roofline (cost_model.node_cost) prices an elementwise node by the bytes it moves, which is
right for a node whose value Inductor writes to memory once. Two things it misses, both
measured on a CPU: transcendental functions (exp, sin, pow of a tensor exponent) compute for
longer per element than the bytes take; and Inductor inlines a small elementwise producer into
every consumer kernel instead of writing it out, so a value broadcast to a larger consumer is
computed once per element of the consumer. The rotary tables of a Llama computed in `forward`
(`cos`/`sin` of `theta ** (arange / d)`, 64 x 16 values) are recomputed for every element of
every head's query and key: 8 ms of an 80 ms step on this machine, against 0.1 ms as written.

`kernel_evaluations` counts how often the fused kernels evaluate each elementwise node, by
Inductor's rules (a value is written out where a non-elementwise op reads it, or where it is
read more than once and its inlined definition reads many buffers or is long); the seconds per
evaluation are measured per op family by `graphshard calibrate` (ClusterSpec.elementwise_s).
"""

from __future__ import annotations

import operator
from typing import Mapping

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from graphshard._torch_compat import is_op_overload
from graphshard.passes.graph_utils import is_view

aten, prims = torch.ops.aten, torch.ops.prims

# Op families whose evaluation `graphshard calibrate` times (in Inductor's vectorized code);
# every other elementwise op is "arith".
FAMILIES: dict[str, tuple] = {
    "exp": (aten.exp, aten.exp2, aten.expm1, aten.sigmoid),
    "log": (aten.log, aten.log2, aten.log10, aten.log1p),
    "trig": (aten.sin, aten.cos, aten.tan, aten.sinh, aten.cosh, aten.asin, aten.acos, aten.atan,
             aten.atan2),
    "tanh": (aten.tanh,),
    "erf": (aten.erf, aten.erfc, aten.erfinv),
    "pow": (aten.pow,),
    "sqrt": (aten.sqrt, aten.rsqrt),
}
_FAMILY_OF = {packet: family for family, packets in FAMILIES.items() for packet in packets}
ARITH = "arith"
# Ops Inductor lowers to elementwise code though they carry no pointwise tag.
_ELEMENTWISE_UNTAGGED = frozenset({prims.iota.default, aten.full.default, aten.scalar_tensor.default,
                                   aten._to_copy.default, aten.clone.default, aten.arange.start_step,
                                   aten.arange.default, aten.arange.start})
_RESHAPES = frozenset({aten.reshape.default, aten._unsafe_view.default, operator.getitem})
# Inductor's thresholds for writing out a value read more than once (config.realize_reads_threshold,
# config.realize_opcount_threshold): past them, recomputing it in every reader costs more.
_REUSE_READS = 4
_REUSE_OPS = 30


def family(node: fx.Node) -> str | None:
    """The calibrated family of an elementwise node ("arith" for the cheap ones); None where
    the node is not elementwise. A power with a small integer exponent is Inductor's
    multiplications, so "arith"."""
    if not _is_elementwise(node):
        return None
    packet = getattr(node.target, "overloadpacket", None)
    found = _FAMILY_OF.get(packet, ARITH)
    if found == "pow" and node.target is aten.pow.Tensor_Scalar:
        exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
        if isinstance(exponent, (int, float)) and float(exponent).is_integer() and abs(exponent) <= 4:
            return ARITH
    return found


def _is_elementwise(node: fx.Node) -> bool:
    return (node.op == "call_function" and is_op_overload(node.target)
            and (torch.Tag.pointwise in node.target.tags or node.target in _ELEMENTWISE_UNTAGGED))


def _is_lazy_view(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _RESHAPES or is_view(node))


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    numel = val.numel()
    # a symbolic size at its hint (no guard); an unbacked one at Inductor's assumed size
    return int(optimization_hint(numel, fallback=8192)) if isinstance(numel, torch.SymInt) else numel


def kernel_evaluations(graph: fx.Graph) -> dict[fx.Node, int]:
    """{elementwise node: how many times Inductor's kernels compute it}: its element count
    where its value is written out, else the sum over its readers of how often they are
    computed (each computation reads it once)."""
    nodes = list(graph.nodes)
    # Written out because a non-elementwise op (a matmul, a reduction, a collective, the
    # output) reads it, directly or through views.
    needs_buffer: dict[fx.Node, bool] = {}
    for node in reversed(nodes):
        if not (_is_elementwise(node) or _is_lazy_view(node)):
            continue
        needs_buffer[node] = any(needs_buffer[u] if _is_lazy_view(u) else not _is_elementwise(u)
                                 for u in node.users)
    # Written out because it is read more than once and recomputing it is not cheap.
    written: dict[fx.Node, bool] = {}
    reads: dict[fx.Node, int] = {}
    ops: dict[fx.Node, int] = {}
    for node in nodes:
        if node not in needs_buffer:
            continue
        inlined = [n for n in node.all_input_nodes if n in written and not written[n]]
        reads[node] = min(sum(reads[n] for n in inlined)
                          + sum(1 for n in node.all_input_nodes if n not in inlined), 1 << 20)
        ops[node] = min(sum(ops[n] for n in inlined) + (0 if _is_lazy_view(node) else 1), 1 << 20)
        reused = len(node.users) > 1 and (reads[node] > _REUSE_READS or ops[node] > _REUSE_OPS)
        written[node] = needs_buffer[node] or reused
    evaluations: dict[fx.Node, int] = {}
    for node in reversed(nodes):
        if node not in written:
            continue
        if written[node]:
            evaluations[node] = _numel(node)
        else:
            evaluations[node] = sum(evaluations.get(u, 0) for u in node.users)
    return {node: count for node, count in evaluations.items() if not _is_lazy_view(node)}


def elementwise_seconds(node: fx.Node, evaluations: int, rates: Mapping[str, float]) -> float:
    """Seconds the fused kernels spend computing `node` `evaluations` times at the measured
    seconds per evaluation of its family (`rates`, ClusterSpec.elementwise_s); 0 where the
    family was not measured or the node is not elementwise."""
    kind = family(node)
    return evaluations * rates.get(kind, 0.0) if kind is not None else 0.0
