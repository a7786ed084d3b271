"""Bucket per-parameter collectives into one collective per unit (a repeated block).

Units come from the graph itself: each collective names its parameters, and a parameter's unit
is its repeated block (`layers.3.*` -> `layers.3`: passes/units.py); consecutive collectives
outside repeated blocks (embeddings before, norm and head after) share one bucket run, as
FSDP2's root group holds them together: the leftover units. Within a unit,
collectives of the same kind, process group and dtype become one collective on one flat buffer,
packed in parameter registration order (FSDP2's copy-in / copy-out layout):

    all-gather:      cat(flat shards) -> all_gather -> wait -> view (N, S) -> split_copy columns
    reduce-scatter:  per-param (N, n_i) views -> cat(dim=1) -> reduce_scatter -> wait -> split views
    all-reduce:      cat(flat grads) -> all_reduce -> wait -> split views
                     (no_shard: graphshard::concat, see below)
                     (hybrid: a reduce-scatter bucket's output, whole, instead of the cat)

(split_copy: graphshard/compiler/ops.py, one call per bucket that Inductor does not generate a
kernel for.) A gathered parameter is a strided column block of its bucket, so it is copied out; a
reduced gradient is a contiguous row slice, so it stays a view: the gradients of a bucket are
produced together and live until the optimizer has used them, so sharing the bucket's storage
keeps nothing alive longer and saves a copy of every gradient (FSDP2 views its reduce-scatter
output the same way).

A size cap (bucket_mb, unsharded bytes) splits large units; different dtypes never share one
(nor float8 gathers, sent as uint8, with other bytes), nor all-reduces of different reduce ops
(a float8 scale's MAX, a gradient's sum).

Gradients all-reduced whole (no_shard: the graph reduce-scatters nothing) share buckets across
units, as DDP's do: every gradient is held until the optimizer step anyway, so a bucket that
spans units keeps nothing alive longer, and each collective saves its latency and the ranks'
meeting. Such a bucket closes at the cap in the order backward produces the gradients, and
ATen packs it (`graphshard::concat`) where it is issued: as a fused concatenation, Inductor
would allocate it with its first gradient, at the activations' peak. The cap for these is also
at most a quarter of the graph's gradient bytes (never under 1 MiB, DDP's first bucket): one
bucket holding every gradient is issued after backward's last one and overlaps nothing, while
with four or more only the last, at most a quarter of the traffic, is left to wait for.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.fx as fx

from graphshard.passes import meta_keys
from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    GraphEmitter,
    aten,
    collective_group,
    collective_kind,
    collective_params,
    depends_only_on_inputs,
    fake_mode_of,
    hoist_before,
    is_graphshard_collective,
    node_order,
    finalize_graph,
    stable_topological_sort,
    unsharded_bytes,
    wait_of,
)
from graphshard.passes.pack_graph_inputs import CONCAT
from graphshard.passes.units import block_of


@dataclass
class Bucket:
    kind: str
    unit: str
    members: list[fx.Node] = field(default_factory=list)  # collectives, packing order

    @property
    def nbytes(self) -> int:
        return sum(unsharded_bytes(m) for m in self.members)


STEP_BUCKETS = "<step>"  # the unit label of gradient all-reduce buckets that span units
SPANNING_BUCKETS_AT_LEAST = 4  # buckets spanning units: the cap is at most 1/4 of the bytes
SMALLEST_SPANNING_CAP = 2**20  # ... but never under DDP's first bucket (1 MiB)


def _unit_label(node: fx.Node) -> str | None:
    params = collective_params(node)
    return block_of(params[0]) if params else None


def _all_reduces_whole_gradients(collectives: list[fx.Node]) -> bool:
    """No_shard's backward graphs: gradients are summed by all-reduce and nothing is
    reduce-scattered (hybrid sharding's all-reduces read a unit's reduce-scatter bucket whole,
    per unit). The caller takes only sum all-reduces: a forward's float8 scales take the MAX."""
    return not any(collective_kind(node) == "reduce_scatter" for node in collectives)


def plan_buckets(gm: fx.GraphModule, cap_bytes: float,
                 param_order: Mapping[str, int] | None = None) -> list[Bucket]:
    """Group the graph's collectives into buckets (pure planning, no graph change)."""
    param_order = param_order or {}
    order = node_order(gm.graph)
    collectives = [n for n in gm.graph.nodes if is_graphshard_collective(n)]
    spanning = _all_reduces_whole_gradients(collectives)
    # Runs of consecutive collectives of one kind in the same unit (a collective of that kind
    # from another unit closes them), split by process group and dtype. Runs of collectives
    # outside repeated blocks are leftover units ("<other 1>", "<other 2>", ...).
    runs: list[Bucket] = []
    unit_of_kind: dict[str, str | None] = {}
    open_runs: dict[str, dict[tuple, Bucket]] = {}
    label_of_kind: dict[str, str] = {}
    leftovers = 0
    for node in collectives:
        kind = collective_kind(node)
        unit = _unit_label(node)
        if spanning and kind == "all_reduce" and _reduce_op(node) == "sum":
            unit = STEP_BUCKETS
        if kind not in unit_of_kind or unit_of_kind[kind] != unit:
            if unit is None:
                leftovers += 1
            unit_of_kind[kind] = unit
            label_of_kind[kind] = unit if unit is not None else f"<other {leftovers}>"
            open_runs[kind] = {}
        key = (collective_group(node)[0], node.args[0].meta["val"].dtype,
               node.meta.get(meta_keys.PAYLOAD_DTYPE), _reduce_op(node))
        if key not in open_runs[kind]:
            open_runs[kind][key] = Bucket(kind, label_of_kind[kind])
            runs.append(open_runs[kind][key])
        open_runs[kind][key].members.append(node)

    def packing_key(node: fx.Node):
        params = collective_params(node)
        return (min((param_order.get(p, math.inf) for p in params), default=math.inf), order[node])

    buckets: list[Bucket] = []
    for run in runs:
        # a unit's bucket is cut in packing order; one spanning units, as gradients come
        spanning_run = run.unit == STEP_BUCKETS
        cut_key = order.__getitem__ if spanning_run else packing_key
        members = sorted(run.members, key=cut_key)
        cap = _spanning_cap(cap_bytes, run.nbytes) if spanning_run else cap_bytes
        current, filled = Bucket(run.kind, run.unit), 0
        for member in members:
            size = unsharded_bytes(member)
            if current.members and cap and filled + size > cap:
                buckets.append(current)
                current, filled = Bucket(run.kind, run.unit), 0
            current.members.append(member)
            filled += size
        buckets.append(current)
    for bucket in buckets:
        bucket.members.sort(key=packing_key)
    return buckets


def _spanning_cap(cap_bytes: float, run_bytes: int) -> float:
    """The cap of gradient buckets that span units (see the module docstring): small enough
    that backward's last bucket is not all of the traffic, large enough to cost few meetings."""
    return min(cap_bytes, max(SMALLEST_SPANNING_CAP, run_bytes / SPANNING_BUCKETS_AT_LEAST))


def _reduce_op(node: fx.Node) -> str | None:
    # A float8 scale's all-reduce takes the MAX, a gradient's the sum: never one bucket.
    return node.args[1] if node.target in (ALL_REDUCE, REDUCE_SCATTER) else None


def _bucket_meta(bucket: Bucket) -> dict:
    first = bucket.members[0]
    meta = {key: first.meta[key] for key in ("nn_module_stack", "stack_trace") if key in first.meta}
    meta[meta_keys.PARAMS] = tuple(p for m in bucket.members for p in collective_params(m))
    meta[meta_keys.ROLE] = first.meta.get(meta_keys.ROLE)
    meta[meta_keys.BUCKET] = bucket.unit
    if meta_keys.PAYLOAD_DTYPE in first.meta:  # one per bucket: it is part of the bucket's key
        meta[meta_keys.PAYLOAD_DTYPE] = first.meta[meta_keys.PAYLOAD_DTYPE]
    return meta


def _rewrite_all_gather(gm: fx.GraphModule, bucket: Bucket, fake_mode) -> None:
    members = bucket.members
    first = min(members)  # fx.Node compares by graph position
    for member in members:
        hoist_before(first, member.args[0])
    _, group_size = collective_group(first)
    group_name = first.args[2]
    emit = GraphEmitter(gm.graph, fake_mode, _bucket_meta(bucket))
    with gm.graph.inserting_before(first):
        shards = [m.args[0] for m in members]
        numels = [s.meta["val"].numel() for s in shards]
        flat = emit(aten.cat.default, [emit(aten.reshape.default, s, [-1]) for s in shards])
        gathered = emit(WAIT, emit(ALL_GATHER, flat, group_size, group_name))
        rows = emit(aten.view.default, gathered, [group_size, sum(numels)])
        # (N, n_i) columns -> (N * rows_i, *rest): the per-parameter gathered layout
        outputs = _copy_out(emit, rows, members, numels)
    _replace_members(gm, members, outputs)


def _copy_out(emit, rows, members: list[fx.Node], numels: list[int]) -> list[fx.Node]:
    """Each member's column block of a gathered (N, S) bucket, copied out in its shape."""
    pieces = emit(torch.ops.graphshard.split_copy.default, [rows], numels)  # compiler/ops.py
    return _shaped(emit, pieces, members)


def _views_out(emit, flat, members: list[fx.Node], numels: list[int]) -> list[fx.Node]:
    """Each member's slice of a reduced flat bucket, as a view in its shape."""
    return _shaped(emit, emit(aten.split_with_sizes.default, flat, numels), members)


def _shaped(emit, pieces: fx.Node, members: list[fx.Node]) -> list[fx.Node]:
    return [emit(aten.view.default, emit(operator.getitem, pieces, index),
                 list(member.meta["val"].shape))
            for index, member in enumerate(members)]


def _split_source(pieces: list[fx.Node]) -> fx.Node | None:
    """The flat tensor that `pieces` are all the `_views_out` views of, in order, else None."""
    sources = []
    for index, piece in enumerate(pieces):
        item = piece.args[0] if piece.target is aten.view.default else None
        if item is None or item.target is not operator.getitem or item.args[1] != index:
            return None
        sources.append(item.args[0])
    split = sources[0]
    if (any(source is not split for source in sources)
            or split.target is not aten.split_with_sizes.default or len(split.args[1]) != len(pieces)):
        return None
    return split.args[0]


def _replace_members(gm: fx.GraphModule, members: list[fx.Node], outputs: list[fx.Node]) -> None:
    """Point each member collective's users at the bucket's output; drop the member."""
    for member, out in zip(members, outputs):
        waited = wait_of(member)
        waited.replace_all_uses_with(out)
        gm.graph.erase_node(waited)
        gm.graph.erase_node(member)


def _rewrite_reduce(gm: fx.GraphModule, bucket: Bucket, fake_mode) -> None:
    members = bucket.members
    last_input = max(m.args[0] for m in members)
    first = members[0]
    group_name, group_size = collective_group(first)
    emit = GraphEmitter(gm.graph, fake_mode, _bucket_meta(bucket))
    is_scatter = first.target is REDUCE_SCATTER
    with gm.graph.inserting_after(last_input):
        inputs = [m.args[0] for m in members]
        if is_scatter:
            # each input is (N * rows_i, ...): rank r's share is row block r -> columns of (N, S)
            views = [emit(aten.reshape.default, x, [group_size, -1]) for x in inputs]
            numels = [v.meta["val"].shape[1] for v in views]
            flat = emit(aten.reshape.default, emit(aten.cat.default, views, 1), [-1])
            reduced = emit(WAIT, emit(REDUCE_SCATTER, flat, "sum", group_size, group_name))
        else:
            numels = [x.meta["val"].numel() for x in inputs]
            # Hybrid sharding: the replicas' all-reduce of a reduce-scatter bucket's gradients
            # reads that bucket whole (no concatenation copying it back together).
            pack = CONCAT if bucket.unit == STEP_BUCKETS else aten.cat.default
            flat = _split_source(inputs) or emit(
                pack, [emit(aten.reshape.default, x, [-1]) for x in inputs])
            reduced = emit(WAIT, emit(ALL_REDUCE, flat, _reduce_op(first), group_name))
            reduced.args[0].meta[meta_keys.GROUP_SIZE] = group_size
        outputs = _views_out(emit, reduced, members, numels)
    _replace_members(gm, members, outputs)


def bucket_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Merge each bucket's collectives into one (see module docstring); options.bucket_mb caps
    a bucket's unsharded size (0: no bucketing)."""
    cap_mb = ctx.options.bucket_mb
    if not cap_mb:
        return gm
    param_order = ctx.param_order
    fake_mode = fake_mode_of(gm)
    for bucket in plan_buckets(gm, cap_mb * 2**20, param_order):
        if len(bucket.members) < 2:
            continue
        if bucket.kind == "all_gather":
            if not all(depends_only_on_inputs(m.args[0]) for m in bucket.members):
                continue  # unusual graph: a gather input computed mid-graph; leave it alone
            _rewrite_all_gather(gm, bucket, fake_mode)
        else:
            _rewrite_reduce(gm, bucket, fake_mode)
    stable_topological_sort(gm.graph)
    return finalize_graph(gm)
