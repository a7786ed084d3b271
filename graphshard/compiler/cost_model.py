"""The cost model: what one collective or one compute node costs, in seconds and bytes.

Alpha-beta collectives and roofline compute, on the parameters of a machine (ClusterSpec).
Sizes may be symbolic (sympy) where a formula is wanted ("at world size N"). The scheduler
(passes/reorder_collectives.py) and `graphshard dump` both price graphs with it; what a whole
graph does over time is graphshard/simulator.py's, its memory passes/liveness.py's, and
measuring a machine graphshard/calibrate.py's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from graphshard._torch_compat import is_op_overload, process_group_size
from graphshard.compiler.elementwise_cost import elementwise_seconds, kernel_evaluations
from graphshard.passes import meta_keys
from graphshard.passes.graph_utils import (COLLECTIVES, FREE_STORAGE, collective_group, collective_kind,
                                          exchange_share, full_buffer, is_collective, is_view,
                                          is_wait)

aten = torch.ops.aten
Sym = Union[int, float, sympy.Expr]  # a number, or a formula in e.g. sympy.Symbol("N")

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# An unbacked SymInt has no hint; this is the size Inductor assumes for one too.
_UNBACKED_FALLBACK = 8192
# Ops that only allocate: they read nothing and need not write their output.
_ALLOC_ONLY = frozenset({aten.empty.memory_format, aten.empty_strided.default,
                         aten.new_empty.default, aten.new_empty_strided.default})


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------- machine parameters


@dataclass(frozen=True)
class ClusterSpec:
    """Parameters of one machine class; times in seconds, sizes in bytes.

    latency_s and bandwidth_Bps describe a collective among devices of one node; a collective
    whose group spans nodes pays the inter-node ones (`link`). Optional fields describe what
    the planner needs beyond one node: None means "as within a node" / unknown.
    """

    latency_s: float  # alpha: fixed cost of one collective call
    bandwidth_Bps: float  # 1/beta: link bandwidth each rank sends at
    flops_per_s: float  # compute peak (fp32)
    memory_bandwidth_Bps: float  # for memory-bound ops
    kernel_overhead_s: float = 2e-6  # fixed cost of every compute node (dispatch, launch)
    low_precision_flops_per_s: float | None = None  # bf16/fp16 matmul peak (None: flops_per_s)
    float8_flops_per_s: float | None = None  # float8 matmul peak (None: the bf16/fp16 one)
    devices_per_node: int | None = None  # None: every device in one node
    inter_node_latency_s: float | None = None
    inter_node_bandwidth_Bps: float | None = None  # per device, between nodes
    device_memory_bytes: float | None = None  # what one device holds (the planner's limit)
    # Host time of one forward+backward beyond its kernels (Dynamo guards, autograd, hooks,
    # runtime wrappers): hidden behind a GPU's queue, paid in full where the host computes.
    step_overhead_s: float = 0.0
    # Whether a collective runs beside compute. False where the ranks' compute already fills
    # every core, so the collective library's threads take turns with it (gloo on this CPU).
    comm_overlaps_compute: bool = True
    # The process group backend: on "gloo" graphshard runs all-gather and reduce-scatter as
    # all-to-all (GraphshardOptions.via_all_to_all), whose buffers the planner then counts.
    collective_backend: str = "nccl"
    # How many ranks of one node compute at full speed at once: None where each rank has a device
    # of its own (GPUs); on a CPU, its cores / the threads each rank uses. More ranks than that
    # share the compute (`shared_by`).
    compute_slots_per_node: int | None = None
    # all-reduce's alpha and bandwidth where they differ from the all-gather's (gloo runs its
    # own algorithm for it); None: the all-gather's, on all-reduce's twice the wire bytes.
    all_reduce_latency_s: float | None = None
    all_reduce_bandwidth_Bps: float | None = None
    # Ranks drift apart while they compute (OS jitter, cores shared with the collective
    # library), so a collective starts when the slowest rank reaches it: the expected wait
    # after 1 ms of compute since the ranks last met in a collective. It grows as the square
    # root of that compute (a random walk; `calibrate` fits it on three compute lengths).
    skew_after_1ms_s: float = 0.0
    # The same where the ranks outnumber the node's compute slots and take turns on its cores
    # (a rank off its core holds up every other at the next collective); None: as above.
    shared_core_skew_after_1ms_s: float | None = None
    # Attention kernels' FLOP rates where they are not the matmuls' (a CPU's fused attention
    # runs below its matmul peak, the more so the less work per head and in bf16): rows of
    # (sequence x head_dim, fp32 FLOP/s, bf16/fp16 FLOP/s), interpolated in between; empty:
    # the matmul peak of the precision.
    attention_flops: tuple[tuple[float, float, float], ...] = ()
    # Seconds one evaluation of an elementwise op takes in a fused kernel, by op family
    # (elementwise_cost.FAMILIES, and "arith" for the rest): rows of (family, seconds). Where a
    # family has a row, an elementwise node costs at least its evaluations at that rate
    # (elementwise_cost.kernel_evaluations); empty: the roofline alone.
    elementwise_s: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        from graphshard.compiler.elementwise_cost import ARITH, FAMILIES

        known = (*FAMILIES, ARITH)
        try:
            rows = tuple(sorted((str(name), float(s)) for name, s in self.elementwise_s))
        except (TypeError, ValueError):
            rows = (("", -1.0),)
        if any(name not in known or not (math.isfinite(s) and s > 0) for name, s in rows):
            raise ValueError(f"ClusterSpec.elementwise_s must be rows of (family, seconds > 0) "
                             f"with a family of {known}, got {self.elementwise_s!r}")
        object.__setattr__(self, "elementwise_s", rows)
        rows = tuple(tuple(float(v) for v in row) for row in self.attention_flops)
        if any(len(row) != 3 or min(row) <= 0 or not all(map(math.isfinite, row)) for row in rows):
            raise ValueError("ClusterSpec.attention_flops must be rows of (sequence x head_dim, "
                             f"fp32 FLOP/s, bf16 FLOP/s), all > 0, got {self.attention_flops!r}")
        object.__setattr__(self, "attention_flops", tuple(sorted(rows)))
        if not isinstance(self.comm_overlaps_compute, bool):
            raise ValueError(f"ClusterSpec.comm_overlaps_compute must be a bool, got "
                             f"{self.comm_overlaps_compute!r}")
        if self.collective_backend not in ("nccl", "gloo"):
            raise ValueError(f"ClusterSpec.collective_backend must be 'nccl' or 'gloo', got "
                             f"{self.collective_backend!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (f.name in ("comm_overlaps_compute", "collective_backend", "attention_flops",
                           "elementwise_s")
                    or (value is None and f.default is None)):
                continue
            # 0 is a meaningful idealisation for the fixed costs, never for a rate we divide by.
            may_be_zero = f.name in ("latency_s", "kernel_overhead_s", "inter_node_latency_s",
                                     "step_overhead_s", "all_reduce_latency_s", "skew_after_1ms_s",
                                     "shared_core_skew_after_1ms_s")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0 or (value == 0 and not may_be_zero)):
                need = "a finite number >= 0" if may_be_zero else "a finite number > 0"
                raise ValueError(f"ClusterSpec.{f.name} must be {need}, got {value!r}")

    def link(self, spans_nodes: bool) -> "ClusterSpec":
        """This spec as a collective sees it: between nodes, the inter-node latency/bandwidth."""
        if not spans_nodes or self.inter_node_bandwidth_Bps is None:
            return self
        latency = self.latency_s if self.inter_node_latency_s is None else self.inter_node_latency_s
        return dataclasses.replace(self, latency_s=latency, bandwidth_Bps=self.inter_node_bandwidth_Bps,
                                   all_reduce_latency_s=None, all_reduce_bandwidth_Bps=None)

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency_s, bandwidth_Bps) of a collective of `kind`."""
        if kind == "all_reduce" and self.all_reduce_bandwidth_Bps is not None:
            latency = self.latency_s if self.all_reduce_latency_s is None else self.all_reduce_latency_s
            return latency, self.all_reduce_bandwidth_Bps
        return self.latency_s, self.bandwidth_Bps

    def skew_wait_s(self, compute_s: float) -> float:
        """The expected wait for the slowest rank at a collective after `compute_s` seconds of
        compute since the ranks last met."""
        return self.skew_after_1ms_s * math.sqrt(max(compute_s, 0.0) / 1e-3)

    def shared_by(self, ranks_per_node: int) -> "ClusterSpec":
        """This spec as each of `ranks_per_node` ranks on one node sees it: where they outnumber
        the node's compute slots (CPU cores), they take turns on them, so everything a rank
        does there runs proportionally slower (3 ranks on 2 cores: 1.5x): compute, memory
        traffic, host overhead, and the collectives within the node, which on a CPU are copies
        the same cores make; and the ranks drift apart by the shared cores' skew."""
        slots = self.compute_slots_per_node
        if slots is None or ranks_per_node <= slots:
            return self
        share = ranks_per_node / slots
        low, float8 = self.low_precision_flops_per_s, self.float8_flops_per_s
        ar_latency, ar_bandwidth = self.all_reduce_latency_s, self.all_reduce_bandwidth_Bps
        return dataclasses.replace(
            self, flops_per_s=self.flops_per_s / share,
            low_precision_flops_per_s=None if low is None else low / share,
            float8_flops_per_s=None if float8 is None else float8 / share,
            attention_flops=tuple((size, fp32 / share, low / share)
                                  for size, fp32, low in self.attention_flops),
            all_reduce_latency_s=None if ar_latency is None else ar_latency * share,
            all_reduce_bandwidth_Bps=None if ar_bandwidth is None else ar_bandwidth / share,
            skew_after_1ms_s=(self.skew_after_1ms_s if self.shared_core_skew_after_1ms_s is None
                              else self.shared_core_skew_after_1ms_s),
            memory_bandwidth_Bps=self.memory_bandwidth_Bps / share,
            elementwise_s=tuple((name, seconds * share) for name, seconds in self.elementwise_s),
            latency_s=self.latency_s * share, bandwidth_Bps=self.bandwidth_Bps / share,
            kernel_overhead_s=self.kernel_overhead_s * share,
            step_overhead_s=self.step_overhead_s * share)

    def peak_flops(self, dtype: torch.dtype | None, attention_size: float | None = None) -> float:
        """The matmul peak for operands of `dtype` (float8: the float8 peak where the
        machine has one, else the bf16 one); for an attention kernel of `attention_size`
        (sequence x head_dim), the attention rate where the machine has one."""
        low_precision = dtype in (torch.bfloat16, torch.float16, *FLOAT8_DTYPES)
        if attention_size is not None and self.attention_flops:
            return self._attention_rate(attention_size, 2 if low_precision else 1)
        if dtype in FLOAT8_DTYPES and self.float8_flops_per_s:
            return self.float8_flops_per_s
        low = low_precision and self.low_precision_flops_per_s
        return self.low_precision_flops_per_s if low else self.flops_per_s

    def _attention_rate(self, size: float, column: int) -> float:
        """attention_flops' rate at `size`, linear in log(size) between rows, the end rows'
        beyond them."""
        rows = self.attention_flops
        if size <= rows[0][0]:
            return rows[0][column]
        for low, high in zip(rows, rows[1:]):
            if size <= high[0]:
                t = math.log(size / low[0]) / math.log(high[0] / low[0])
                return low[column] + t * (high[column] - low[column])
        return rows[-1][column]

    @classmethod
    def default(cls) -> "ClusterSpec":
        """This machine class: gloo on 2 CPU cores, world size 2.

        alpha/beta are fitted exactly through two measured all-gathers (1 KiB: 0.36 ms,
        4 MiB: 3 ms); compute is a 1024x1024 fp32 matmul (1.3e11-3e11 FLOP/s measured, rounded
        down because the model's smaller matmuls run slower) and a 64 MiB copy (~2.7e10 B/s).
        """
        alpha, bandwidth = fit_alpha_beta([(1024, 0.36e-3), (4 << 20, 3e-3)], world_size=2)
        return cls(latency_s=alpha, bandwidth_Bps=bandwidth, flops_per_s=1e11,
                   memory_bandwidth_Bps=2e10, kernel_overhead_s=2e-6)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(dataclasses.asdict(self), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ClusterSpec":
        """From a dict, a JSON file path, or JSON text (a string starting with '{')."""
        if isinstance(source, Mapping):
            data = dict(source)
        elif isinstance(source, str) and source.lstrip().startswith("{"):
            data = json.loads(source)
        else:
            with open(source) as f:
                data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"ClusterSpec JSON must be an object, got {type(data).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"unknown ClusterSpec key(s) {unknown}; valid keys: {valid}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"ClusterSpec JSON is missing {missing}; valid keys: {valid}")
        return cls(**data)


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
        return x.node.expr if symbolic else optimization_hint(x, fallback=_UNBACKED_FALLBACK)
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


def compute_seconds(spec: ClusterSpec, *graphs: fx.GraphModule) -> Callable[[fx.Node], float]:
    """node -> its `node_cost` seconds, elementwise nodes priced by how often `graphs`' fused
    kernels compute them: how the scheduler, `"auto"` and the simulator all price a node."""
    evaluations: dict[fx.Node, int] = {}
    if spec.elementwise_s:
        for gm in graphs:
            evaluations.update(kernel_evaluations(gm.graph))
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
