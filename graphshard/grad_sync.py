"""Gradient accumulation: skip gradient reduction on non-final micro-batches (like FSDP2's
`set_requires_gradient_sync` / `set_requires_all_reduce`).

    with graphshard.no_sync(model):          # micro-batches 1..K-1: gather, no reduce-scatter
        for batch in micro_batches[:-1]:
            (loss_fn(model(batch)) / K).backward()
    (loss_fn(model(micro_batches[-1])) / K).backward()   # adds to the reduced sum
    optimizer.step()

How it is built, without mutating anything inside a backward graph (AOTAutograd cannot):
- Each parameter gets an accumulation *leaf*: a zero-cost (stride-0) tensor of the full shape
  (or, for `replica_only`, the shard's shape) that requires grad. In no-sync mode the parameter
  read is `graphshard::unshard_accumulating(local, leaf, ...)` (compiler/ops.py): the forward is
  the ordinary `graphshard::unshard` marker, the backward hands the full gradient to the leaf,
  so autograd's own accumulation sums the micro-batches into `leaf.grad`, and the sharded
  parameter gets no gradient at all (`replica_only`: the shard group's reduce-scatter, into
  the leaf). An op, so AOTAutograd's cache stores these graphs as it stores the others.
- Turning sync back on reduces each `leaf.grad` at once (the same eager marker as the
  ordinary backward: reduce-scatter, + all-reduce across replicas) into the parameter's sharded
  `.grad`; the synced micro-batch's backward then accumulates its own reduced gradient on top
  (a sum of reductions is the reduction of the sum). This costs, per accumulation window, one
  eager reduction per parameter (not bucketed, not overlapped) on top of the last backward's
  own, where folding the sum into the last backward would cost none; but it does not depend on
  which reads of a parameter reach the loss: nn.MultiheadAttention reads `in_proj_weight` for
  its fast-path checks before the read it computes with, so a sum added at the first read
  would be lost there.
- Under torch.compile the property reads the mode; Dynamo guards on it, so each mode compiles
  to its own graph once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from graphshard.compiler.ops import call_reduce_grad, call_unshard_accumulating
from graphshard.passes.markers import ReduceSpec, UnshardSpec
from graphshard.state import GradSync, SyncMode, shard_state, sharded_params


def _accumulation_leaf(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Stride 0: the leaf itself costs one element; only its .grad is full size.
    return torch.zeros((), dtype=dtype, device=device).expand(shape).requires_grad_()


def _reduce(grad, local_dim0: int, spec: UnshardSpec, groups: slice, scatter: bool, out_dtype):
    """Reduce over `spec`'s reduce groups selected by `groups` (shard group first)."""
    return call_reduce_grad(grad, ReduceSpec(local_dim0, spec.reduce_groups[groups],
                                             spec.reduce_sizes[groups], scatter, spec.reduce_dtype,
                                             out_dtype, spec.name))


def unshard_for_grad_sync(local: torch.Tensor, spec: UnshardSpec, sync: GradSync
                          ) -> torch.Tensor | None:
    """The parameter read for the current sync mode, or None for the ordinary unshard."""
    mode = sync.mode
    if mode is SyncMode.NO_SYNC:
        return call_unshard_accumulating(local, sync.full_leaves[spec.name], spec,
                                         shard_group_only=False)
    if mode is SyncMode.NO_ALL_REDUCE and len(spec.reduce_groups) > 1:
        return call_unshard_accumulating(local, sync.partial_leaves[spec.name], spec,
                                         shard_group_only=True)
    return None


# --------------------------------------------------------------------------- public API


def _ensure_leaves(model: nn.Module, sync: GradSync, partial: bool) -> None:
    leaves = sync.partial_leaves if partial else sync.full_leaves
    for param, spec in sharded_params(model):
        if param.requires_grad and spec.name not in leaves:
            local = param.to_local()
            # a partial sum has the shape of the (padded) shard the graph reads
            shape = local.shape
            if local.dim():
                rows = (spec.graph_rows or local.shape[0]) if partial else spec.full_dim0
                shape = torch.Size((rows, *local.shape[1:]))
            leaves[spec.name] = _accumulation_leaf(shape, spec.reduce_dtype or param.dtype,
                                                   local.device)


def _reduce_accumulated(model: nn.Module, sync: GradSync, partial: bool) -> None:
    """End of an accumulation window: reduce each accumulated sum now (every rank reaches this
    at the same point of the program) and add it to the parameter's sharded `.grad`."""
    from torch.distributed.tensor import DTensor

    leaves = sync.partial_leaves if partial else sync.full_leaves
    for param, spec in sharded_params(model):
        leaf = leaves.get(spec.name)
        if leaf is None or leaf.grad is None:
            continue
        local = param.to_local()
        local_dim0 = local.shape[0] if local.dim() else 0
        if partial:  # already reduce-scattered in the shard group: all-reduce across replicas
            reduced = _reduce(leaf.grad, local_dim0, spec, slice(1, None), False, local.dtype)
            reduced = reduced[:local_dim0] if local.dim() else reduced  # the graph's padding
        else:
            reduced = _reduce(leaf.grad, local_dim0, spec, slice(None), spec.scatter, local.dtype)
        leaf.grad = None
        grad = DTensor.from_local(reduced, param.device_mesh, param.placements,
                                  shape=param.shape, stride=param.stride())
        param.grad = grad if param.grad is None else param.grad + grad


def _switch_accumulation(model: nn.Module, accumulate: bool, partial: bool) -> GradSync:
    """Start or end one kind of accumulation: full unsharded gradients (partial=False) or
    shard-sized partial sums that skip only the replica all-reduce (partial=True)."""
    sync = shard_state(model).grad_sync
    if not accumulate:
        _reduce_accumulated(model, sync, partial)
        return sync
    if sync.accumulating(partial=not partial):
        setters = ("set_requires_gradient_sync", "set_requires_all_reduce")
        this, other = setters[::-1] if partial else setters
        raise RuntimeError(f"{this}(False) after {other}(False) micro-batches: finish that "
                           "accumulation with a synced micro-batch first")
    _ensure_leaves(model, sync, partial=partial)
    return sync


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """False: backward passes keep full (unsharded) gradients locally, summed over micro-batches,
    and reduce nothing (parameters' `.grad` stays untouched). The next forward+backward with
    True reduces the sum into the parameters' `.grad` (this call), and the next backward adds its
    own reduced gradient."""
    sync = _switch_accumulation(model, accumulate=not requires_gradient_sync, partial=False)
    sync.requires_gradient_sync = bool(requires_gradient_sync)


def set_requires_all_reduce(model: nn.Module, requires_all_reduce: bool) -> None:
    """hybrid_shard: False keeps the reduce-scatter within each shard group every micro-batch
    (the sharded partial sums accumulate locally) and skips only the all-reduce across replica
    groups; True all-reduces the accumulated sum into the parameters' `.grad` (this call).
    Without replica groups this changes nothing."""
    sync = _switch_accumulation(model, accumulate=not requires_all_reduce, partial=True)
    sync.requires_all_reduce = bool(requires_all_reduce)


@contextlib.contextmanager
def no_sync(model: nn.Module, *, replica_only: bool = False):
    """Within the block, backward passes accumulate gradients without reducing them; leaving
    the block reduces the accumulated sum into the parameters' sharded `.grad` (a collective:
    every rank leaves the block together), where later backward passes add to it.
    replica_only=True (hybrid_shard): still reduce-scatter within each shard group, skip only
    the all-reduce across replica groups."""
    sync = shard_state(model).grad_sync
    previous = sync.requires_all_reduce if replica_only else sync.requires_gradient_sync
    setter = set_requires_all_reduce if replica_only else set_requires_gradient_sync
    setter(model, False)
    try:
        yield model
    except BaseException:
        # This rank is leaving abnormally, maybe alone: reducing would start collectives the
        # other ranks are not running. Drop the partial sums; restoring the mode then reduces
        # nothing.
        for leaf in (sync.partial_leaves if replica_only else sync.full_leaves).values():
            leaf.grad = None
        raise
    finally:
        setter(model, previous)
