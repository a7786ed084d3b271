"""Full tensors into a sharded module: assigned parameters and full state dicts.

nn.Module's loader copies each state-dict value into the parameter (`param.copy_(value)`):
a DTensor value (model.state_dict(), DCP) works as is, but a plain full tensor (an unsharded
model's state dict, torch.load, a Hugging Face checkpoint) meets a DTensor parameter, which
DTensor refuses. Each sharded module's loader first turns such a value into this rank's part of
it, as a DTensor laid out like the parameter, so the copy stays in place (the local-shard leaf
the compiled graph reads shares that storage). Every rank slices its own full copy: no
communication. Absent, mis-shaped and non-tensor values are left to nn.Module's loader, which
reports them by their state-dict key.

An assignment after shard() (`module.weight = nn.Parameter(full)`, a tie `head.weight =
emb.weight`) becomes this rank's shard the same way, bound at once.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from graphshard.early_optimizers import remember_replacement
from graphshard.runtime.gathered_weight import GatheredWeight
from graphshard.runtime.local_shards import bind_local_shard
from graphshard.runtime.parts import dtensor_part
from graphshard.state import module_shards, plain_class


def shard_of(value: torch.Tensor, like: nn.Parameter, where: str) -> nn.Parameter:
    """A full parameter assigned after shard(), as this rank's shard of it."""
    if value.shape != like.shape or value.is_meta:
        raise ValueError(
            f"graphshard: {where} was replaced after graphshard.shard by a "
            f"{'meta ' if value.is_meta else ''}tensor of shape {tuple(value.shape)}; the sharded "
            f"parameter has shape {tuple(like.shape)}. Replace parameters (or modules) before "
            "graphshard.shard(model), or assign a tensor of the same shape on every rank.")
    with torch.no_grad():
        shard = dtensor_part(value, like, own_storage=True)
    sharded = nn.Parameter(shard, requires_grad=value.requires_grad)
    if isinstance(value, nn.Parameter):
        remember_replacement(value, sharded)
    return sharded


def setattr_sharded(self, name: str, value) -> None:
    """`module.weight = nn.Parameter(full)` after shard(): this rank's shard of it, bound at once
    (a compiled step reads the new leaf: Dynamo guards on it), as a full state dict loads."""
    record = module_shards(self)
    specs = record.specs if record is not None else {}
    if name in specs and isinstance(value, GatheredWeight) and value._root is value:
        if value._param is self._parameters[name]:
            return  # `m.weight -= x`: edited in place, and written back, already
        _tie(self, name, value)  # `head.weight = emb.weight`
        return
    if name in specs and isinstance(value, nn.Parameter) and not isinstance(value, DTensor):
        value = shard_of(value, like=record.shards[name].param,
                         where=f"{type(self).__name__}.{name}")
    plain_class(self).__setattr__(self, name, value)
    if name in specs and isinstance(value, DTensor):
        record.shards[name] = bind_local_shard(value, specs[name].graph_rows)


def _tie(module: nn.Module, name: str, read: GatheredWeight) -> None:
    """`module.<name> = other.weight` (Hugging Face's tie_weights) after shard(): the same
    parameter, read through the same leaf, as shard() leaves weights tied before it."""
    param, other = module._parameters[name], read._param
    if (other.shape, other.device_mesh, other.placements) != (param.shape, param.device_mesh,
                                                               param.placements):
        raise ValueError(
            f"graphshard: cannot tie {type(module).__name__}.{name} (shape {tuple(param.shape)}) "
            f"to {type(read._module).__name__}.{read._attr} (shape {tuple(other.shape)}, "
            f"{other.placements} on {other.device_mesh}): tie weights before graphshard.shard.")
    module._parameters[name] = other
    module_shards(module).shards[name] = module_shards(read._module).shards[read._attr]


def load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                         unexpected_keys, error_msgs) -> None:
    given: dict[str, torch.Tensor] = {}  # key -> the caller's value, put back afterwards
    try:
        assigned = _to_this_rank(self, state_dict, prefix, local_metadata, given)
        plain_class(self)._load_from_state_dict(
            self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs)
    finally:
        state_dict.update(given)
    if assigned:
        missing_keys[:] = [key for key in missing_keys if key not in assigned]
        record = module_shards(self)
        for name, shard in record.shards.items():
            if shard.param is not self._parameters[name]:
                record.shards[name] = bind_local_shard(self._parameters[name], shard.rows)


def _to_this_rank(module: nn.Module, state_dict, prefix: str, local_metadata: dict,
                  given: dict[str, torch.Tensor]) -> list[str]:
    """Replace, in `state_dict`, each plain full tensor for a sharded parameter by this rank's
    part as a DTensor (the caller's values go into `given`). With assign=True, assign those
    parameters here instead and return their keys (taken out of `state_dict`): nn.Module's
    loader would setattr, which first reads the parameter through its property (a gather, of
    meta tensors on a model never materialised)."""
    assign = local_metadata.get("assign_to_params_buffers", False)
    assigned = []
    for name in module_shards(module).specs:
        key, param = prefix + name, module._parameters[name]
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or value.shape != param.shape:
            continue
        if isinstance(value, DTensor):
            if not assign or (value.device_mesh, value.placements) != (param.device_mesh,
                                                                       param.placements):
                continue  # copied (redistributed if need be) by nn.Module's loader
            new = value
        else:
            new = dtensor_part(value, param, own_storage=assign)  # assign: the caller's full
            if not assign:                                         # tensor can be freed
                given[key], state_dict[key] = value, new
                continue
        given[key] = state_dict.pop(key)
        if not isinstance(new, nn.Parameter):
            new = nn.Parameter(new, requires_grad=param.requires_grad)
        module._parameters[name] = new.requires_grad_(param.requires_grad)
        assigned.append(key)
    return assigned
