"""The cost model: alpha-beta collectives, roofline compute, and one two-lane simulator.

Everything that asks "how long does this graph take, how much communication is exposed, how
much memory does it hold" goes through here: the reorder/bucketing pass and `graphshard dump`.
Sizes may be symbolic (sympy) where a formula is wanted ("at world size N"); the simulator
itself works on numbers (symbolic shapes fall back to their hints).

`graphshard calibrate` (main() below) measures this machine's parameters into a JSON file
that ClusterSpec.from_json loads.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import operator
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Mapping, Sequence, Union

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry

from passes.graph_utils import COLLECTIVES, collective_group, collective_kind, is_collective, is_wait

aten = torch.ops.aten
Num = Union[int, float]
Sym = Union[int, float, sympy.Expr]  # a number, or a formula in e.g. sympy.Symbol("N")

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
# An unbacked SymInt has no hint; this is the size Inductor assumes for one too.
_UNBACKED_FALLBACK = 8192
# Ops that only allocate: they read nothing and need not write their output.
_ALLOC_ONLY = frozenset({aten.empty.memory_format, aten.empty_strided.default,
                         aten.new_empty.default, aten.new_empty_strided.default})


# --------------------------------------------------------------------------- machine parameters


@dataclass(frozen=True)
class ClusterSpec:
    """Parameters of one machine class; times in seconds, sizes in bytes."""

    latency_s: float  # alpha: fixed cost of one collective call
    bandwidth_Bps: float  # 1/beta: link bandwidth each rank sends at
    flops_per_s: float  # compute peak
    memory_bandwidth_Bps: float  # for memory-bound ops
    kernel_overhead_s: float = 2e-6  # fixed cost of every compute node (dispatch, launch)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # 0 is a meaningful idealisation for the fixed costs, never for a rate we divide by.
            may_be_zero = f.name in ("latency_s", "kernel_overhead_s")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0 or (value == 0 and not may_be_zero)):
                need = "a finite number >= 0" if may_be_zero else "a finite number > 0"
                raise ValueError(f"ClusterSpec.{f.name} must be {need}, got {value!r}")

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


def _is_plain(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)


def _finish(expr: Any) -> Sym:
    """A formula stays a formula; a formula with no free symbols becomes a float."""
    expr = sympy.sympify(expr)
    return float(expr) if expr.is_number else expr


def _check_world_size(world_size: Any) -> None:
    if _is_plain(world_size) and (world_size < 1 or world_size != int(world_size)):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def wire_bytes(kind: str, nbytes: Sym, world_size: Sym) -> Sym:
    """Bytes each rank sends for a ring collective on an `nbytes` unsharded buffer.

    all_gather / reduce_scatter: (N-1)/N * nbytes; all_reduce (reduce-scatter + all-gather):
    2 (N-1)/N * nbytes. Numbers give a float; sympy expressions give an expression.
    """
    _check_kind(kind)
    nbytes, world_size = _as_sym(nbytes), _as_sym(world_size)
    _check_world_size(world_size)
    factor = 2 if kind == "all_reduce" else 1
    if _is_plain(nbytes, world_size):
        return float(factor * (world_size - 1) * nbytes / world_size)
    n = sympy.sympify(world_size)
    return _finish(factor * (n - 1) * sympy.sympify(nbytes) / n)


def collective_time(kind: str, nbytes: Sym, world_size: Sym, spec: ClusterSpec) -> Sym:
    """alpha + wire_bytes / bandwidth; 0 at world size 1 (no collective runs).

    all_reduce pays alpha once, not 2(N-1) times: alpha here is the measured fixed cost of a
    whole collective call (gloo's per-step latency is folded into it, as for all-gather), and
    an all-reduce is one call. A symbolic world size gives Piecewise((0, N == 1), (..., True)).
    """
    nbytes, world_size = _as_sym(nbytes), _as_sym(world_size)
    wire = wire_bytes(kind, nbytes, world_size)
    if _is_plain(nbytes, world_size):  # fast path: the reorder pass calls this in a loop
        return 0.0 if world_size == 1 else spec.latency_s + wire / spec.bandwidth_Bps
    expr = sympy.Float(spec.latency_s) + sympy.sympify(wire) / sympy.Float(spec.bandwidth_Bps)
    n = sympy.sympify(world_size)
    if not n.is_number:
        expr = sympy.Piecewise((0, sympy.Eq(n, 1)), (expr, True))
    elif n == 1:
        return 0.0
    return _finish(expr)


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


def _aliases_input(node: fx.Node) -> bool:
    """True if the node's output shares storage with an input (views, in-place ops, waits)."""
    if is_wait(node) or node.target is operator.getitem:
        return True
    if node.target is aten._unsafe_view.default:  # a view in practice, though not by schema
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _is_view(node: fx.Node) -> bool:
    """Free ops: metadata-only views (an in-place op also aliases, but does real work)."""
    if node.target is operator.getitem or node.target is aten._unsafe_view.default:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def node_cost(node: fx.Node, spec: ClusterSpec, *, symbolic: bool = False) -> NodeCost:
    """Roofline cost of one compute node: max(flops/peak, bytes/mem_bw) + kernel overhead.

    Zero for placeholders, outputs, get_attr, views, getitem, non-aten calls (SymInt math)
    and collectives/waits (those are collective_node_cost's). FLOPs come from
    torch.utils.flop_counter's registry (matmuls, convolutions, attention and their
    backwards); every other op is memory-bound: bytes = inputs + output.
    """
    if (node.op != "call_function" or is_collective(node) or is_wait(node) or _is_view(node)
            or not isinstance(node.target, torch._ops.OpOverload)):
        return ZERO_COST
    zero = sympy.Integer(0) if symbolic else 0
    flops = zero
    formula = flop_registry.get(node.target.overloadpacket)
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
        return NodeCost(flops, nbytes, _finish(seconds + sympy.Float(spec.kernel_overhead_s)))
    seconds = max(flops / spec.flops_per_s, nbytes / spec.memory_bandwidth_Bps)
    return NodeCost(int(flops), int(nbytes), seconds + spec.kernel_overhead_s)


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
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(name).size()
    except Exception:
        raise ValueError(f"cannot tell the group size of {node.name} (group {name!r} is not a "
                         "live process group and the node has no 'graphshard_group_size' meta); "
                         "pass world_size=") from None


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
    # all-gather's output is the full buffer; reduce-scatter's and all-reduce's input is.
    full = node if kind == "all_gather" else node.args[0]
    nbytes = value_bytes(_node_val(full), symbolic)
    group = _group_size(node, world_size)
    group = _as_sym(group) if symbolic else _scalar(group, False)
    return CollectiveCost(kind, nbytes, group, wire_bytes(kind, nbytes, group),
                          collective_time(kind, nbytes, group, spec))


# --------------------------------------------------------------------------- the simulator


@dataclass(frozen=True)
class Event:
    name: str
    lane: str  # "compute" or "comm"
    start_s: float
    dur_s: float
    kind: str  # "compute", a collective kind, or "wait" (compute blocked on a collective)


@dataclass(frozen=True)
class CollectiveEstimate:
    name: str
    kind: str
    nbytes: int
    group_size: int
    issue_s: float  # when compute reached it in node order
    start_s: float  # when the comm lane was free for it
    dur_s: float
    hidden_s: float  # overlapped with compute
    exposed_s: float  # not overlapped with compute


@dataclass(frozen=True)
class MemoryEstimate:
    placeholder_bytes: int  # graph inputs and constants: live for the whole graph
    peak_transient_bytes: int  # peak of what the graph itself allocates
    peak_bytes: int  # placeholder_bytes + peak_transient_bytes
    peak_node: str | None  # the node at which the transient peak occurs


@dataclass(frozen=True)
class GraphEstimate:
    total_s: float
    compute_s: float  # sum of compute node times
    comm_s: float  # sum of collective times
    exposed_comm_s: float  # total - compute: time compute spent blocked on collectives
    events: tuple[Event, ...]
    collectives: tuple[CollectiveEstimate, ...]
    memory: MemoryEstimate

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.peak_bytes

    def chrome_trace(self) -> dict:
        """chrome://tracing / Perfetto JSON; one thread per lane, zero-length events dropped."""
        tid = {"compute": 0, "comm": 1}
        return {"traceEvents": [
            {"name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": tid[e.lane],
             "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6}
            for e in self.events if e.dur_s > 0]}


def _waited_collective(wait: fx.Node) -> fx.Node | None:
    src = wait.args[0]
    while isinstance(src, fx.Node) and src.target is operator.getitem:
        src = src.args[0]
    return src if isinstance(src, fx.Node) and is_collective(src) else None


def _overlap(busy: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Length of [a, b) covered by the sorted, disjoint `busy` intervals."""
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    covered = 0.0
    while i < len(busy) and busy[i][0] < b:
        covered += max(0.0, min(busy[i][1], b) - max(busy[i][0], a))
        i += 1
    return covered


def _graph(gm: fx.GraphModule | fx.Graph) -> fx.Graph:
    return gm.graph if isinstance(gm, fx.GraphModule) else gm


def graph_estimate(gm: fx.GraphModule | fx.Graph, spec: ClusterSpec,
                   world_size: GroupSizes = None) -> GraphEstimate:
    """Simulate the graph on two lanes, in node order, deterministically.

    Compute nodes run back to back on the compute lane. A collective is issued when compute
    reaches it and starts once the comm lane is free (one collective at a time, as on one
    gloo/NCCL stream). A wait_tensor blocks compute until its collective ends.
    """
    if not (world_size is None or isinstance(world_size, Mapping) or _is_plain(world_size)):
        raise ValueError(f"graph_estimate simulates numbers: world_size must be an int, a "
                         f"{{group_name: int}} mapping or None, got {world_size!r}")
    compute_t = comm_free = 0.0
    events: list[Event] = []
    issued: dict[fx.Node, tuple[CollectiveCost, float, float]] = {}
    for node in _graph(gm).nodes:
        if node.op != "call_function":
            continue
        if is_collective(node):
            cost = collective_node_cost(node, spec, world_size)
            start = max(compute_t, comm_free)
            comm_free = start + cost.seconds
            issued[node] = (cost, compute_t, start)
            events.append(Event(node.name, "comm", start, cost.seconds, cost.kind))
        elif is_wait(node):
            coll = _waited_collective(node)
            if coll is not None and coll in issued:
                cost, _, start = issued[coll]
                end = start + cost.seconds
                if end > compute_t:
                    events.append(Event(node.name, "compute", compute_t, end - compute_t, "wait"))
                    compute_t = end
        else:
            seconds = node_cost(node, spec).seconds
            events.append(Event(node.name, "compute", compute_t, seconds, "compute"))
            compute_t += seconds

    busy = [(e.start_s, e.start_s + e.dur_s) for e in events
            if e.lane == "compute" and e.kind == "compute" and e.dur_s > 0]
    starts = [b[0] for b in busy]
    collectives = []
    for node, (cost, issue, start) in issued.items():
        hidden = _overlap(busy, starts, start, start + cost.seconds)
        collectives.append(CollectiveEstimate(
            node.name, cost.kind, int(cost.nbytes), int(cost.group_size), issue, start,
            cost.seconds, hidden, max(cost.seconds - hidden, 0.0)))
    compute_s = sum(e.dur_s for e in events if e.kind == "compute")
    total = max(compute_t, comm_free)
    return GraphEstimate(total, compute_s, sum(c.dur_s for c in collectives),
                         max(total - compute_s, 0.0), tuple(events), tuple(collectives),
                         memory_estimate(gm))


def memory_estimate(gm: fx.GraphModule | fx.Graph) -> MemoryEstimate:
    """Liveness walk in node order over buffers (storages), not nodes.

    A node that allocates gets one buffer per tensor it returns; a view, an in-place op or a
    wait shares its input's buffers; getitem picks one output's buffer. A buffer is freed
    after the last node that uses anything sharing it (outputs stay to the end). Inputs and
    constants (placeholder, get_attr) are held by the caller: live throughout, never freed.
    """
    nodes = list(_graph(gm).nodes)
    sizes: list[int] = []
    owned: dict[fx.Node, tuple[int, ...]] = {}  # buffers a node's value keeps alive
    per_output: dict[fx.Node, list[tuple[int, ...]]] = {}  # multi-output allocations
    placeholder_bytes = 0

    def new_buffers(val: Any) -> tuple[int, ...]:
        tensors = [v for v in (val if isinstance(val, (tuple, list)) else [val])
                   if isinstance(v, torch.Tensor)]
        sizes.extend(int(value_bytes(t)) for t in tensors)
        return tuple(range(len(sizes) - len(tensors), len(sizes)))

    for node in nodes:
        val = node.meta.get("val")
        if node.op == "get_attr" and val is None and isinstance(gm, fx.GraphModule):
            val = getattr(gm, str(node.target), None)
        if node.op in ("placeholder", "get_attr"):
            owned[node] = new_buffers(val)
            placeholder_bytes += sum(sizes[b] for b in owned[node])
        elif node.op == "call_function" and _aliases_input(node):
            src = node.args[0] if node.args else None
            if node.target is operator.getitem and src in per_output:
                owned[node] = per_output[src][node.args[1]]
            else:
                owned[node] = owned.get(src, ()) if isinstance(src, fx.Node) else ()
        elif node.op in ("call_function", "call_module", "call_method"):
            if isinstance(val, (tuple, list)):
                per_output[node] = [new_buffers(v) for v in val]
                owned[node] = tuple(b for bufs in per_output[node] for b in bufs)
            else:
                owned[node] = new_buffers(val)
    inputs = {b for n in nodes if n.op in ("placeholder", "get_attr") for b in owned[n]}

    index = {n: i for i, n in enumerate(nodes)}
    born: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for node in nodes:
        for b in owned.get(node, ()):
            born.setdefault(b, index[node])
            last_use[b] = max(last_use.get(b, 0), index[node])
        for user_input in node.all_input_nodes:
            for b in owned.get(user_input, ()):
                last_use[b] = max(last_use[b], index[node])
        if is_collective(node):
            # A collective reads its input until it completes: the buffer is held to the wait.
            done = max((index[u] for u in node.users if is_wait(u)), default=index[node])
            for user_input in node.all_input_nodes:
                for b in owned.get(user_input, ()):
                    last_use[b] = max(last_use[b], done)

    frees: dict[int, list[int]] = {}
    for b, i in last_use.items():
        frees.setdefault(i, []).append(b)
    born_at: dict[int, list[int]] = {}
    for b, i in born.items():
        born_at.setdefault(i, []).append(b)
    live = peak = 0
    peak_node = None
    for i, node in enumerate(nodes):
        live += sum(sizes[b] for b in born_at.get(i, ()) if b not in inputs)
        if live > peak:
            peak, peak_node = live, node.name
        live -= sum(sizes[b] for b in frees.get(i, ()) if b not in inputs)
    return MemoryEstimate(placeholder_bytes, peak, placeholder_bytes + peak, peak_node)


# --------------------------------------------------------------------------- theory


def theoretical_comm_bytes(strategy: str, param_bytes: Sym, world_size: Sym, *,
                           trainable_bytes: Sym | None = None,
                           shard_size: Sym | None = None) -> dict[str, Sym]:
    """Bytes each rank sends per training step under a data-parallel strategy.

    full_shard: all-gather params twice (forward, and backward recompute), reduce-scatter
    grads once; shard_grad_op: gather once; no_shard: all-reduce grads; hybrid_shard: FSDP
    inside shard groups of `shard_size`, all-reduce of the grad shards across the
    world_size/shard_size replicas. Gathers move all params; reductions only the trainable
    ones (`trainable_bytes`, default all). Numbers give floats; sympy symbols give formulas.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    _check_world_size(world_size)
    p = sympy.sympify(param_bytes)
    t = p if trainable_bytes is None else sympy.sympify(trainable_bytes)
    n = sympy.sympify(world_size)
    ag = rs = ar = sympy.Integer(0)
    if strategy == "full_shard":
        ag, rs = 2 * p * (n - 1) / n, t * (n - 1) / n
    elif strategy == "shard_grad_op":
        ag, rs = p * (n - 1) / n, t * (n - 1) / n
    elif strategy == "no_shard":
        ar = 2 * t * (n - 1) / n
    else:
        if shard_size is None:
            raise ValueError("hybrid_shard needs shard_size (the size of each shard group)")
        s = sympy.sympify(shard_size)
        if s.is_number and n.is_number and (s < 1 or n % s != 0):
            raise ValueError(f"shard_size {shard_size} must be >= 1 and divide "
                             f"world_size {world_size}")
        r = n / s
        ag, rs, ar = 2 * p * (s - 1) / s, t * (s - 1) / s, 2 * (r - 1) / r * t / s
    out = {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar, "total": ag + rs + ar}
    return {k: _finish(sympy.simplify(v)) for k, v in out.items()}


# --------------------------------------------------------------------------- calibration


def fit_alpha_beta(samples: Sequence[tuple[int, float]], world_size: int) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) of all-gather timings [(gathered bytes, seconds), ...].

    Least squares on relative error (weights 1/t^2): plain least squares lets the large sizes
    decide everything and can give a negative alpha, the number that matters most here.
    """
    if len(samples) < 2 or len({b for b, _ in samples}) < 2:
        raise ValueError("fit_alpha_beta needs timings at two or more different sizes")
    xs = [wire_bytes("all_gather", b, world_size) for b, _ in samples]
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_time(fn: Any, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _allgather_worker(rank: int, world_size: int, port: int, sizes: Sequence[int],
                      repeats: int, out_path: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the cores; the collective is what we time
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        samples = []
        for size in sizes:
            shard = torch.ones(max(size // (4 * world_size), 1))
            full = torch.empty(shard.numel() * world_size)

            def once() -> None:
                dist.barrier()  # start together, so the timing is the collective alone
                start = time.perf_counter()
                dist.all_gather_single(full, shard)
                times.append(time.perf_counter() - start)

            times: list[float] = []
            for _ in range(3):
                once()
            times.clear()
            for _ in range(repeats):
                once()
            samples.append((full.numel() * 4, statistics.median(times)))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(samples, f)
    finally:
        dist.destroy_process_group()


def measure_all_gather(world_size: int = 2, sizes: Iterable[int] = (),
                       repeats: int = 10) -> list[tuple[int, float]]:
    """[(gathered bytes, median seconds)] of gloo all-gathers on `world_size` local processes."""
    import torch.multiprocessing as mp
    if world_size < 2:
        raise ValueError(f"calibration needs world_size >= 2, got {world_size}")
    sizes = list(sizes) or [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "samples.json")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mp.spawn(_allgather_worker, args=(world_size, _free_port(), sizes, repeats, out_path),
                     nprocs=world_size, join=True)
        with open(out_path) as f:
            return [(int(b), float(t)) for b, t in json.load(f)]


def measure_compute(repeats: int = 10) -> dict[str, float]:
    """flops_per_s (1024^2 fp32 matmul), memory_bandwidth_Bps (64 MiB copy), kernel_overhead_s."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src = torch.empty(16 << 20)
    dst = torch.empty_like(src)
    tiny = torch.ones(4)
    return {
        "flops_per_s": 2 * 1024 ** 3 / _median_time(lambda: a @ b, repeats),
        "memory_bandwidth_Bps": 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src),
                                                                    repeats),
        "kernel_overhead_s": _median_time(lambda: torch.add(tiny, tiny), 20 * repeats),
    }


def calibrate(world_size: int = 2, sizes: Iterable[int] = (), repeats: int = 10,
              samples: list | None = None) -> ClusterSpec:
    """Measure this machine. `samples`, if a list, receives the all-gather timings."""
    measured = measure_all_gather(world_size, sizes, repeats)
    if samples is not None:
        samples.extend(measured)
    alpha, bandwidth = fit_alpha_beta(measured, world_size)
    return ClusterSpec(latency_s=alpha, bandwidth_Bps=bandwidth, **measure_compute(repeats))


def main(argv: Sequence[str] | None = None) -> int:
    from tabulate import tabulate
    parser = argparse.ArgumentParser(prog="graphshard calibrate",
                                     description="measure this machine's cost-model parameters")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="write the ClusterSpec JSON here")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.world_size < 2 or args.repeats < 1:
        parser.error("--world-size must be >= 2 and --repeats >= 1")
    samples: list[tuple[int, float]] = []
    spec = calibrate(args.world_size, repeats=args.repeats, samples=samples)
    print(tabulate([(b, t * 1e3, collective_time("all_gather", b, args.world_size, spec) * 1e3)
                    for b, t in samples],
                   headers=["all_gather bytes", "measured ms", "model ms"], floatfmt=".3f"))
    print()
    print(tabulate([(k, f"{v:.4g}") for k, v in dataclasses.asdict(spec).items()],
                   headers=["parameter", "value"]))
    if args.out:
        spec.to_json(args.out)
        print(f"\nwrote {args.out}")
    return 0
