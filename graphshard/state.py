"""What graphshard.shard leaves on a model, and how the rest of the library finds it.

One `ShardState` per sharded model, and on each module that owns sharded parameters a
`ModuleShards` record pointing at it. Three named attributes carry them, all defined here:

- STATE_ATTR, on the model passed to shard(): its ShardState.
- MODULE_ATTR, on each sharded module: its ModuleShards (its parameters' specs and local
  shards, and the model's ShardState). Per module rather than one model-wide table: a compiled
  forward reads each module's shards through it and Dynamo guards on what it reads (a table of
  every module would be guarded whole at each module's read), and a submodule copied or
  pickled on its own takes its shards along.
- BASE_CLASS_ATTR, on each generated `Sharded<Class>`: the plain class it extends. A class
  attribute: it answers for every instance, and code that needs the plain class for a moment
  (materialize's init, checkpoint's state-dict calls) swaps `module.__class__` to it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from graphshard.passes.markers import UnshardSpec
from graphshard.policy import MixedPrecisionPolicy, ShardingStrategy
from graphshard.runtime.local_shards import LocalShard

STATE_ATTR = "_graphshard_state"
MODULE_ATTR = "_graphshard_module"
BASE_CLASS_ATTR = "_graphshard_base_class"


class SyncMode(enum.Enum):
    SYNC = "sync"  # reduce-scatter (+ all-reduce across replicas) every backward
    NO_SYNC = "no_sync"  # no reduction: full gradients accumulate locally
    NO_ALL_REDUCE = "no_all_reduce"  # hybrid: reduce-scatter in the group, no cross-group AR


@dataclass(eq=False)
class GradSync:
    """The model's gradient-sync switches and accumulation buffers (graphshard/grad_sync.py)."""

    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    full_leaves: dict[str, torch.Tensor] = field(default_factory=dict)  # fqn -> full-shape leaf
    partial_leaves: dict[str, torch.Tensor] = field(default_factory=dict)  # fqn -> shard leaf

    @property
    def mode(self) -> SyncMode:
        if not self.requires_gradient_sync:
            return SyncMode.NO_SYNC
        if not self.requires_all_reduce:
            return SyncMode.NO_ALL_REDUCE
        return SyncMode.SYNC

    def accumulating(self, partial: bool) -> bool:
        leaves = self.partial_leaves if partial else self.full_leaves
        return any(leaf.grad is not None for leaf in leaves.values())


@dataclass(eq=False)
class ShardState:
    """Per model: how it was sharded, its gradient-sync switches, and checkpoint's slot."""

    mesh: DeviceMesh
    strategy: ShardingStrategy
    mixed_precision: MixedPrecisionPolicy
    grad_sync: GradSync = field(default_factory=GradSync)
    # graphshard.checkpoint's background saves of this model: their process group and the save
    # in flight (set by checkpoint's save(async_save=True); it copies and pickles as None).
    async_save: Any = None


@dataclass(eq=False)
class ModuleShards:
    """Per sharded module: for each of its sharded parameters (by local name) the unshard
    marker's spec and the local shard a graph reads; and the model's ShardState."""

    specs: dict[str, UnshardSpec]
    shards: dict[str, LocalShard]
    model: ShardState
    # Parameters a TP plan made DTensors (graphshard/tensor_parallel.py): by local name, how
    # their gathered piece is wrapped back into a DTensor on the TP mesh.
    tensor_parallel: dict[str, Any] = field(default_factory=dict)


def is_sharded(model: nn.Module) -> bool:
    # hasattr, not the instance's __dict__: wrappers that forward attributes (torch.compile's
    # OptimizedModule) answer for the model they wrap.
    return hasattr(model, STATE_ATTR)


def shard_state(model: nn.Module) -> ShardState:
    if not is_sharded(model):
        raise ValueError("model is not sharded: call graphshard.shard(model) first")
    return getattr(model, STATE_ATTR)


def module_shards(module: nn.Module) -> ModuleShards | None:
    """`module`'s record, or None for a module that owns no sharded parameter."""
    return module.__dict__.get(MODULE_ATTR)


def sharded_modules(model: nn.Module) -> Iterator[tuple[nn.Module, ModuleShards]]:
    for module in model.modules():
        record = module_shards(module)
        if record is not None:
            yield module, record


def sharded_params(model: nn.Module) -> Iterator[tuple[nn.Parameter, UnshardSpec]]:
    """Each sharded parameter once (tied parameters share one), with its marker spec."""
    seen: set[int] = set()
    for module, record in sharded_modules(model):
        for name, spec in record.specs.items():
            param = module._parameters[name]
            if id(param) not in seen:
                seen.add(id(param))
                yield param, spec


def plain_class(module: nn.Module) -> type:
    """The class `module` had before graphshard.shard (its own class if never sharded)."""
    return getattr(type(module), BASE_CLASS_ATTR, type(module))
