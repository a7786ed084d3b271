"""The plain autograd leaves a compiled graph reads for the DTensor parameters.

What a compiled graph reads is a plain tensor, never the DTensor parameter: each parameter's
local shard is bound to an autograd leaf of its own that shares the DTensor's storage. A DTensor
input would bring its DeviceMesh into the graph as an opaque object, which the partitioner may
save for backward (activation checkpointing around SDPA then fails in AOTAutograd's runtime) and
which makes Inductor's FX-graph cache key differ from run to run. Optimizers, clip_grad_norm_ and
DCP still see the DTensor parameters: the leaf's gradient is moved into the parameter's sharded
`.grad` as soon as autograd has accumulated it, and in-place updates of the parameter (the
optimizer step, loading a checkpoint) write the storage the leaf reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from graphshard._torch_compat import mark_static, sharded_like


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
    # The shard that replaced this one once `param`'s local shard moved to other storage
    # (`module.to(dtype)`: nn.Module sets `param.data`); modules sharing a tied parameter
    # follow it to one new shard.
    successor: LocalShard | None = None

    def __reduce__(self):
        return bind_local_shard, (self.param,)

    def reads(self, param: nn.Parameter, local: torch.Tensor) -> bool:
        """Whether this shard's leaf is `param`'s current local tensor `local`."""
        leaf = self.leaf
        return (self.param is param and leaf.dtype == local.dtype and leaf.device == local.device
                and leaf.data_ptr() == local.data_ptr() and leaf.shape == local.shape)

    def leaf_for(self, requires_grad: bool) -> torch.Tensor:
        """The leaf to read while the parameter has `requires_grad`."""
        if self.leaf.requires_grad != requires_grad:
            return self.twin
        return self.leaf


def bind_local_shard(param: nn.Parameter) -> LocalShard:
    leaf = _leaf(param, param.requires_grad)
    twin = None
    if param.is_floating_point() or param.is_complex():
        twin = _leaf(param, not param.requires_grad)
    return LocalShard(param, leaf, twin)


def following(shard: LocalShard, param: nn.Parameter) -> LocalShard:
    """`shard`, or the shard that replaced it, once `param`'s local shard moved to other
    storage (`module.to(dtype)`, `.double()`)."""
    with torch.no_grad():
        local = param.to_local()
    while not shard.reads(param, local):
        if shard.successor is None:
            shard.successor = bind_local_shard(param)
        shard = shard.successor
    return shard


def _leaf(param: nn.Parameter, requires_grad: bool) -> torch.Tensor:
    with torch.no_grad():
        leaf = param.to_local().detach().requires_grad_(requires_grad)
    # Static shapes, as Dynamo gives nn.Parameters even under dynamic=True: a shard's shape
    # never changes, and symbolic shard sizes would reach the collectives' padding.
    mark_static(leaf)
    if requires_grad:
        leaf.register_post_accumulate_grad_hook(_grad_mover(param))
    return leaf


def _grad_mover(param: nn.Parameter) -> Callable[[torch.Tensor], None]:
    def move(leaf: torch.Tensor) -> None:
        if leaf.grad is None:  # a no-sync backward handed its gradient elsewhere
            return
        with torch.no_grad():
            grad = sharded_like(param, leaf.grad)
            leaf.grad = None
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad

    return move
