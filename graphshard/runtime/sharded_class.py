"""The generated `Sharded<Class>` of each sharded module: a property per sharded parameter.

After sharding, `module._parameters[name]` holds an `nn.Parameter` wrapping a DTensor, which is
what optimizers, `clip_grad_norm_` and `torch.distributed.checkpoint` see. Reading `module.name`
goes through a class-level property that returns `graphshard::unshard(local_shard)`: the full
parameter, by an all-gather at run time eagerly (as a `GatheredWeight`, whose in-place edits
reach the shard), or by whatever the backend's passes make of the marker op under torch.compile.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from graphshard._transformers import is_transformers_class
from graphshard._torch_compat import rnn_flat_weight_names, rnn_weight_cache_overrides
from graphshard.compiler.ops import call_unshard
from graphshard.float8 import read_float8_weight
from graphshard.grad_sync import unshard_for_grad_sync
from graphshard.runtime.full_weights import load_from_state_dict, setattr_sharded, shard_of
from graphshard.runtime.gathered_weight import GatheredWeightGrad, eager_when_not_inlined
from graphshard.runtime.local_shards import LocalShard, following
from graphshard.state import BASE_CLASS_ATTR, MODULE_ATTR, plain_class


@functools.lru_cache(maxsize=None)
def sharded_class(cls: type, param_names: tuple[str, ...]) -> type:
    """`Sharded<cls>`: `cls` with a property for each of `param_names`. Cached so all instances
    of one module type share one class: torch.compile then reuses one guard set and one
    compiled graph for identical blocks."""
    attributes = {name: _param_property(name) for name in param_names}
    attributes[BASE_CLASS_ATTR] = cls
    attributes["_load_from_state_dict"] = load_from_state_dict
    attributes["__setattr__"] = setattr_sharded
    attributes["_apply"] = _apply_sharded
    attributes["__reduce_ex__"] = _reduce_sharded_module
    if issubclass(cls, nn.RNNBase):
        # RNNs cache their parameter objects at construction; read them through the
        # properties instead, or the cached, unsharded originals would be used.
        attributes.update(rnn_weight_cache_overrides(_rnn_flat_weights))
    name = f"Sharded{cls.__name__}"
    if is_transformers_class(cls):
        attributes["save_pretrained"] = _refuse_save_pretrained
        # A Hugging Face model keeps its class's names: transformers finds a model's key
        # conversions, loss and attention code by its class name and module.
        name = cls.__name__
        attributes.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(name, (cls,), attributes)


def _refuse_save_pretrained(self, *args, **kwargs) -> None:
    """Hugging Face's save_pretrained cannot store a sharded model (it fails on one rank and
    writes no weights): refused on every rank, naming the way that works."""
    from graphshard.checkpoint.transformers_models import save_pretrained_refusal

    raise save_pretrained_refusal(self)


def _local_shard(module: nn.Module, name: str) -> LocalShard:
    record = getattr(module, MODULE_ATTR)
    shard = record.shards[name]
    if not torch.compiler.is_compiling():
        # Eagerly, notice a parameter replaced behind our back (a user's
        # `module._parameters[name] = ...`: bind the new one), or its local shard moved by a
        # cast of another module that shares it (a tied weight: follow that module's shard).
        param = module._parameters[name]
        if shard.param is not param and not isinstance(param, DTensor):
            param = module._parameters[name] = shard_of(param, like=shard.param,
                                                        where=f"{type(module).__name__}.{name}")
        followed = following(shard, param)
        if followed is not shard:
            shard = record.shards[name] = followed
    return shard


def _param_property(name: str) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        shard, record = _local_shard(module, name), getattr(module, MODULE_ATTR)
        # Frozen or unfrozen after shard(), the parameter reads the twin. Under torch.compile
        # too: Dynamo guards on the parameter's requires_grad read here, so toggling it
        # recompiles (the guard checks the DTensor's layout as well: about 1 us per parameter
        # per call).
        local, spec = shard.leaf_for(module._parameters[name].requires_grad), record.specs[name]
        if local.is_meta:  # static under torch.compile: Dynamo re-raises it as is
            raise RuntimeError(_still_on_meta(module))
        if spec.float8_dtype is not None:  # a torchao Float8Linear's weight: gathered in float8
            return read_float8_weight(module, local, spec, record.model.grad_sync,
                                      record.tensor_parallel.get(name))
        full = None
        if local.requires_grad and torch.is_grad_enabled():
            # No-sync micro-batches (gradient accumulation) take another path; Dynamo guards
            # on the mode, so each mode is its own graph.
            full = unshard_for_grad_sync(local, spec, record.model.grad_sync)
        if full is None:
            full = call_unshard(local, spec)
            if not torch.compiler.is_compiling():
                # Eager code may edit the weight in place (nn.init, `.data.copy_`, zeroing a
                # padding row): such an edit must reach the shard, as it would unsharded.
                full = GatheredWeightGrad.apply(full, shard.param, module, name)
        tensor_parallel = record.tensor_parallel.get(name)
        if tensor_parallel is not None:  # the TP plan's modules compute on DTensors
            return tensor_parallel.wrap(full)
        return full

    return property(eager_when_not_inlined(get), doc=f"full (unsharded) parameter {name!r}")


def _apply_sharded(self, fn, recurse: bool = True):
    """nn.Module._apply (behind `.to()`, `.double()`, `.bfloat16()`, ...), then this module's
    shards follow their parameters' new local tensors (FSDP2 likewise resets its sharded
    parameters after `_apply`)."""
    result = plain_class(self)._apply(self, fn, recurse)
    shards = getattr(self, MODULE_ATTR).shards
    for name in shards:
        param = self._parameters.get(name)
        if isinstance(param, DTensor):  # (a plain one is bound at its next read)
            shards[name] = following(shards[name], param)
    return result


def _still_on_meta(module: nn.Module) -> str:
    record = getattr(module, MODULE_ATTR)
    names = [spec.name for n, spec in record.specs.items() if record.shards[n].leaf.is_meta]
    return (f"graphshard: parameter(s) {', '.join(names)} are still on the meta device: the "
            "model was sharded on the meta device and never materialised. Call "
            "graphshard.materialize(model) after graphshard.shard(model) and before the first "
            "forward (or load full weights with model.load_state_dict(state_dict, assign=True))")


@eager_when_not_inlined
def _rnn_flat_weights(module: nn.RNNBase) -> list[torch.Tensor | None]:
    return [getattr(module, n) if n in module._parameters else None
            for n in rnn_flat_weight_names(module)]


# --------------------------------------------------------------------------- pickling, deepcopy
#
# A generated class cannot be found by name, so a sharded module pickles as its recipe: the
# plain class (by reference, as for any module) and its parameter names, rebuilt through the
# same cache, so an unpickled or deep-copied module shares its class with the live ones (and
# their compiled graphs). Registering the classes under names in a module would need those
# names to exist before unpickling in a fresh process, i.e. the same recipe encoded in a name.
# Its local shards are bound again to the copied parameters (LocalShard's own pickling); a
# shallow copy (copy.copy) shares them, as it shares the parameters.


def _new_sharded_module(base: type, param_names: tuple[str, ...]) -> nn.Module:
    cls = sharded_class(base, param_names)
    return cls.__new__(cls)


def _reduce_sharded_module(self, protocol: int):
    names = tuple(sorted(getattr(self, MODULE_ATTR).specs))
    return _new_sharded_module, (plain_class(self), names), self.__getstate__()
