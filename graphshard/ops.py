"""The marker ops: `graphshard::unshard` and `graphshard::reduce_grad`.

Dynamo and AOTAutograd see these as opaque functional ops, one per parameter read and one per
gradient, carrying everything the lowering needs in their arguments (groups, sizes, dtypes,
the parameter's name). The backend's insert_collectives pass replaces them with functional
collectives; without torch.compile their eager implementations run the very same lowering
code on real tensors, so the eager path is the reference for the compiled one.
"""

from __future__ import annotations

from typing import Optional

import torch

from passes.graph_utils import EagerEmitter
from passes.insert_collectives import lower_reduce_grad, lower_unshard


@torch.library.custom_op(
    "graphshard::unshard", mutates_args=(),
    schema="(Tensor shard, SymInt full_dim0, str group_name, int group_size, "
           "ScalarType? compute_dtype, bool reshard_after_forward, str[] reduce_groups, "
           "int[] reduce_sizes, bool scatter, ScalarType? reduce_dtype, str name) -> Tensor",
)
def unshard(
    shard: torch.Tensor,
    full_dim0: int,
    group_name: str,
    group_size: int,
    compute_dtype: Optional[torch.dtype],
    reshard_after_forward: bool,
    reduce_groups: list[str],
    reduce_sizes: list[int],
    scatter: bool,
    reduce_dtype: Optional[torch.dtype],
    name: str,
) -> torch.Tensor:
    """Full parameter from this rank's dim-0 shard (all-gather over `group_name`)."""
    return lower_unshard(EagerEmitter(), shard, full_dim0, group_name, group_size, compute_dtype)


@unshard.register_fake
def _unshard_fake(shard, full_dim0, group_name, group_size, compute_dtype,
                  reshard_after_forward, reduce_groups, reduce_sizes, scatter, reduce_dtype, name):
    shape = (full_dim0, *shard.shape[1:]) if shard.dim() else ()
    return shard.new_empty(shape, dtype=compute_dtype or shard.dtype)


@torch.library.custom_op(
    "graphshard::reduce_grad", mutates_args=(),
    schema="(Tensor grad, SymInt local_dim0, str[] group_names, int[] group_sizes, bool scatter, "
           "ScalarType? reduce_dtype, ScalarType out_dtype, str name) -> Tensor",
)
def reduce_grad(
    grad: torch.Tensor,
    local_dim0: int,
    group_names: list[str],
    group_sizes: list[int],
    scatter: bool,
    reduce_dtype: Optional[torch.dtype],
    out_dtype: torch.dtype,
    name: str,
) -> torch.Tensor:
    """This rank's shard of the gradient averaged over data-parallel ranks."""
    return lower_reduce_grad(EagerEmitter(), grad, local_dim0, group_names, group_sizes, scatter,
                             reduce_dtype, out_dtype)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, local_dim0, group_names, group_sizes, scatter, reduce_dtype,
                      out_dtype, name):
    shape = (local_dim0, *grad.shape[1:]) if scatter and grad.dim() else grad.shape
    return grad.new_empty(shape, dtype=out_dtype)


def _unshard_setup_context(ctx, inputs, output):
    shard, _, _, _, _, _, reduce_groups, reduce_sizes, scatter, reduce_dtype, name = inputs
    ctx.local_dim0 = shard.shape[0] if shard.dim() else 0
    ctx.reduce = (list(reduce_groups), list(reduce_sizes), scatter, reduce_dtype, shard.dtype, name)


def _unshard_backward(ctx, grad):
    group_names, group_sizes, scatter, reduce_dtype, out_dtype, name = ctx.reduce
    grad_shard = reduce_grad(grad, ctx.local_dim0, group_names, group_sizes, scatter,
                             reduce_dtype, out_dtype, name)
    return (grad_shard,) + (None,) * 10


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)
