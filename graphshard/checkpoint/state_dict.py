"""The model's and optimizer's state dicts as DCP reads and writes them: the model's own names
(not torch.compile's wrapper's), sharded tensors read without gathering them."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from graphshard._torch_compat import compiled_module_original
from graphshard.checkpoint.errors import CheckpointError
from graphshard.early_optimizers import use_sharded_parameters
from graphshard.sharding import is_sharded
from graphshard.state import plain_class


def unwrap(model: nn.Module) -> nn.Module:
    # torch.compile's wrapper prefixes every key with `_orig_mod.`; save the model's own names
    # so a checkpoint does not depend on whether the model was compiled.
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return compiled_module_original(model)


def check_materialised(model: nn.Module, path: Any) -> None:
    """A model built on the meta device holds no memory to load into: DCP would load nothing
    into it (torch's copy into a meta tensor is a no-op) and the run would go on untrained."""
    on_meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if not on_meta:
        return
    shown = ", ".join(on_meta[:3]) + (f" and {len(on_meta) - 3} more" if len(on_meta) > 3 else "")
    how = ("graphshard.materialize(model) after graphshard.shard(model)" if is_sharded(model)
           else "model.to_empty(device=...)")
    raise CheckpointError(
        f"cannot load checkpoint {path} into a model on the meta device ({shown}): it was built "
        f"under torch.device('meta') and never materialised. Call {how} before "
        "graphshard.checkpoint.load, which then overwrites the values; or, for safetensors "
        "weights, graphshard.checkpoint.load_pretrained, which allocates meta tensors itself")


@contextlib.contextmanager
def plain_classes(model: nn.Module) -> Iterator[None]:
    """DCP's get_state_dict / set_state_dict find every parameter with getattr(module, name);
    on a sharded module that is the property that all-gathers the full parameter (one
    collective per parameter per call: most of a save's blocking time). For the call, each
    sharded module gets its plain class back, so getattr returns the sharded nn.Parameter."""
    swapped = []
    for module in model.modules():
        plain = plain_class(module)
        if plain is not type(module):
            swapped.append((module, type(module)))
            module.__class__ = plain
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def collect_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} as DCP's get_state_dict gives them (sharded, own names)."""
    with plain_classes(model):
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        use_sharded_parameters(optimizer)  # one created before shard()
        model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def tensor_entries(model_state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            for name, value in model_state.items() if isinstance(value, torch.Tensor)}
