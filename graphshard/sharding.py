"""`graphshard.shard`: turn every parameter of a model into a DTensor shard, in place.

After sharding, `module._parameters[name]` holds an `nn.Parameter` wrapping a DTensor
(Shard(0) on the shard mesh dimension), which is what optimizers, `clip_grad_norm_` and
`torch.distributed.checkpoint` see. Reading `module.name` goes through a class-level property
that returns `graphshard::unshard(local_shard)`: the full parameter, by an all-gather at run
time eagerly (as a `GatheredWeight`, whose in-place edits reach the shard), or by whatever the
backend's passes make of the marker op under torch.compile.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from graphshard.early_optimizers import remember_replacement, update_live_optimizers
from graphshard.grad_sync import GradSync, unshard_for_grad_sync
from graphshard.state import (GRAD_SYNC_ATTR, LOCALS_ATTR, SPECS_ATTR, STATE_ATTR, ShardState,
                              is_sharded, shard_state)
from graphshard._torch_compat import (mark_static, run_eagerly_when_called_from_eager_code,
                                      sharded_like, wrapper_tensor, written_arguments)
from graphshard.compiler.ops import call_unshard
from graphshard.passes.markers import UnshardSpec
from graphshard.policy import MixedPrecisionPolicy, ShardingStrategy, resolve_mixed_precision

# --------------------------------------------------------------------------- local shards
#
# What a compiled graph reads is a plain tensor, never the DTensor parameter: each parameter's
# local shard is bound to an autograd leaf of its own that shares the DTensor's storage. A DTensor
# input would bring its DeviceMesh into the graph as an opaque object, which the partitioner may
# save for backward (activation checkpointing around SDPA then fails in AOTAutograd's runtime) and
# which makes Inductor's FX-graph cache key differ from run to run. Optimizers, clip_grad_norm_ and
# DCP still see the DTensor parameters: the leaf's gradient is moved into the parameter's sharded
# `.grad` as soon as autograd has accumulated it, and in-place updates of the parameter (the
# optimizer step, loading a checkpoint) write the storage the leaf reads.


def _bind_local_shard(param: nn.Parameter) -> torch.Tensor:
    """The leaf a graph reads for `param`, and for a floating-point parameter its twin with the
    other `requires_grad` (`_graphshard_twin`; both share the shard's storage): a parameter
    frozen or unfrozen after shard() reads the twin (see `_local_shard`)."""
    leaf = _leaf(param, param.requires_grad)
    if param.is_floating_point() or param.is_complex():
        twin = _leaf(param, not param.requires_grad)
        leaf._graphshard_twin, twin._graphshard_twin = twin, leaf
    return leaf


def _leaf(param: nn.Parameter, requires_grad: bool) -> torch.Tensor:
    with torch.no_grad():
        leaf = param.to_local().detach().requires_grad_(requires_grad)
    # Static shapes, as Dynamo gives nn.Parameters even under dynamic=True: a shard's shape
    # never changes, and symbolic shard sizes would reach the collectives' padding.
    mark_static(leaf)
    if requires_grad:
        leaf.register_post_accumulate_grad_hook(_grad_mover(param))
    leaf._graphshard_param = param  # the parameter this leaf stands for (checked eagerly)
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


def bind_local_shards(model: nn.Module) -> None:
    """(Re)bind every sharded module's local-shard leaves to its current parameters, one leaf
    per parameter object (tied weights share one). Called by shard() and materialize()."""
    leaves: dict[int, torch.Tensor] = {}
    for module in model.modules():
        specs = getattr(module, SPECS_ATTR, None)
        if specs is None:
            continue
        bound = {}
        for name in specs:
            param = module._parameters[name]
            if id(param) not in leaves:
                leaves[id(param)] = _bind_local_shard(param)
            bound[name] = leaves[id(param)]
        object.__setattr__(module, LOCALS_ATTR, bound)


def _following(leaf: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """`leaf`, or the leaf that replaced it, once `param`'s local shard moved to other storage
    (`module.to(dtype)`, `.double()`: nn.Module sets `param.data`). The replacement is kept on
    the old leaf, so modules sharing a tied parameter follow it to one new leaf."""
    with torch.no_grad():
        local = param.to_local()
    while not (leaf._graphshard_param is param and leaf.dtype == local.dtype
               and leaf.device == local.device and leaf.data_ptr() == local.data_ptr()
               and leaf.shape == local.shape):
        successor = getattr(leaf, "_graphshard_successor", None)
        if successor is None:
            successor = leaf._graphshard_successor = _bind_local_shard(param)
        leaf = successor
    return leaf


def _apply_sharded(self, fn, recurse: bool = True):
    """nn.Module._apply (behind `.to()`, `.double()`, `.bfloat16()`, ...), then this module's
    leaves follow their parameters' new local shards (FSDP2 likewise resets its sharded
    parameters after `_apply`)."""
    result = type(self)._graphshard_base_class._apply(self, fn, recurse)
    leaves = getattr(self, LOCALS_ATTR)
    for name in leaves:
        param = self._parameters.get(name)
        if isinstance(param, DTensor):  # (a plain one is bound at its next read)
            leaves[name] = _following(leaves[name], param)
    return result


def _local_shard(module: nn.Module, name: str) -> torch.Tensor:
    local = getattr(module, LOCALS_ATTR)[name]
    param = module._parameters[name]
    if not torch.compiler.is_compiling():
        # Eagerly, notice a parameter replaced behind our back (a user's
        # `module._parameters[name] = ...`: bind the new one), or its local shard moved by a
        # cast of another module that shares it (a tied weight: follow that module's leaf).
        if local._graphshard_param is not param and not isinstance(param, DTensor):
            param = module._parameters[name] = _shard_of(param, like=local._graphshard_param,
                                                         where=f"{type(module).__name__}.{name}")
        followed = _following(local, param)
        if followed is not local:
            local = getattr(module, LOCALS_ATTR)[name] = followed
    if local.requires_grad != param.requires_grad:
        # Frozen or unfrozen after shard(). Under torch.compile too: Dynamo guards on the
        # parameter's requires_grad read here, so toggling it recompiles, reading the twin
        # (the guard checks the DTensor's layout as well: about 1 us per parameter per call).
        local = local._graphshard_twin
    return local


def _param_property(name: str) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        local, spec = _local_shard(module, name), getattr(module, SPECS_ATTR)[name]
        if local.is_meta:  # static under torch.compile: Dynamo re-raises it as is
            raise RuntimeError(_still_on_meta(module))
        if local.requires_grad and torch.is_grad_enabled():
            # No-sync micro-batches (gradient accumulation) take another path; Dynamo guards on the mode, so each mode is its own graph.
            full = unshard_for_grad_sync(local, spec, getattr(module, GRAD_SYNC_ATTR))
            if full is not None:
                return full
        full = call_unshard(local, spec)
        if torch.compiler.is_compiling():
            return full
        # Eager code may edit the weight in place (nn.init, `.data.copy_`, zeroing a padding
        # row): such an edit must reach the shard, as it would reach an unsharded parameter.
        return _GatheredWeightGrad.apply(full, local._graphshard_param, module, name)

    return property(_eager_when_not_inlined(get), doc=f"full (unsharded) parameter {name!r}")


class _GatheredWeightGrad(torch.autograd.Function):
    """`GatheredWeight` around a gathered weight, passing gradients through to the gather."""

    @staticmethod
    def forward(ctx, full, param, module, name):
        return GatheredWeight(full, param, module, name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def _eager_when_not_inlined(fn: Callable) -> Callable:
    """Inside a compiled frame Dynamo inlines our parameter accessors: the markers land in the
    caller's graph. Reached from eager code instead (a module Dynamo does not trace, such as an
    RNN, or code after a user's graph break), an accessor would be compiled as a frame of its
    own, recompiled per parameter shape and then traced with dynamic shard sizes (and
    GatheredWeight's dispatch, reached from an eager LSTM's kernel, would send that kernel to
    Inductor). Skip it, and what it calls, as a top-level frame: it runs the eager markers, the
    reference path."""
    return run_eagerly_when_called_from_eager_code(fn)


class GatheredWeight(torch.Tensor):
    """What reading `module.weight` returns in eager code: the gathered full weight, whose
    in-place edits (on it or on a view of it: `nn.init.normal_(m.weight)`,
    `m.weight.data.copy_(w)`, `m.emb.weight[0].zero_()`, `w.chunk(3)[0]`) are written back to
    this rank's shard, as they would be kept by an unsharded parameter. Every other op computes
    on the plain full tensor and returns plain tensors. An edit is refused, by name, where
    writing it back would be wrong: the parameter changed since the read (an optimizer step, an
    edit through another read), or the read is a rounded copy (mixed precision)."""

    @staticmethod
    def __new__(cls, full: torch.Tensor, param: nn.Parameter, module: nn.Module, name: str,
                root: "GatheredWeight | None" = None):
        self = wrapper_tensor(cls, full)
        # (underscored: Tensor already has `name`, `data`, ...)
        self._full, self._param, self._module, self._attr = full, param, module, name
        self._root = self if root is None else root  # the attribute read, under its views
        if root is None:
            self._param_version = param._version  # the shard this read gathered
        return self

    def __repr__(self) -> str:
        return f"GatheredWeight({self._full!r})"

    # The attribute read itself (not its views or detached aliases) answers for the parameter,
    # as `module.weight` does unsharded: `m.weight.requires_grad = False` freezes it and
    # `m.weight.grad` is its gradient (a DTensor, this rank's shard: in-place edits of it stay).
    @property
    def requires_grad(self) -> bool:
        if self._root is self:
            return self._param.requires_grad
        return torch.Tensor.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if self._root is self:
            self._param.requires_grad_(value)
        else:
            torch.Tensor.requires_grad.__set__(self, value)

    def requires_grad_(self, requires_grad: bool = True) -> "GatheredWeight":
        self.requires_grad = requires_grad
        return self

    @property
    def grad(self) -> torch.Tensor | None:
        return self._param.grad if self._root is self else torch.Tensor.grad.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if self._root is self:
            self._param.grad = value
        else:
            torch.Tensor.grad.__set__(self, value)

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:  # Hugging Face's `w.data = init(w.data)`
        if value.shape != self.shape:
            raise ValueError(f"graphshard: cannot set {self._attr}.data to shape "
                             f"{tuple(value.shape)}: the sharded parameter keeps {tuple(self.shape)}")
        with torch.no_grad():
            self.copy_(value)

    # Plain-tensor conversions and copies: of the values, not of the module behind them.
    def numpy(self, *args, **kwargs):
        return self._full.numpy(*args, **kwargs)

    def tolist(self):
        return self._full.tolist()

    def __array__(self, dtype=None):
        return self._full.detach().numpy() if dtype is None else self._full.detach().numpy().astype(dtype)

    def __deepcopy__(self, memo):
        return self._full.detach().clone()

    def __reduce_ex__(self, protocol):
        return self._full.detach().clone().__reduce_ex__(protocol)

    def write_back(self) -> None:
        root, param = self._root, self._param
        where = f"{type(self._module).__name__}.{self._attr}"
        if root._full.dtype != self._param.dtype:
            raise ValueError(
                f"graphshard: {where} was edited in place, but reading it returns a "
                f"{root._full.dtype} copy of the {self._param.dtype} parameter (mixed precision), "
                "which cannot be written back exactly. Edit the parameter itself: "
                f"module._parameters[{self._attr!r}] (a DTensor; nn.init and in-place ops work on "
                "it), or load weights with load_state_dict.")
        if root._full.shape != param.shape:  # t_(), resize_(), squeeze_() on the read
            raise ValueError(
                f"graphshard: {where} was reshaped in place to {tuple(root._full.shape)}; a "
                f"sharded parameter keeps its shape {tuple(param.shape)}. Assign a new "
                f"parameter instead (module.{self._attr} = nn.Parameter(...), the same on every "
                "rank), or reshape before graphshard.shard.")
        if param._version != root._param_version:
            raise ValueError(
                f"graphshard: {where} was edited in place through a read made before the "
                "parameter last changed (an optimizer step, a load, an edit through another "
                f"read): writing it back would undo that change. Read {self._attr} again, "
                "after the change, and edit that.")
        with torch.no_grad():
            param.copy_(_dtensor_part(root._full, param, own_storage=False))
        root._param_version = param._version

    @classmethod
    @_eager_when_not_inlined
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain_args, plain_kwargs = tree_map_only(cls, lambda t: t._full, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        written = [value for value in tree_leaves(written_arguments(func, args, kwargs))
                   if isinstance(value, cls)]  # (a list for the _foreach_ ops)
        for weight in written:
            weight.write_back()
        if written and out is written[0]._full:
            return written[0]  # an in-place op returns its (edited) self
        if func.is_view and isinstance(args[0], cls):  # views (split, unbind: several)
            weight = args[0]
            return tree_map_only(torch.Tensor, lambda view: cls(view, weight._param, weight._module,
                                                                weight._attr, weight._root), out)
        return out


def _still_on_meta(module: nn.Module) -> str:
    locals_ = getattr(module, LOCALS_ATTR)
    names = [spec.name for n, spec in getattr(module, SPECS_ATTR).items() if locals_[n].is_meta]
    return (f"graphshard: parameter(s) {', '.join(names)} are still on the meta device: the "
            "model was sharded on the meta device and never materialised. Call "
            "graphshard.materialize(model) after graphshard.shard(model) and before the first "
            "forward (or load full weights with model.load_state_dict(state_dict, assign=True))")


@_eager_when_not_inlined
def _rnn_flat_weights(module: nn.RNNBase) -> list[torch.Tensor | None]:
    return [getattr(module, n) if n in module._parameters else None
            for n in module._flat_weights_names]


def _nothing(self) -> None:
    return None


def _refuse_save_pretrained(self, *args, **kwargs) -> None:
    """Hugging Face's save_pretrained cannot store a sharded model (it fails on one rank and
    writes no weights): refused on every rank, naming the way that works."""
    from graphshard.checkpoint.transformers_models import save_pretrained_refusal

    raise save_pretrained_refusal(self)


@functools.lru_cache(maxsize=None)
def _sharded_class(cls: type, param_names: tuple[str, ...]) -> type:
    # Cached so all instances of one module type share one class: torch.compile then reuses
    # one guard set and one compiled graph for identical blocks.
    properties = {name: _param_property(name) for name in param_names}
    properties["_graphshard_base_class"] = cls
    properties["_graphshard_param_names"] = param_names
    properties["_load_from_state_dict"] = _load_from_state_dict
    properties["__setattr__"] = _setattr_sharded
    properties["_apply"] = _apply_sharded
    properties["__reduce_ex__"] = _reduce_sharded_module
    properties["__copy__"] = _copy_sharded_module
    name = f"Sharded{cls.__name__}"
    if hasattr(cls, "save_pretrained"):
        properties["save_pretrained"] = _refuse_save_pretrained
        # A Hugging Face model keeps its class's names: transformers finds a model's key
        # conversions, loss and attention code by its class name and module.
        name = cls.__name__
        properties.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    if issubclass(cls, nn.RNNBase):
        # RNNs cache their parameter objects in `_flat_weights` at construction; read them
        # through the properties instead, or the cached, unsharded originals would be used.
        properties["_flat_weights"] = property(_rnn_flat_weights, lambda self, value: None)
        # Nothing to re-cache when weights change (`_apply`, each forward's check): the
        # property reads the current ones. Their checks would gather every weight again.
        properties["_init_flat_weights"] = properties["_update_flat_weights"] = _nothing
    return type(name, (cls,), properties)


# --------------------------------------------------------------------------- loading full weights
#
# nn.Module's loader copies each state-dict value into the parameter (`param.copy_(value)`):
# a DTensor value (model.state_dict(), DCP) works as is, but a plain full tensor (an unsharded
# model's state dict, torch.load, a Hugging Face checkpoint) meets a DTensor parameter, which
# DTensor refuses. Each sharded module's loader first turns such a value into this rank's part of
# it, as a DTensor laid out like the parameter, so the copy stays in place (the local-shard leaf
# the compiled graph reads shares that storage). Every rank slices its own full copy: no
# communication. Absent, mis-shaped and non-tensor values are left to nn.Module's loader, which
# reports them by their state-dict key.


def _this_rank_part(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's local shard of `full` (`param`'s global shape), cut as shard() cuts it:
    torch.chunk along dim 0 over the shard mesh dimension, or whole where replicated."""
    mesh = param.device_mesh
    shard_dim = mesh.ndim - 1
    part = full.detach()
    if param.placements[shard_dim].is_shard():
        part = _local_dim0_slice(part, mesh.get_local_rank(shard_dim), mesh.size(shard_dim))
    local = param.to_local()
    return part.to(torch.device(mesh.device_type) if local.is_meta else local.device)


def _setattr_sharded(self, name: str, value) -> None:
    """`module.weight = nn.Parameter(full)` after shard(): this rank's shard of it, bound at once
    (a compiled step reads the new leaf: Dynamo guards on it), as a full state dict loads."""
    specs = getattr(self, SPECS_ATTR, {})
    if name in specs and isinstance(value, GatheredWeight) and value._root is value:
        if value._param is self._parameters[name]:
            return  # `m.weight -= x`: edited in place, and written back, already
        _tie(self, name, value)  # `head.weight = emb.weight`
        return
    if name in specs and isinstance(value, nn.Parameter) and not isinstance(value, DTensor):
        value = _shard_of(value, like=getattr(self, LOCALS_ATTR)[name]._graphshard_param,
                          where=f"{type(self).__name__}.{name}")
    type(self)._graphshard_base_class.__setattr__(self, name, value)
    if name in specs and isinstance(value, DTensor):
        getattr(self, LOCALS_ATTR)[name] = _bind_local_shard(value)


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
    getattr(module, LOCALS_ATTR)[name] = getattr(read._module, LOCALS_ATTR)[read._attr]


def _dtensor_part(full: torch.Tensor, param: nn.Parameter, own_storage: bool) -> DTensor:
    """This rank's part of `full` as a DTensor laid out like `param`."""
    part = _this_rank_part(full, param)
    if own_storage:
        part = part.clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(part, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _shard_of(value: torch.Tensor, like: nn.Parameter, where: str) -> nn.Parameter:
    """A full parameter assigned after shard(), as this rank's shard of it."""
    if value.shape != like.shape or value.is_meta:
        raise ValueError(
            f"graphshard: {where} was replaced after graphshard.shard by a "
            f"{'meta ' if value.is_meta else ''}tensor of shape {tuple(value.shape)}; the sharded "
            f"parameter has shape {tuple(like.shape)}. Replace parameters (or modules) before "
            "graphshard.shard(model), or assign a tensor of the same shape on every rank.")
    with torch.no_grad():
        shard = _dtensor_part(value, like, own_storage=True)
    sharded = nn.Parameter(shard, requires_grad=value.requires_grad)
    if isinstance(value, nn.Parameter):
        remember_replacement(value, sharded)
    return sharded


def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                          unexpected_keys, error_msgs) -> None:
    given: dict[str, torch.Tensor] = {}  # key -> the caller's value, put back afterwards
    try:
        assigned = _to_this_rank(self, state_dict, prefix, local_metadata, given)
        type(self)._graphshard_base_class._load_from_state_dict(
            self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs)
    finally:
        state_dict.update(given)
    if assigned:
        missing_keys[:] = [key for key in missing_keys if key not in assigned]
        leaves = getattr(self, LOCALS_ATTR)
        for name in getattr(self, SPECS_ATTR):
            if leaves[name]._graphshard_param is not self._parameters[name]:
                leaves[name] = _bind_local_shard(self._parameters[name])


def _to_this_rank(module: nn.Module, state_dict, prefix: str, local_metadata: dict,
                  given: dict[str, torch.Tensor]) -> list[str]:
    """Replace, in `state_dict`, each plain full tensor for a sharded parameter by this rank's
    part as a DTensor (the caller's values go into `given`). With assign=True, assign those
    parameters here instead and return their keys (taken out of `state_dict`): nn.Module's
    loader would setattr, which first reads the parameter through its property (a gather, of
    meta tensors on a model never materialised)."""
    assign = local_metadata.get("assign_to_params_buffers", False)
    assigned = []
    for name in getattr(module, SPECS_ATTR):
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
            new = _dtensor_part(value, param, own_storage=assign)  # assign: the caller's full
            if not assign:                                         # tensor can be freed
                given[key], state_dict[key] = value, new
                continue
        given[key] = state_dict.pop(key)
        if not isinstance(new, nn.Parameter):
            new = nn.Parameter(new, requires_grad=param.requires_grad)
        module._parameters[name] = new.requires_grad_(param.requires_grad)
        assigned.append(key)
    return assigned


# --------------------------------------------------------------------------- pickling, deepcopy
#
# A generated class cannot be found by name, so a sharded module pickles as its recipe: the
# plain class (by reference, as for any module) and its parameter names, rebuilt through the
# same cache, so an unpickled or deep-copied module shares its class with the live ones (and
# their compiled graphs). Registering the classes under names in a module would need those
# names to exist before unpickling in a fresh process, i.e. the same recipe encoded in a name.
# The local-shard leaves are not copied: their gradient hooks are closures over the original
# parameters. Each is bound again to its unpickled (or copied) parameter, one leaf per leaf,
# so tied parameters share a leaf again.


class _LeafStandIn:
    """Pickles as `_bind_local_shard(param)`; one per leaf, so the pickle memo keeps sharing."""

    def __init__(self, param: nn.Parameter):
        self.param = param

    def __reduce__(self):
        return _bind_local_shard, (self.param,)


def _stand_in(leaf: torch.Tensor) -> _LeafStandIn:
    stand_in = getattr(leaf, "_graphshard_stand_in", None)
    if stand_in is None:
        stand_in = leaf._graphshard_stand_in = _LeafStandIn(leaf._graphshard_param)
    return stand_in


def _new_sharded_module(base: type, param_names: tuple[str, ...]) -> nn.Module:
    cls = _sharded_class(base, param_names)
    return cls.__new__(cls)


def _copy_sharded_module(self) -> nn.Module:
    # copy.copy shares parameters, hence leaves (it would otherwise use __reduce_ex__ without
    # rebuilding the stand-ins).
    new = type(self).__new__(type(self))
    new.__setstate__(self.__getstate__())
    return new


def _reduce_sharded_module(self, protocol: int):
    cls = type(self)
    state = self.__getstate__()
    leaves = state.get(LOCALS_ATTR) if isinstance(state, dict) else None
    if leaves is not None:
        state = {**state, LOCALS_ATTR: {name: _stand_in(leaf) for name, leaf in leaves.items()}}
    return _new_sharded_module, (cls._graphshard_base_class, cls._graphshard_param_names), state


def _check(condition: bool, message: Callable[[], str]) -> None:
    if not condition:
        raise ValueError(message())


def _default_mesh(device_type: str, strategy: ShardingStrategy) -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "graphshard.shard needs an initialised process group: launch with "
            "`torchrun --nproc-per-node N script.py` and call "
            "torch.distributed.init_process_group('gloo' or 'nccl'), or pass a DeviceMesh"
        )
    if strategy is ShardingStrategy.HYBRID_SHARD:
        raise ValueError(
            "strategy 'hybrid_shard' needs a 2-D DeviceMesh (replicate, shard): pass "
            "mesh=init_device_mesh(device, (num_replicas, shard_size), "
            "mesh_dim_names=('replicate', 'shard'))"
        )
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _named_param_slots(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, nn.Parameter]]:
    """(module, local name, fully qualified name, parameter), tied parameters included."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, f"{module_name}.{name}" if module_name else name, param


def _check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model that another data-parallel wrapper already reduces or shards: both would
    act on every gradient (DDP's reducer and graphshard's reductions), or both would own the
    parameters (FSDP's flat or DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    refusals = (
        (DistributedDataParallel, "wrapped in DistributedDataParallel, whose reducer would "
         "all-reduce every gradient that graphshard reduces too. Drop the DDP wrapper and shard "
         "the inner module: graphshard.shard(ddp_model.module) (strategy='no_shard' is "
         "graphshard's DDP)"),
        (DataParallel, "wrapped in nn.DataParallel (replicas in one process). Drop the wrapper "
         "and shard the inner module, one process per device: graphshard.shard(dp_model.module)"),
        (FullyShardedDataParallel, "wrapped in FullyShardedDataParallel (FSDP1), which already "
         "shards its parameters. Use one of the two: build the model without the FSDP wrapper "
         "and graphshard.shard the plain module"),
        (FSDPModule, "already sharded by FSDP2's fully_shard, whose parameters are DTensors of "
         "its own. Use one of the two: build the model again without fully_shard and "
         "graphshard.shard the plain module"),
    )
    for name, module in model.named_modules():
        for wrapper, what in refusals:
            if isinstance(module, wrapper):
                where = "the model" if not name else f"submodule {name!r}"
                raise ValueError(f"graphshard.shard: {where} ({type(module).__name__}) is {what}")


def _check_plain_parameters(model: nn.Module, slots: list) -> None:
    if hasattr(model, STATE_ATTR) or any(hasattr(m, SPECS_ATTR) for m, *_ in slots):
        raise ValueError("model is already sharded by graphshard (it, or the model it belongs "
                         "to, went through graphshard.shard); call graphshard.shard once per model")
    for _, _, fqn, param in slots:
        if isinstance(param, DTensor):
            raise ValueError(
                f"graphshard.shard: parameter {fqn!r} is already a DTensor ({param.placements} "
                f"over a mesh of shape {tuple(param.device_mesh.shape)}: tensor parallelism, "
                "distribute_tensor or another sharding library). graphshard shards plain "
                "parameters and makes its own DTensors: build the model with plain tensors "
                "(or replace each DTensor by its full_tensor()) and then call graphshard.shard"
            )


def _check_dense_gradients(model: nn.Module) -> None:
    # A sparse gradient cannot be reduce-scattered (torch's collectives, like FSDP's, take
    # strided tensors): left alone, it fails deep inside the backward.
    for fqn, module in model.named_modules():
        if (isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
                and module.weight.requires_grad):
            raise ValueError(
                f"graphshard.shard: {repr(fqn) if fqn else 'the model'} is an nn.{type(module).__name__} with "
                "sparse=True, whose gradient is a sparse tensor; graphshard reduces gradients "
                "with reduce-scatter, which takes dense tensors only (as FSDP does). Build it "
                "with sparse=False (the default) or freeze its weight before sharding")


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    # The local shard is a contiguous clone, so the global layout is contiguous too (the
    # original parameter may have been a transposed view).
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _local_dim0_slice(full: torch.Tensor, coordinate: int, size: int) -> torch.Tensor:
    chunks = torch.chunk(full, size, dim=0)
    if coordinate < len(chunks):
        return chunks[coordinate]
    return full.new_empty((0, *full.shape[1:]))


def shard(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    strategy: str | ShardingStrategy = "full_shard",
    mixed_precision: MixedPrecisionPolicy | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    sync_module_states: bool = True,
) -> nn.Module:
    """Shard `model`'s parameters in place over `mesh` and return the same module.

    strategy: "full_shard" (ZeRO-3: gather in forward, free, gather again in backward),
        "shard_grad_op" (ZeRO-2: keep gathered weights from forward for backward),
        "no_shard" (DDP: replicated parameters, all-reduced gradients),
        "hybrid_shard" (2-D mesh (replicate, shard): shard within groups, replicate across).
    mesh: a 1-D DeviceMesh (2-D for hybrid_shard); None means the default process group.
    mixed_precision / param_dtype / reduce_dtype: compute and gradient-reduction dtypes; the
        sharded parameters and optimizer state keep their own dtype.
    sync_module_states: every rank starts from rank 0's model: its shards of rank 0's full
        parameters, rank 0's replicated parameters and buffers (one scatter or broadcast per
        tensor, rank 0 sending about the model's size once; graphshard/initial_sync.py). False
        keeps what each rank built (then seed every rank alike).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"graphshard.shard expects an nn.Module, got {type(model).__name__}")
    strategy = ShardingStrategy.parse(strategy)
    policy = resolve_mixed_precision(mixed_precision, param_dtype, reduce_dtype)
    _check_not_wrapped(model)
    slots = list(_named_param_slots(model))
    _check_plain_parameters(model, slots)
    _check_dense_gradients(model)
    devices = {param.device for *_, param in slots}
    if len(devices) > 1:
        where = {str(d): next(f for _, _, f, p in slots if p.device == d) for d in devices}
        raise ValueError(
            f"parameters are on different devices ({where}); move the model to one device "
            "(e.g. model.to('cuda')) or build it on the meta device before sharding"
        )
    device_type = next(iter(devices)).type if devices else "cpu"
    if device_type == "meta":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if mesh is None:
        mesh = _default_mesh(device_type, strategy)
    if mesh.get_coordinate() is None:  # torch would fail later, in DeviceMesh.get_group
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not in the DeviceMesh over ranks "
            f"{mesh.mesh.flatten().tolist()}: call graphshard.shard only on the ranks of its mesh "
            "(every one of them, with the same model), or build the mesh over all the ranks "
            "that train")
    expected_ndim = 2 if strategy is ShardingStrategy.HYBRID_SHARD else 1
    if mesh.ndim != expected_ndim:
        raise ValueError(
            f"strategy {strategy.value!r} needs a {expected_ndim}-D DeviceMesh, got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
            + ("; use (replicate, shard) dims" if expected_ndim == 2 else
               "; use init_device_mesh(device, (world_size,))")
        )

    sharded: dict[int, nn.Parameter] = {}  # id(original) -> new: tied weights stay tied
    specs: dict[int, UnshardSpec] = {}
    per_module: dict[nn.Module, dict[str, UnshardSpec]] = {}
    for module, name, fqn, param in slots:
        if id(param) not in sharded:
            new_param, spec = _shard_param(param, fqn, len(sharded), mesh, strategy,
                                           _module_policy(module, policy))
            sharded[id(param)], specs[id(param)] = new_param, spec
            remember_replacement(param, new_param)  # for an optimizer created before shard()
        module._parameters[name] = sharded[id(param)]
        per_module.setdefault(module, {})[name] = specs[id(param)]
    if hasattr(model, "save_pretrained"):  # a root without parameters of its own, too
        per_module.setdefault(model, {})
    grad_sync = GradSync()
    for module, module_specs in per_module.items():
        object.__setattr__(module, SPECS_ATTR, module_specs)
        object.__setattr__(module, GRAD_SYNC_ATTR, grad_sync)
        module.__class__ = _sharded_class(type(module), tuple(sorted(module_specs)))
    bind_local_shards(model)
    object.__setattr__(model, STATE_ATTR, ShardState(mesh, strategy, policy, grad_sync))
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        model.register_forward_pre_hook(functools.partial(_cast_forward_inputs, policy.param_dtype),
                                        with_kwargs=True)
    if sync_module_states:
        from graphshard.initial_sync import sync_initial_state

        sync_initial_state(model, mesh, [(param, sharded[id(param)]) for *_, param in slots])
    update_live_optimizers()  # one built from model.parameters() before shard() now holds shards
    return model


def _cast_forward_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict
                         ) -> tuple[tuple, dict]:
    # A module-level function under functools.partial, not a closure: the model stays picklable.
    def to_compute(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tree_map(to_compute, (args, kwargs))


def _module_policy(module: nn.Module, policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """Normalisation layers with running statistics (BatchNorm, InstanceNorm) keep their
    parameters' dtype under param_dtype, as FSDP1's MixedPrecision leaves _BatchNorm alone:
    batch_norm needs its weight in the dtype of its fp32 running-statistics buffers (never cast)
    and takes a bf16 input. Cast, eager fails ("expected scalar type BFloat16 but found Float")
    and Inductor's decomposition computes in a mix of both."""
    if policy.param_dtype is not None and isinstance(module, nn.modules.batchnorm._NormBase):
        return replace(policy, param_dtype=None)
    return policy


def _shard_param(param: nn.Parameter, fqn: str, order: int, mesh: DeviceMesh,
                 strategy: ShardingStrategy, policy: MixedPrecisionPolicy
                 ) -> tuple[nn.Parameter, UnshardSpec]:
    shard_dim = mesh.ndim - 1  # the shard dimension is the last mesh dim
    shard_group = mesh.get_group(shard_dim)
    shard_size = mesh.size(shard_dim)
    replica_groups = [(mesh.get_group(d).group_name, mesh.size(d)) for d in range(mesh.ndim - 1)]
    sharded = strategy is not ShardingStrategy.NO_SHARD and param.dim() > 0
    if sharded:
        local = _local_dim0_slice(param.detach(), mesh.get_local_rank(shard_dim), shard_size)
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    else:
        # 0-dim parameters cannot be Shard(0); no_shard replicates everything (DDP).
        local = param.detach()
        placements = [Replicate()] * mesh.ndim
    dtensor = DTensor.from_local(
        local.clone(memory_format=torch.contiguous_format), mesh, placements,
        run_check=False, shape=param.shape, stride=_contiguous_strides(param.shape),
    )
    new_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    compute_dtype = policy.param_dtype if param.is_floating_point() else None
    spec = UnshardSpec(
        full_dim0=param.shape[0] if param.dim() else 0,
        gather_group=shard_group.group_name if sharded else "",
        gather_size=shard_size if sharded else 1,
        compute_dtype=compute_dtype if compute_dtype != param.dtype else None,
        reshard_after_forward=strategy.reshard_after_forward,
        reduce_groups=(shard_group.group_name, *(g for g, _ in replica_groups)),
        reduce_sizes=(shard_size, *(s for _, s in replica_groups)),
        scatter=sharded,
        reduce_dtype=policy.reduce_dtype if param.is_floating_point() else None,
        name=fqn,
        order=order,
        backend=dist.get_backend(shard_group),
        grad_enabled=True,
    )
    return new_param, spec
