"""The marker ops `graphshard::unshard`, `graphshard::reduce_grad` and `graphshard::float8_scale`,
and `graphshard::split_copy`.

Dynamo and AOTAutograd see these as opaque functional ops, one per parameter read and one per
gradient, carrying everything the lowering needs in their arguments (passes/markers.py types
them). The backend's insert_collectives pass replaces them with functional collectives; without
torch.compile their eager implementations run the very same lowering (passes/lowering.py) on real
tensors, so the eager path is the reference for the compiled one.
"""

from __future__ import annotations

import torch

from graphshard.runtime.collective_check import CheckedEagerEmitter
from graphshard.passes.lowering import lower_float8_scale, lower_reduce_grad, lower_unshard
from graphshard.passes.markers import REDUCE_SCHEMA, UNSHARD_SCHEMA, ReduceSpec, UnshardSpec


@torch.library.custom_op("graphshard::unshard", mutates_args=(), schema=UNSHARD_SCHEMA)
def unshard(shard: torch.Tensor, *args) -> torch.Tensor:
    """Full parameter from this rank's dim-0 shard (all-gather over the gather group)."""
    spec = UnshardSpec(*args)
    return lower_unshard(CheckedEagerEmitter(f"of {spec.name}"), shard, spec)


@unshard.register_fake
def _unshard_fake(shard, *args):
    spec = UnshardSpec(*args)
    shape = (spec.full_dim0, *shard.shape[1:]) if shard.dim() else ()
    return shard.new_empty(shape, dtype=spec.float8_dtype or spec.compute_dtype or shard.dtype)


@torch.library.custom_op("graphshard::float8_scale", mutates_args=(), schema=UNSHARD_SCHEMA)
def float8_scale(shard: torch.Tensor, *args) -> torch.Tensor:
    """The float8 scale of the full weight a shard belongs to (its amax, all-reduced MAX over
    the gather group): what every rank casts its shard with before the float8 gather."""
    return lower_float8_scale(CheckedEagerEmitter(f"of {UnshardSpec(*args).name}'s float8 scale"),
                              shard, UnshardSpec(*args))


@float8_scale.register_fake
def _float8_scale_fake(shard, *args):
    return shard.new_empty((), dtype=torch.float32)


@torch.library.custom_op("graphshard::reduce_grad", mutates_args=(), schema=REDUCE_SCHEMA)
def reduce_grad(grad: torch.Tensor, *args) -> torch.Tensor:
    """This rank's shard of the gradient averaged over data-parallel ranks."""
    spec = ReduceSpec(*args)
    return lower_reduce_grad(CheckedEagerEmitter(f"of {spec.name}'s gradient"), grad, spec)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, *args):
    spec = ReduceSpec(*args)
    shape = (spec.local_dim0, *grad.shape[1:]) if spec.scatter and grad.dim() else grad.shape
    return grad.new_empty(shape, dtype=spec.out_dtype)


@torch.library.custom_op("graphshard::split_copy", mutates_args=())
def split_copy(row_blocks: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """Contiguous copies of consecutive column slices of `sizes` of the (rows, S) matrix that
    `row_blocks` make stacked on dim 0: a bucket's copy-out in one call (its rows may come from
    several buffers: an exchange that leaves this rank's own row out). Inductor runs it as is
    (FSDP2's split_with_sizes_copy), where slicing in the graph would make it generate and
    compile a kernel for every parameter: each differs in its offset into the bucket, so none
    is shared between parameters."""
    if len(row_blocks) == 1:
        return list(torch.split_with_sizes_copy(row_blocks[0], sizes, 1))  # contiguous copies
    outputs = _split_copy_fake(row_blocks, sizes)
    start = 0
    for block in row_blocks:
        stop = start + block.shape[0]
        torch.split_with_sizes_copy(block, sizes, 1, out=[out[start:stop] for out in outputs])
        start = stop
    return outputs


@split_copy.register_fake
def _split_copy_fake(row_blocks, sizes):
    rows = sum(block.shape[0] for block in row_blocks)
    return [row_blocks[0].new_empty((rows, size)) for size in sizes]


def call_unshard(shard: torch.Tensor, spec: UnshardSpec) -> torch.Tensor:
    return torch.ops.graphshard.unshard(shard, *spec.args_at_read())


def call_float8_scale(shard: torch.Tensor, spec: UnshardSpec) -> torch.Tensor:
    return torch.ops.graphshard.float8_scale(shard, *spec.as_args())


def call_reduce_grad(grad: torch.Tensor, spec: ReduceSpec) -> torch.Tensor:
    return torch.ops.graphshard.reduce_grad(grad, *spec.as_args())


def _unshard_setup_context(ctx, inputs, output):
    shard, *args = inputs
    ctx.reduce = UnshardSpec(*args).reduce_spec(shard.shape[0] if shard.dim() else 0, shard.dtype)


def _unshard_backward(ctx, grad):
    return (call_reduce_grad(grad, ctx.reduce),) + (None,) * (len(UnshardSpec.__dataclass_fields__))


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)
