"""Lower graphshard's marker ops to functional collectives.

`graphshard.unshard(shard, ...)`   -> [cast] -> [pad] -> all_gather_into_tensor -> wait -> [narrow]
`graphshard.reduce_grad(grad, ...)` -> [cast] -> scale -> [pad] -> reduce_scatter | all_reduce
                                       -> wait -> [narrow] -> [all_reduce across replicas] -> [cast]

Uneven shards follow torch.chunk (DTensor Shard(0)): every rank's shard is padded to
ceil(dim0 / N) rows, so the gathered buffer holds the full tensor in its first dim0 rows and the
final narrow is the same on every rank. `lower_unshard` / `lower_reduce_grad` are also the eager
implementation of the marker ops (see graphshard/ops.py): one definition of the math.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.graph_utils import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    GraphEmitter,
    aten,
    dim0_chunk,
    fake_mode_of,
    is_reduce_grad,
    finalize_graph,
    is_unshard,
)


def _pad_dim0(emit, x, rows: int):
    ndim = emit.val(x).dim()
    return emit(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1) + [0, rows])


def _cast(emit, x, dtype):
    if dtype is None or emit.val(x).dtype == dtype:
        return x
    return emit(aten._to_copy.default, x, dtype=dtype)


def lower_unshard(emit, shard, full_dim0: int, group_name: str, group_size: int,
                  compute_dtype: torch.dtype | None):
    """All-gather a dim-0 shard into the full tensor (cast first: the gather moves fewer bytes)."""
    x = _cast(emit, shard, compute_dtype)
    if group_size == 1:
        return x if x is not shard else emit(aten.clone.default, x)
    chunk = dim0_chunk(full_dim0, group_size)
    local_rows = emit.val(x).shape[0] if emit.val(x).dim() else 1
    if chunk - local_rows:
        x = _pad_dim0(emit, x, chunk - local_rows)
    gathered = emit(WAIT, emit(ALL_GATHER, x, group_size, group_name))
    if chunk * group_size != full_dim0:
        gathered = emit(aten.slice.Tensor, gathered, 0, 0, full_dim0)
    return gathered


def lower_reduce_grad(emit, grad, local_dim0: int, group_names, group_sizes, scatter: bool,
                      reduce_dtype: torch.dtype | None, out_dtype: torch.dtype):
    """Average a full gradient over data-parallel ranks and keep this rank's dim-0 shard.

    The first group is the shard group: reduce-scatter there when the parameter is sharded,
    all-reduce otherwise; the remaining groups (replicas, e.g. hybrid sharding) all-reduce.
    """
    x = _cast(emit, grad, reduce_dtype)
    total = 1
    for size in group_sizes:
        total *= size
    if total > 1:
        # Divide before reducing: keeps low-precision sums in range, like DDP's pre-divide.
        x = emit(aten.div.Tensor, x, total)
    for index, (group_name, group_size) in enumerate(zip(group_names, group_sizes)):
        if group_size == 1:
            continue
        if index == 0 and scatter:
            full_dim0 = emit.val(x).shape[0]
            chunk = dim0_chunk(full_dim0, group_size)
            if chunk * group_size != full_dim0:
                x = _pad_dim0(emit, x, chunk * group_size - full_dim0)
            x = emit(WAIT, emit(REDUCE_SCATTER, x, "sum", group_size, group_name))
            if chunk != local_dim0:
                x = emit(aten.slice.Tensor, x, 0, 0, local_dim0)
        else:
            x = emit(WAIT, emit(ALL_REDUCE, x, "sum", group_name))
            _annotate_group_size(x, group_size)
    x = _cast(emit, x, out_dtype)
    if x is grad:
        x = emit(aten.clone.default, x)  # custom-op outputs must not alias their inputs
    return x


def _annotate_group_size(wait, group_size: int) -> None:
    # functional all_reduce does not carry its group size; cost model and dump need it.
    if isinstance(wait, fx.Node):
        wait.args[0].meta["graphshard_group_size"] = group_size


def insert_collectives(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    """Replace every unshard / reduce_grad marker with its collective lowering, in place."""
    fake_mode = fake_mode_of(gm)
    for node in list(gm.graph.nodes):
        if not (is_unshard(node) or is_reduce_grad(node)):
            continue
        meta = {key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta}
        meta["graphshard_marker"] = node.name  # provenance: which marker produced this node
        meta["graphshard_params"] = (node.args[-1],)  # bucketing concatenates these
        meta["graphshard_role"] = "unshard" if is_unshard(node) else "reduce_grad"
        emit = GraphEmitter(gm.graph, fake_mode, meta)
        with gm.graph.inserting_before(node):
            if is_unshard(node):
                shard, full_dim0, group_name, group_size, compute_dtype = node.args[:5]
                out = lower_unshard(emit, shard, full_dim0, group_name, group_size, compute_dtype)
            else:
                grad, local_dim0, names, sizes, scatter, reduce_dtype, out_dtype, _name = node.args
                out = lower_reduce_grad(emit, grad, local_dim0, names, sizes, scatter,
                                        reduce_dtype, out_dtype)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return finalize_graph(gm)
