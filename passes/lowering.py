"""The collective lowering of the marker ops, written once against an emitter.

`graphshard.unshard(shard, ...)`   -> [cast] -> [pad] -> all_gather_into_tensor -> wait -> [narrow]
                                       (a float8 shard travels viewed as uint8: gloo has no float8)
`graphshard.float8_scale(shard, ...)` -> abs -> amax -> all_reduce MAX -> wait -> max / amax
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
FLOAT8_EPS = 1e-12  # torchao.float8.float8_utils.EPS: the smallest amax a scale is taken from


def _pad_dim0(emit, x, rows: int):
    ndim = emit.val(x).dim()
    return emit(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1) + [0, rows])


def _cast(emit, x, dtype):
    if dtype is None or emit.val(x).dtype == dtype:
        return x
    return emit(CAST, x, dtype)


def lower_unshard(emit, shard, spec: UnshardSpec):
    """All-gather a dim-0 shard into the full tensor (cast first: the gather moves fewer bytes)."""
    if spec.float8_dtype is not None:
        return _lower_float8_unshard(emit, shard, spec)
    return _gather(emit, shard, _cast(emit, shard, spec.compute_dtype), spec)


def _lower_float8_unshard(emit, shard, spec: UnshardSpec):
    """The shard arrives cast to float8 (graphshard/float8.py); its bytes travel as uint8."""
    if emit.val(shard).dtype != spec.float8_dtype:
        raise TypeError(f"graphshard: the float8 gather of {spec.name} got a "
                        f"{emit.val(shard).dtype} shard, expected {spec.float8_dtype}")
    if spec.gather_size == 1:
        return emit(aten.clone.default, shard)  # outputs must not alias
    wire = emit(aten.view.dtype, shard, torch.uint8)
    gathered = _gather(emit, shard, wire, spec)
    return emit(aten.view.dtype, gathered, spec.float8_dtype)


def lower_float8_scale(emit, shard, spec: UnshardSpec):
    """torchao's tensorwise weight scale, float8 max / amax, from the amax of the whole weight
    (the MAX of every rank's local amax, as its FSDP2 path computes it), in float64 then float32
    as torchao's amax_to_scale does."""
    x = shard
    if emit.val(x).dim() and emit.val(x).shape[0] == 0:
        x = _pad_dim0(emit, x, 1)  # an empty shard's amax is 0 (a weight's abs is never below)
    amax = emit(aten.amax.default, emit(aten.abs.default, x), [])
    if spec.gather_size > 1:
        amax = emit(WAIT, emit(ALL_REDUCE, amax, "max", spec.gather_group))
        _annotate_group_size(amax, spec.gather_size)
    amax = emit(aten.clamp_min.default, _cast(emit, amax, torch.float64), FLOAT8_EPS)
    scale = emit(aten.mul.Tensor, emit(aten.reciprocal.default, amax),
                 torch.finfo(spec.float8_dtype).max)
    return _cast(emit, scale, torch.float32)


def _gather(emit, shard, x, spec: UnshardSpec):
    if spec.gather_size == 1:
        return x if x is not shard else emit(aten.clone.default, x)  # outputs must not alias
    chunk = dim0_chunk(spec.full_dim0, spec.gather_size)
    local_rows = emit.val(x).shape[0] if emit.val(x).dim() else 1
    if chunk - local_rows:
        x = _pad_dim0(emit, x, chunk - local_rows)
    gather = emit(ALL_GATHER, x, spec.gather_size, spec.gather_group)
    if isinstance(gather, fx.Node) and spec.float8_dtype is not None:
        gather.meta[meta_keys.PAYLOAD_DTYPE] = spec.float8_dtype  # dump, plan: "float8", not uint8
    gathered = emit(WAIT, gather)
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
