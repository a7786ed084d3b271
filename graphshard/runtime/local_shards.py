"""The plain autograd leaves a compiled graph reads for the DTensor parameters.

What a compiled graph reads is a plain tensor, never the DTensor parameter: each parameter's
local shard is bound to an autograd leaf of its own that shares the DTensor's storage. A DTensor
input would bring its DeviceMesh into the graph as an opaque object, which the partitioner may
save for backward (activation checkpointing around SDPA then fails in AOTAutograd's runtime) and
which makes Inductor's FX-graph cache key differ from run to run. Optimizers, clip_grad_norm_ and
DCP still see the DTensor parameters: the leaf's gradient is moved into the parameter's sharded
`.grad` as soon as autograd has accumulated it, and in-place updates of the parameter (the
optimizer step, loading a checkpoint) write the storage the leaf reads.

Uneven shards (torch.chunk's: the last ranks hold fewer rows) live at the start of a zeroed
buffer of the first rank's row count, as FSDP2 pads its sharded storage: the leaf reads the
whole buffer, so every rank's graph reads, gathers and reduce-scatters one shape, and the ranks
of a host compile one graph (graphshard/compiler/host_compile.py) where each would otherwise
compile its own. The parameter (the optimizer, state dicts) holds the unpadded rows; the
padding stays zero, which the gathers drop and the reductions fill with zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from graphshard._torch_compat import mark_static, set_local_tensor, sharded_like
from graphshard.runtime.parts import contiguous_strides


@dataclass(eq=False)
class LocalShard:
    """The leaf a graph reads for `param`, and for a floating-point parameter its twin with the
    other `requires_grad` (both share the shard's storage): a parameter frozen or unfrozen after
    shard() reads the twin. Tied parameters share one LocalShard.

    Copied or pickled, a LocalShard is bound again to its (copied) parameter: the leaves'
    gradient hooks are closures over the original parameter. The pickle memo keeps one
    LocalShard per LocalShard, so tied parameters share one again."""

    param: nn.Parameter
    leaf: torch.Tensor
    twin: torch.Tensor | None
    rows: int | None = None  # padded rows the leaf reads (UnshardSpec.graph_rows)
    # The shard that replaced this one once `param`'s local shard moved to other storage
    # (`module.to(dtype)`: nn.Module sets `param.data`); modules sharing a tied parameter
    # follow it to one new shard.
    successor: LocalShard | None = None

    def __reduce__(self):
        return bind_local_shard, (self.param, self.rows)

    def reads(self, param: nn.Parameter, local: torch.Tensor) -> bool:
        """Whether this shard's leaf is `param`'s current local tensor `local` (padded)."""
        leaf = self.leaf
        return (self.param is param and leaf.dtype == local.dtype and leaf.device == local.device
                and leaf.storage_offset() == local.storage_offset()
                # (an empty tensor's data_ptr() is 0, whatever its storage)
                and leaf.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
                and leaf.shape == _padded_shape(local, self.rows))

    def leaf_for(self, requires_grad: bool) -> torch.Tensor:
        """The leaf to read while the parameter has `requires_grad`."""
        if self.leaf.requires_grad != requires_grad:
            return self.twin
        return self.leaf


def bind_local_shard(param: nn.Parameter, rows: int | None = None) -> LocalShard:
    """The leaves a graph reads for `param`, `rows` rows each (None: its local shard's own);
    a shard not already padded to `rows` moves into a padded buffer first."""
    _pad_storage(param, rows)
    leaf = _leaf(param, param.requires_grad, rows)
    twin = None
    if param.is_floating_point() or param.is_complex():
        twin = _leaf(param, not param.requires_grad, rows)
    return LocalShard(param, leaf, twin, rows)


def following(shard: LocalShard, param: nn.Parameter) -> LocalShard:
    """`shard`, or the shard that replaced it, once `param`'s local shard moved to other
    storage (`module.to(dtype)`, `.double()`)."""
    with torch.no_grad():
        local = param.to_local()
    while not shard.reads(param, local):
        if shard.successor is None:
            shard.successor = bind_local_shard(param, shard.rows)
            with torch.no_grad():
                local = param.to_local()  # moved into a padded buffer
        shard = shard.successor
    return shard


def _padded_shape(local: torch.Tensor, rows: int | None) -> torch.Size:
    if rows is None or local.dim() == 0:
        return local.shape
    return torch.Size((rows, *local.shape[1:]))


def _padded_view(local: torch.Tensor, rows: int | None) -> torch.Tensor | None:
    """`local` extended to `rows` rows over its storage, or None where the storage ends first."""
    shape = _padded_shape(local, rows)
    if shape == local.shape:
        return local
    end = (local.storage_offset() + shape.numel()) * local.element_size()
    if not local.is_contiguous() or end > local.untyped_storage().nbytes():
        return None
    return local.as_strided(shape, contiguous_strides(shape), local.storage_offset())


def _pad_storage(param: nn.Parameter, rows: int | None) -> None:
    """Move `param`'s local shard to the start of a zeroed buffer of `rows` rows, unless its
    storage already holds them."""
    with torch.no_grad():
        local = param.to_local()
        if _padded_view(local, rows) is not None:
            return
        buffer = local.new_zeros(_padded_shape(local, rows))
        buffer[:local.shape[0]].copy_(local)
        set_local_tensor(param, buffer[:local.shape[0]])


def _leaf(param: nn.Parameter, requires_grad: bool, rows: int | None) -> torch.Tensor:
    with torch.no_grad():
        local = param.to_local()
        view = _padded_view(local, rows)
        leaf = view.detach().requires_grad_(requires_grad)
    # Static shapes, as Dynamo gives nn.Parameters even under dynamic=True: a shard's shape
    # never changes, and symbolic shard sizes would reach the collectives' padding.
    mark_static(leaf)
    if requires_grad:
        leaf.register_post_accumulate_grad_hook(
            _grad_mover(param, local.shape[0] if view is not local else None))
    return leaf


def _grad_mover(param: nn.Parameter, local_rows: int | None) -> Callable[[torch.Tensor], None]:
    """Moves a leaf's gradient into `param.grad` (its first `local_rows` rows: a padded leaf's
    gradient is padded too)."""
    def move(leaf: torch.Tensor) -> None:
        if leaf.grad is None:  # a no-sync backward handed its gradient elsewhere
            return
        with torch.no_grad():
            grad = sharded_like(param, leaf.grad if local_rows is None else leaf.grad[:local_rows])
            leaf.grad = None
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad

    return move
