"""The cost model: what one collective or one compute node costs, in seconds and bytes.

Alpha-beta collectives and roofline compute, on the parameters of a machine (ClusterSpec,
graphshard/compiler/cluster_spec.py).
Sizes may be symbolic (sympy) where a formula is wanted ("at world size N"). The scheduler
(passes/reorder_collectives.py) and `graphshard dump` both price graphs with it; what a whole
graph does over time is graphshard/simulator.py's, its memory passes/liveness.py's, and
measuring a machine graphshard/calibrate.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from graphshard._torch_compat import is_op_overload, process_group_size
from graphshard.compiler.cluster_spec import FLOAT8_DTYPES, ClusterSpec  # noqa: F401 (re-exported)
from graphshard.compiler.elementwise_cost import (UNBACKED_SIZE_HINT, elementwise_seconds,
                                                  kernel_evaluations)
from graphshard.passes import meta_keys
from graphshard.passes.graph_utils import (COLLECTIVES, FREE_STORAGE, collective_group, collective_kind,
                                          exchange_share, full_buffer, is_collective, is_view,
                                          is_wait)

aten = torch.ops.aten
Sym = Union[int, float, sympy.Expr]  # a number, or a formula in e.g. sympy.Symbol("N")

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# Ops that only allocate: they read nothing and need not write their output.
_ALLOC_ONLY = frozenset({aten.empty.memory_format, aten.empty_strided.default,
                         aten.new_empty.default, aten.new_empty_strided.default})


# --------------------------------------------------------------------------- alpha-beta collectives


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")


def _as_sym(x: Any) -> Any:
    """SymInt/SymFloat -> its sympy expression; everything else unchanged."""
    return x.node.expr if isinstance(x, (torch.SymInt, torch.SymFloat)) else x


def is_plain_number(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)


def as_number_if_constant(expr: Any) -> Sym:
    """A formula stays a formula; a formula with no free symbols becomes a float."""
    expr = sympy.sympify(expr)
    return float(expr) if expr.is_number else expr


def check_world_size(world_size: Any) -> None:
    if is_plain_number(world_size) and (world_size < 1 or world_size != int(world_size)):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def wire_bytes(kind: str, nbytes: Sym, world_size: Sym) -> Sym:
    """Bytes each rank sends for a ring collective on an `nbytes` unsharded buffer.

    all_gather / reduce_scatter: (N-1)/N * nbytes; all_reduce (reduce-scatter + all-gather):
    2 (N-1)/N * nbytes. Numbers give a float; sympy expressions give an expression.
    """
    _check_kind(kind)
    nbytes, world_size = _as_sym(nbytes), _as_sym(world_size)
    check_world_size(world_size)
    factor = 2 if kind == "all_reduce" else 1
    if is_plain_number(nbytes, world_size):
        return float(factor * (world_size - 1) * nbytes / world_size)
    n = sympy.sympify(world_size)
    return as_number_if_constant(factor * (n - 1) * sympy.sympify(nbytes) / n)


def collective_time(kind: str, nbytes: Sym, world_size: Sym, spec: ClusterSpec) -> Sym:
    """alpha + wire_bytes / bandwidth; 0 at world size 1 (no collective runs).

    all_reduce pays alpha once, not 2(N-1) times: alpha here is the measured fixed cost of a
    whole collective call (gloo's per-step latency is folded into it, as for all-gather), and
    an all-reduce is one call. A symbolic world size gives Piecewise((0, N == 1), (..., True)).
    """
    nbytes, world_size = _as_sym(nbytes), _as_sym(world_size)
    wire = wire_bytes(kind, nbytes, world_size)
    latency, bandwidth = spec.alpha_beta(kind)
    if is_plain_number(nbytes, world_size):  # fast path: the reorder pass calls this in a loop
        return 0.0 if world_size == 1 else latency + wire / bandwidth
    expr = sympy.Float(latency) + sympy.sympify(wire) / sympy.Float(bandwidth)
    n = sympy.sympify(world_size)
    if not n.is_number:
        expr = sympy.Piecewise((0, sympy.Eq(n, 1)), (expr, True))
    elif n == 1:
        return 0.0
    return as_number_if_constant(expr)


# --------------------------------------------------------------------------- FX node costs


@dataclass(frozen=True)
class NodeCost:
    flops: Sym
    bytes: Sym
    seconds: Sym


ZERO_COST = NodeCost(0, 0, 0.0)


@dataclass(frozen=True)
class CollectiveCost:
    kind: str
    nbytes: Sym  # unsharded buffer size
    group_size: Sym
    wire_bytes: Sym
    seconds: Sym


def _scalar(x: Any, symbolic: bool) -> Any:
    if isinstance(x, torch.SymInt):
        return x.node.expr if symbolic else optimization_hint(x, fallback=UNBACKED_SIZE_HINT)
    return sympy.sympify(x) if symbolic else x


def value_bytes(val: Any, symbolic: bool = False) -> Sym:
    """Bytes of a tensor, or the sum over a (nested) tuple/list of them; 0 for non-tensors."""
    if isinstance(val, torch.Tensor):
        return _scalar(val.numel(), symbolic) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum((value_bytes(v, symbolic) for v in val), sympy.Integer(0) if symbolic else 0)
    return sympy.Integer(0) if symbolic else 0


def _node_val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _cpu_attention_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# torch's FLOP registry counts the GPU attention kernels, not the CPU's (the same math).
_FLOP_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
                  aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops}
ATTENTION_OPS = frozenset([*(op for op in flop_registry if "attention" in str(op)), *_FLOP_FORMULAS])


def _compute_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype whose peak prices a node: a float8 operand's (a float8 matmul returns a wider
    dtype), else its output's, else its first tensor input's (attention returns a tuple)."""
    inputs = [v.dtype for v in map(_node_val, node.all_input_nodes) if isinstance(v, torch.Tensor)]
    float8 = [dtype for dtype in inputs if dtype in FLOAT8_DTYPES]
    val = node.meta.get("val")
    if float8:
        return float8[0]
    if isinstance(val, torch.Tensor):
        return val.dtype
    return inputs[0] if inputs else None


def _attention_size(node: fx.Node, packet: Any) -> float | None:
    """sequence x head_dim of an attention node's query ([..., sequence, head_dim]), else None."""
    if packet not in ATTENTION_OPS:
        return None
    queries = [v for v in map(_node_val, node.all_input_nodes)
               if isinstance(v, torch.Tensor) and v.dim() >= 2]
    if not queries:
        return None
    # the backward's first input is the output's gradient, of the query's shape
    sequence, head_dim = queries[0].shape[-2:]
    return float(_scalar(sequence, False) * _scalar(head_dim, False))


def node_cost(node: fx.Node, spec: ClusterSpec, *, symbolic: bool = False,
              evaluations: int | None = None) -> NodeCost:
    """Roofline cost of one compute node: max(flops/peak, bytes/mem_bw) + kernel overhead;
    an elementwise node's, given how often the fused kernels compute it (`evaluations`,
    elementwise_cost.kernel_evaluations), at least that at its family's measured rate.

    Zero for placeholders, outputs, get_attr, views, getitem, frees, non-aten calls (SymInt math)
    and collectives/waits (those are collective_node_cost's). FLOPs come from
    torch.utils.flop_counter's registry (matmuls, convolutions, attention and their
    backwards); every other op is memory-bound: bytes = inputs + output.
    """
    if (node.op != "call_function" or is_collective(node) or is_wait(node) or is_view(node)
            or node.target is FREE_STORAGE or not is_op_overload(node.target)):
        return ZERO_COST
    zero = sympy.Integer(0) if symbolic else 0
    flops = zero
    packet = node.target.overloadpacket
    formula = flop_registry.get(packet) or _FLOP_FORMULAS.get(packet)
    if formula is not None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), _node_val)
        try:
            flops = _scalar(formula(*args, **kwargs, out_val=node.meta.get("val")), symbolic)
        except Exception as e:
            raise RuntimeError(f"FLOP formula for {node.name} ({node.target}) failed: {e}") from e
    nbytes = zero
    if node.target not in _ALLOC_ONLY:
        inputs = sum((value_bytes(_node_val(n), symbolic) for n in node.all_input_nodes), zero)
        nbytes = inputs + value_bytes(node.meta.get("val"), symbolic)
    if symbolic:
        seconds = sympy.Max(flops / sympy.Float(spec.flops_per_s),
                            nbytes / sympy.Float(spec.memory_bandwidth_Bps))
        return NodeCost(flops, nbytes, as_number_if_constant(seconds + sympy.Float(spec.kernel_overhead_s)))
    peak = spec.peak_flops(_compute_dtype(node), _attention_size(node, packet)) if flops else 1.0
    seconds = max(flops / peak, nbytes / spec.memory_bandwidth_Bps)
    if evaluations and spec.elementwise_s:
        seconds = max(seconds, elementwise_seconds(node, evaluations, dict(spec.elementwise_s)))
    return NodeCost(int(flops), int(nbytes), seconds + spec.kernel_overhead_s)


def priced_evaluations(spec: ClusterSpec, *graphs: fx.GraphModule | fx.Graph) -> dict[fx.Node, int]:
    """How often `graphs`' fused kernels compute each elementwise node, where `spec` prices
    elementwise ops by it (`node_cost`'s `evaluations`); empty where it does not."""
    evaluations: dict[fx.Node, int] = {}
    if spec.elementwise_s:
        for gm in graphs:
            evaluations.update(kernel_evaluations(gm.graph if isinstance(gm, fx.GraphModule) else gm))
    return evaluations


def compute_seconds(spec: ClusterSpec, *graphs: fx.GraphModule) -> Callable[[fx.Node], float]:
    """node -> its `node_cost` seconds, elementwise nodes priced by how often `graphs`' fused
    kernels compute them: the scheduler's and `"auto"`'s price of a node, the simulator's too."""
    evaluations = priced_evaluations(spec, *graphs)
    return lambda node: node_cost(node, spec, evaluations=evaluations.get(node)).seconds


GroupSizes = Union[int, sympy.Expr, Mapping[str, Any], None]


def _group_size(node: fx.Node, world_size: GroupSizes) -> Any:
    name, size = collective_group(node)
    if isinstance(world_size, Mapping):
        if name in world_size:
            return world_size[name]
    elif world_size is not None:
        return world_size
    if size:
        return size
    # all_reduce carries no group size: ask the live process group (e.g. a fake one) for it.
    try:
        return process_group_size(name)
    except RuntimeError as e:  # no live process group of that name
        raise ValueError(f"cannot tell the group size of {node.name} (group {name!r} is not a "
                         f"live process group and the node has no {meta_keys.GROUP_SIZE!r} meta); "
                         "pass world_size=") from e


def collective_node_cost(node: fx.Node, spec: ClusterSpec, world_size: GroupSizes = None, *,
                         symbolic: bool = False) -> CollectiveCost:
    """Alpha-beta cost of a _c10d_functional collective node, on its unsharded size.

    world_size overrides the group size: an int (or sympy expression) for every collective,
    or a {group_name: size} mapping (hybrid meshes have two groups). Without it the size
    comes from the node's group_size argument, or, for all_reduce, from its group.
    """
    if not is_collective(node):
        raise ValueError(f"{node.name} ({node.target}) is not a functional collective; "
                         f"known: {sorted(str(t) for t in COLLECTIVES)}")
    kind = collective_kind(node)
    share = exchange_share(node)
    nbytes = value_bytes(_node_val(full_buffer(node)), symbolic)
    nbytes = nbytes * sympy.Rational(share.numerator, share.denominator) if symbolic else int(nbytes * share)
    group = _group_size(node, world_size)
    group = _as_sym(group) if symbolic else _scalar(group, False)
    return CollectiveCost(kind, nbytes, group, wire_bytes(kind, nbytes, group),
                          collective_time(kind, nbytes, group, spec))


# --------------------------------------------------------------------------- fitting


def fit_alpha_beta(samples: Sequence[tuple[int, float]], world_size: int,
                   kind: str = "all_gather") -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) of timings of collectives of `kind` [(bytes, seconds), ...]:
    all-gather's gathered bytes, all-reduce's buffer.

    Least squares on relative error (weights 1/t^2): plain least squares lets the large sizes
    decide everything and can give a negative alpha, the number that matters most here.
    """
    if len(samples) < 2 or len({b for b, _ in samples}) < 2:
        raise ValueError("fit_alpha_beta needs timings at two or more different sizes")
    xs = [wire_bytes(kind, b, world_size) for b, _ in samples]
    ts = [t for _, t in samples]
    ws = [1.0 / t ** 2 for t in ts]
    sw, sx, st = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * t for w, t in zip(ws, ts))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    beta = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    alpha = (st - beta * sx) / sw
    if beta <= 0:
        raise ValueError(f"timings do not grow with size (slope {beta:.3g} s/B); "
                         f"measure larger sizes: {list(samples)}")
    return max(alpha, 0.0), 1.0 / beta
