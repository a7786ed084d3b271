"""Optimizers created before `graphshard.shard(model)`.

shard() replaces each parameter by a new one holding this rank's shard (as FSDP2's fully_shard
does). An optimizer made from `model.parameters()` before that holds the originals, which never
get a gradient again: it would silently train nothing (DDP, which keeps the parameters, lets
users build the optimizer first). So shard() remembers, on each original, the parameter that
replaced it, and before any optimizer's step the replaced parameters in its groups are swapped
for their shards, once. An optimizer that already holds state for an original (it stepped before
shard) is refused by name: that state is of the full parameter, not of this rank's shard.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_REPLACED_BY = "_graphshard_replaced_by"  # on an original parameter: the shard that replaced it
_CHECKED = "_graphshard_checked"  # on an optimizer: (replacements, its parameters) when checked
_hook = None
_replacements = 0


def remember_replacement(original: nn.Parameter, sharded: nn.Parameter) -> None:
    """Called by shard() for each parameter it replaces; installs the step hook once."""
    global _hook, _replacements
    try:
        setattr(original, _REPLACED_BY, sharded)
    except (AttributeError, TypeError):  # a parameter class without attributes of its own
        return
    _replacements += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: use_sharded_parameters(optimizer))


def use_sharded_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Swap the replaced parameters in `optimizer`'s groups for their shards (before a step,
    and before graphshard.checkpoint saves or loads its state)."""
    checked = (_replacements, sum(len(group["params"]) for group in optimizer.param_groups))
    if getattr(optimizer, _CHECKED, None) == checked:  # no shard() and no group added since
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for index, param in enumerate(params):
            sharded = getattr(param, _REPLACED_BY, None)
            if sharded is None:
                continue
            if optimizer.state.get(param):
                raise ValueError(
                    f"{type(optimizer).__name__} holds state (it has stepped) for a parameter of "
                    f"shape {tuple(param.shape)} that graphshard.shard has since replaced by its "
                    "shard: that state is of the full parameter. Create the optimizer after "
                    "graphshard.shard(model).")
            params[index] = sharded
    setattr(optimizer, _CHECKED, checked)
