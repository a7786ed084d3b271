"""Optimizers created before `graphshard.shard(model)`.

shard() replaces each parameter by a new one holding this rank's shard (as FSDP2's fully_shard
does). An optimizer made from `model.parameters()` before that holds the originals, which never
get a gradient again: it would silently train nothing (DDP, which keeps the parameters, lets
users build the optimizer first). So shard() remembers, for each original, the parameter that
replaced it, and swaps the replaced parameters for their shards in every live optimizer as its
last act (then the originals' memory is freed, and GradScaler.unscale_ or clipping over the
optimizer's groups see the shards). Python keeps no registry of optimizers, so shard() finds
them among the objects the garbage collector tracks (about 0.1 s in a process that has imported
transformers). Before any optimizer's step the same swap runs again (a group added after
shard() with the originals in it). An optimizer that already holds state for an original (it
stepped before shard) is refused at its next step: that state is of the full parameter, not of
this rank's shard.
"""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

# Process-wide, as optimizers are (Python keeps no registry of them). Keyed by identity and held
# weakly: an original parameter no optimizer holds any more is forgotten with it.
_replaced_by: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> its shard
# optimizer -> (replacements, its parameters) when last checked
_checked: WeakIdKeyDictionary = WeakIdKeyDictionary()
_hook = None
_replacements = 0


def remember_replacement(original: nn.Parameter, sharded: nn.Parameter) -> None:
    """Called by shard() for each parameter it replaces; installs the step hook once."""
    global _hook, _replacements
    _replaced_by[original] = sharded
    _replacements += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: use_sharded_parameters(optimizer))


def update_live_optimizers() -> None:
    """shard()'s last act: swap in every live optimizer that holds replaced parameters; one
    holding state for them is left as it is, for its next step to refuse."""
    if _replacements == 0:
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer):  # type(): no proxy's __class__ runs
            use_sharded_parameters(obj, refuse_stale=False)


def use_sharded_parameters(optimizer: torch.optim.Optimizer, refuse_stale: bool = True) -> None:
    """Swap the replaced parameters in `optimizer`'s groups for their shards (at the end of
    shard(), before a step, and before graphshard.checkpoint saves or loads its state)."""
    checked = (_replacements, sum(len(group["params"]) for group in optimizer.param_groups))
    if _checked.get(optimizer) == checked:  # no shard() and no group added since
        return
    replaced = [(group["params"], index, _replaced_by[param])
                for group in optimizer.param_groups for index, param in enumerate(group["params"])
                if param in _replaced_by]
    stale = [tuple(params[index].shape) for params, index, _ in replaced
             if optimizer.state.get(params[index])]
    if stale:  # checked before any swap: the optimizer is left as it was
        if not refuse_stale:
            return
        raise ValueError(
            f"{type(optimizer).__name__} holds state for {len(stale)} parameter(s) (shapes "
            f"{stale[:3]}) that graphshard.shard has since replaced by their shards: state of "
            "the full parameters (from a step, load_state_dict, or its constructor, as "
            "Adagrad's). Create the optimizer after graphshard.shard(model).")
    for params, index, sharded in replaced:
        params[index] = sharded
    _checked[optimizer] = checked
