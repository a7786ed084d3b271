"""What an elementwise op costs once Inductor has fused it: its evaluations, at its own rate.

The roofline (cost_model.node_cost) prices an elementwise node by the bytes it moves, which is
right for a node whose value Inductor writes to memory once. Two things it misses, both
measured on a CPU: transcendental functions (exp, sin, pow of a tensor exponent) compute for
longer per element than the bytes take; and Inductor inlines a small elementwise producer into
each kernel that reads it instead of writing it out, so a value broadcast into a larger kernel
is computed once per element of that kernel. The rotary tables of a Llama computed in
`forward` (`cos`/`sin` of `theta ** (arange / d)`, 64 x 16 values) are computed again in the
kernel that rotates each query and each key, once per pair of elements rotated.

`kernel_evaluations` counts how often the fused kernels compute each elementwise node, by
Inductor's rules on a CPU: a value is written out where an op that is not fused with it (a
matmul, an extern kernel, the output) reads it, or where it is read more than once and its
inlined definition holds exp, log, sigmoid or tanh, reads more than 4 buffers or exceeds 50 ops;
a reduction fuses what it reads. Kernels of one size between two unfused ops are taken as one
(Inductor fuses them: the query's rotated halves are one loop). The seconds per evaluation are
measured per op family by `graphshard calibrate` (ClusterSpec.elementwise_s), in Inductor's
vectorized code.
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
# What Inductor writes out when it is read more than once, on a CPU (ir.should_realize_on_reuse).
_HEAVY_ON_REUSE = frozenset({aten.exp, aten.log, aten.log10, aten.log1p, aten.log2, aten.sigmoid,
                             aten.tanh})
# Ops Inductor lowers to elementwise code though they carry no pointwise tag.
_ELEMENTWISE_UNTAGGED = frozenset({
    prims.iota.default, aten.full.default, aten.full_like.default, aten.scalar_tensor.default,
    aten._to_copy.default, aten.copy.default, aten.arange.start_step, aten.arange.default,
    aten.arange.start, aten.slice_scatter.default, aten.select_scatter.default,
    aten.constant_pad_nd.default, aten.index.Tensor, aten._unsafe_index.Tensor,
    aten.gather.default})
_RESHAPES = frozenset({aten.reshape.default, aten._unsafe_view.default, operator.getitem})
# Inductor's thresholds for writing out a value read more than once on a CPU
# (config.realize_reads_threshold, config.realize_cpu_opcount_threshold).
_REUSE_READS = 4
_REUSE_OPS = 50
_CAP = 1 << 20
# The size Inductor assumes for an unbacked SymInt (it has no hint).
UNBACKED_SIZE_HINT = 8192


def family(node: fx.Node) -> str | None:
    """The calibrated family of an elementwise node ("arith" for the cheap ones) as Inductor
    lowers it; None where the node is not elementwise. x ** n for an integer |n| < 32 is
    multiplications, x ** 0.5 a square root, 2 ** x an exp2."""
    if not _is_elementwise(node):
        return None
    found = _FAMILY_OF.get(getattr(node.target, "overloadpacket", None), ARITH)
    if node.target is aten.pow.Tensor_Scalar:
        exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
        if isinstance(exponent, (int, float)):
            if float(exponent).is_integer() and abs(exponent) < 32:
                return ARITH
            if exponent == 0.5:
                return "sqrt"
    if node.target is aten.pow.Scalar and node.args and node.args[0] == 2:
        return "exp"
    return found


def _is_elementwise(node: fx.Node) -> bool:
    return (node.op == "call_function" and is_op_overload(node.target)
            and (torch.Tag.pointwise in node.target.tags or node.target in _ELEMENTWISE_UNTAGGED))


def _is_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and is_op_overload(node.target) and torch.Tag.reduction in node.target.tags


def _is_lazy_view(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _RESHAPES or is_view(node))


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    numel = val.numel()
    # a symbolic size at its hint (no guard); an unbacked one at Inductor's assumed size
    if isinstance(numel, torch.SymInt):
        return int(optimization_hint(numel, fallback=UNBACKED_SIZE_HINT))
    return numel


def _readers(node: fx.Node) -> int:
    """How many ops read `node`, through views."""
    return sum(_readers(u) if _is_lazy_view(u) else 1 for u in node.users)


def kernel_evaluations(graph: fx.Graph) -> dict[fx.Node, int]:
    """{elementwise node: how many times Inductor's kernels compute it}: its element count
    where its value is written out, else the sizes of the kernels it is inlined into, each
    kernel once."""
    nodes = list(graph.nodes)
    fusable = {n for n in nodes if _is_elementwise(n) or _is_lazy_view(n)}
    # Written because an op not fused with it reads it, directly or through views.
    needs_buffer: dict[fx.Node, bool] = {}
    for node in reversed(nodes):
        if node in fusable:
            needs_buffer[node] = any(needs_buffer[u] if _is_lazy_view(u)
                                     else not (u in fusable or _is_reduction(u)) for u in node.users)
    # Written because it is read more than once and recomputing it costs more (a view's base
    # is what is written); the ops since the last unfused one are one stretch of kernels.
    written: dict[fx.Node, bool] = {}
    reads: dict[fx.Node, int] = {}
    ops: dict[fx.Node, int] = {}
    heavy: dict[fx.Node, bool] = {}
    stretch: dict[fx.Node, int] = {}
    unfused = 0
    for node in nodes:
        if node.op == "call_function" and node not in fusable and not _is_reduction(node):
            unfused += 1
        stretch[node] = unfused
        if node not in fusable:
            continue
        view = _is_lazy_view(node)
        inlined = [n for n in node.all_input_nodes if n in fusable and not written[n]]
        reads[node] = min(len({n for n in node.all_input_nodes if n not in inlined})
                          + sum(reads[n] for n in inlined), _CAP)
        ops[node] = min(sum(ops[n] for n in inlined) + (0 if view else 1), _CAP)
        heavy[node] = (getattr(node.target, "overloadpacket", None) in _HEAVY_ON_REUSE
                       or any(heavy[n] for n in inlined))
        reused = (not view and _readers(node) > 1
                  and (heavy[node] or reads[node] > _REUSE_READS or ops[node] > _REUSE_OPS))
        written[node] = not view and (needs_buffer[node] or reused)
    # The kernels each inlined node is computed in: (stretch, size) of each written node or
    # reduction it reaches through inlined readers.
    kernels: dict[fx.Node, frozenset] = {}
    evaluations: dict[fx.Node, int] = {}
    for node in reversed(nodes):
        if node not in fusable:
            continue
        found: set = set()
        for user in node.users:
            if _is_reduction(user):
                found.add((stretch[user], _numel(node)))
            elif user in fusable:
                found |= {(stretch[user], _numel(user))} if written[user] else kernels[user]
        kernels[node] = frozenset(found)
        if not _is_lazy_view(node):
            evaluations[node] = _numel(node) if written[node] else sum(size for _, size in found)
    return evaluations


def elementwise_seconds(node: fx.Node, evaluations: int, rates: Mapping[str, float]) -> float:
    """Seconds the fused kernels spend computing `node` `evaluations` times at the measured
    seconds per evaluation of its family (`rates`, ClusterSpec.elementwise_s); 0 where the
    family was not measured or the node is not elementwise."""
    kind = family(node)
    return evaluations * rates.get(kind, 0.0) if kind is not None else 0.0
