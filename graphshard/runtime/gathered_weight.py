"""`GatheredWeight`: what eager code reads as `module.weight` on a sharded module.

The gathered full weight, whose in-place edits are written back to this rank's shard, as they
would be kept by an unsharded parameter (nn.init, `.data.copy_`, Hugging Face's init).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from graphshard._torch_compat import (run_eagerly_when_called_from_eager_code, tree_leaves,
                                      tree_map_only, version_counter, wrapper_tensor,
                                      written_arguments)
from graphshard.runtime.parts import data_parallel_part, dtensor_part
from graphshard.state import module_shards


def eager_when_not_inlined(fn: Callable) -> Callable:
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
            self._param_version = version_counter(param)  # the shard this read gathered
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
        # a TP parameter's read is its TP piece; graphshard's shard is cut from that
        tensor_parallel = module_shards(self._module).tensor_parallel.get(self._attr)
        shape = param.shape if tensor_parallel is None else tensor_parallel.piece_shape()
        if root._full.shape != shape:  # t_(), resize_(), squeeze_() on the read
            raise ValueError(
                f"graphshard: {where} was reshaped in place to {tuple(root._full.shape)}; a "
                f"sharded parameter keeps its shape {tuple(shape)}. Assign a new "
                f"parameter instead (module.{self._attr} = nn.Parameter(...), the same on every "
                "rank), or reshape before graphshard.shard.")
        if version_counter(param) != root._param_version:
            raise ValueError(
                f"graphshard: {where} was edited in place through a read made before the "
                "parameter last changed (an optimizer step, a load, an edit through another "
                f"read): writing it back would undo that change. Read {self._attr} again, "
                "after the change, and edit that.")
        with torch.no_grad():
            if tensor_parallel is None:
                param.copy_(dtensor_part(root._full, param, own_storage=False))
            else:
                param.copy_(data_parallel_part(root._full, param, tensor_parallel.mesh.ndim))
        root._param_version = version_counter(param)

    @classmethod
    @eager_when_not_inlined
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


class GatheredWeightGrad(torch.autograd.Function):
    """`GatheredWeight` around a gathered weight, passing gradients through to the gather."""

    @staticmethod
    def forward(ctx, full, param, module, name):
        return GatheredWeight(full, param, module, name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None
