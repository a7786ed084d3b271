"""The collective lowering of the marker ops, written once against an emitter.

`graphshard.unshard(shard, ...)`   -> [cast] -> [pad] -> all_gather_into_tensor -> wait -> [narrow]
`graphshard.reduce_grad(grad, ...)` -> [cast] -> scale -> [pad] -> reduce_scatter | all_reduce
                                       -> wait -> [all_reduce across replicas] -> [narrow] -> [cast]

Run with an EagerEmitter it is the marker ops' eager implementation (graphshard/compiler/ops.py); run with
a GraphEmitter it is the insert_collectives pass. Everything emitted into a graph must be an op
Inductor lowers after AOTAutograd's decomposition (a cast is prims.convert_element_type, not
aten._to_copy, which Inductor only knows as a decomposition).

Uneven shards follow torch.chunk (DTensor Shard(0)): every rank's shard is padded to
ceil(dim0 / N) rows, so the gathered buffer holds the full tensor in its first dim0 rows and the
final narrow is the same on every rank.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphshard.passes import meta_keys
from graphshard.passes.graph_utils import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, aten, dim0_chunk
from graphshard.passes.markers import ReduceSpec, UnshardSpec

CAST = torch.ops.prims.convert_element_type.default


def _pad_dim0(emit, x, rows: int):
    ndim = emit.val(x).dim()
    return emit(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1) + [0, rows])


def _cast(emit, x, dtype):
    if dtype is None or emit.val(x).dtype == dtype:
        return x
    return emit(CAST, x, dtype)


def lower_unshard(emit, shard, spec: UnshardSpec):
    """All-gather a dim-0 shard into the full tensor (cast first: the gather moves fewer bytes)."""
    x = _cast(emit, shard, spec.compute_dtype)
    if spec.gather_size == 1:
        return x if x is not shard else emit(aten.clone.default, x)  # outputs must not alias
    chunk = dim0_chunk(spec.full_dim0, spec.gather_size)
    local_rows = emit.val(x).shape[0] if emit.val(x).dim() else 1
    if chunk - local_rows:
        x = _pad_dim0(emit, x, chunk - local_rows)
    gathered = emit(WAIT, emit(ALL_GATHER, x, spec.gather_size, spec.gather_group))
    if chunk * spec.gather_size != spec.full_dim0:
        gathered = emit(aten.slice.Tensor, gathered, 0, 0, spec.full_dim0)
    return gathered


def lower_reduce_grad(emit, grad, spec: ReduceSpec):
    """Average a full gradient over data-parallel ranks and keep this rank's dim-0 shard.

    The first group is the shard group: reduce-scatter there when the parameter is sharded,
    all-reduce otherwise; the remaining groups (replicas, e.g. hybrid sharding) all-reduce.
    """
    x = _cast(emit, grad, spec.reduce_dtype)
    total = 1
    for size in spec.group_sizes:
        total *= size
    if total > 1:
        # Divide before reducing: keeps low-precision sums in range, like DDP's pre-divide.
        x = emit(aten.div.Tensor, x, total)
    padded = False
    for index, (group_name, group_size) in enumerate(zip(spec.group_names, spec.group_sizes)):
        if group_size == 1:
            continue
        if index == 0 and spec.scatter:
            full_dim0 = emit.val(x).shape[0]
            chunk = dim0_chunk(full_dim0, group_size)
            if chunk * group_size != full_dim0:
                x = _pad_dim0(emit, x, chunk * group_size - full_dim0)
            x = emit(WAIT, emit(REDUCE_SCATTER, x, "sum", group_size, group_name))
            padded = chunk != spec.local_dim0
        else:
            x = emit(WAIT, emit(ALL_REDUCE, x, "sum", group_name))
            _annotate_group_size(x, group_size)
    if padded:
        # Narrowed last: the replicas' all-reduce then has the same (padded) shape on every
        # rank, and takes a bucket of reduce-scatter outputs whole (bucket_collectives).
        x = emit(aten.slice.Tensor, x, 0, 0, spec.local_dim0)
    x = _cast(emit, x, spec.out_dtype)
    if x is grad:
        x = emit(aten.clone.default, x)  # custom-op outputs must not alias their inputs
    return x


def _annotate_group_size(wait, group_size: int) -> None:
    # functional all_reduce does not carry its group size; cost model and dump need it.
    if isinstance(wait, fx.Node):
        wait.args[0].meta[meta_keys.GROUP_SIZE] = group_size
