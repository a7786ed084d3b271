"""What graphshard.shard leaves on a model, and how the rest of the library finds it.

Kept apart from sharding.py so that modules sharding.py imports (grad_sync) can read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from graphshard.policy import MixedPrecisionPolicy, ShardingStrategy

if TYPE_CHECKING:
    from graphshard.grad_sync import GradSync
    from graphshard.passes.markers import UnshardSpec

SPECS_ATTR = "_graphshard_specs"  # on every sharded module: name -> UnshardSpec
LOCALS_ATTR = "_graphshard_locals"  # on every sharded module: name -> plain local-shard leaf
STATE_ATTR = "_graphshard_state"  # on the model passed to shard(): its ShardState
GRAD_SYNC_ATTR = "_graphshard_grad_sync"  # on every sharded module: the model's GradSync


@dataclass
class ShardState:
    """Per-model state: how it was sharded, and the gradient-sync switches (accumulation)."""

    mesh: DeviceMesh
    strategy: ShardingStrategy
    mixed_precision: MixedPrecisionPolicy
    grad_sync: "GradSync"


def is_sharded(model: nn.Module) -> bool:
    return hasattr(model, STATE_ATTR)


def shard_state(model: nn.Module) -> ShardState:
    if not is_sharded(model):
        raise ValueError("model is not sharded: call graphshard.shard(model) first")
    return getattr(model, STATE_ATTR)


def sharded_params(model: nn.Module) -> Iterator[tuple[nn.Parameter, "UnshardSpec"]]:
    """Each sharded parameter once (tied parameters share one), with its marker spec."""
    seen: set[int] = set()
    for module in model.modules():
        for name, spec in getattr(module, SPECS_ATTR, {}).items():
            param = module._parameters[name]
            if id(param) not in seen:
                seen.add(id(param))
                yield param, spec
