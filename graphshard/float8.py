"""Float8 training with float8 all-gather: torchao's `Float8Linear` weights under graphshard.

`torchao.float8.convert_to_float8_training(model, config=Float8LinearConfig(
enable_fsdp_float8_all_gather=True))` wraps each converted weight in torchao's
`WeightWithDynamicFloat8CastTensor`. shard() unwraps it (the sharded parameter, what the
optimizer and checkpoints see, is the high-precision master weight) and marks the weight's
spec `float8_dtype`. Each read of such a weight then:

    scale = graphshard::float8_scale(shard)   amax of the whole weight: local amax, all-reduce MAX
    data  = shard cast to float8 with scale   (torchao's saturated cast)
    full  = graphshard::unshard(data)         the all-gather moves float8, 1 byte per element
    Float8TrainingTensor(full, scale)         fed to Float8Linear's float8 matmul as it is

which is what torchao's FSDP2 path computes (fsdp_pre_all_gather / fsdp_post_all_gather with
precompute_float8_dynamic_scale_for_fsdp), with the scale computed in the graph at every read:
no call after the optimizer step. The weight's gradient is reduced in high precision as usual.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from graphshard import _torch_compat as compat
from graphshard.compiler.ops import call_float8_scale, call_reduce_grad, call_unshard
from graphshard.passes.markers import ReduceSpec, UnshardSpec
from graphshard.state import GradSync, SyncMode

_FSDP_UTILS = "torchao.float8.fsdp_utils"

if TYPE_CHECKING:
    from graphshard.tensor_parallel import TensorParallelLayout


def _torchao_weight_class() -> type | None:
    # Only a model converted by torchao holds its weights: no torchao import otherwise.
    module = sys.modules.get(_FSDP_UTILS)
    return module.WeightWithDynamicFloat8CastTensor if module is not None else None


def unwrap_float8_weights(model: nn.Module) -> dict[int, torch.dtype]:
    """Replace each torchao float8 all-gather weight by an nn.Parameter of its high-precision
    tensor; returns id(new parameter) -> the float8 dtype it is gathered in. Refuses what
    graphshard does not gather in float8, saying what to do."""
    weight_class = _torchao_weight_class()
    if weight_class is None:
        return {}
    from torchao.float8.float8_linear import Float8Linear

    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None and isinstance(_local(param), weight_class):
                fqn = f"{module_name}.{name}" if module_name else name
                owners.setdefault(id(param), []).append((fqn, module, name))
                params[id(param)] = param
    float8: dict[int, torch.dtype] = {}
    for key, slots in owners.items():
        for fqn, module, name in slots:
            _check_supported(fqn, module, name, Float8Linear)
        old = params[key]
        # torchao's weight has no public accessor of its tensor and float8 dtype; these are
        # the fields its own __tensor_flatten__ and FSDP2 hooks read.
        weight = _local(old)
        tensor = weight._tensor.detach()
        if isinstance(old, DTensor):  # a TP piece: the same DTensor over the plain tensor
            tensor = DTensor.from_local(tensor, old.device_mesh, old.placements, run_check=False,
                                        shape=old.shape, stride=old.stride())
        new = nn.Parameter(tensor, requires_grad=old.requires_grad)
        for _, module, name in slots:
            module._parameters[name] = new
        float8[id(new)] = weight._dtype
    return float8


def _local(param: torch.Tensor) -> torch.Tensor:
    """A TP parameter's local piece (torchao's float8 weight sits inside the DTensor)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _check_supported(fqn: str, module: nn.Module, name: str, float8_linear: type) -> None:
    if not isinstance(module, float8_linear) or name != "weight":
        raise ValueError(
            f"graphshard.shard: parameter {fqn!r} is a torchao float8 all-gather weight "
            f"(WeightWithDynamicFloat8CastTensor) read by {type(module).__name__}.{name}, not by "
            "a Float8Linear's weight; graphshard gathers in float8 only the weights Float8Linear "
            "consumes. Untie it from other modules (or exclude its Linear from "
            "convert_to_float8_training with module_filter_fn)")
    config = module.config
    if config.round_scales_to_power_of_2:
        raise ValueError(
            f"graphshard.shard: {fqn!r} is converted with round_scales_to_power_of_2=True and "
            "enable_fsdp_float8_all_gather=True; graphshard's float8 gather computes torchao's "
            "tensorwise weight scale without rounding (as torchao's FSDP2 path does). Use "
            "Float8LinearConfig(enable_fsdp_float8_all_gather=True) with "
            "round_scales_to_power_of_2=False, or enable_fsdp_float8_all_gather=False (the "
            "weight is then gathered in high precision and cast in the matmul)")


class _ShardGradient(torch.autograd.Function):
    """A full-shape stand-in for the weight, to autograd only (an expanded zero, no storage):
    the gradient it receives is the full weight's, reduced and handed to `target` (the local
    shard; with gradient accumulation, the accumulation leaf of graphshard/grad_sync.py)."""

    @staticmethod
    def forward(ctx, target, shape, dtype, reduce: ReduceSpec | None):
        ctx.reduce, ctx.target_dtype = reduce, target.dtype
        return target.new_zeros((), dtype=dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce is None:  # no_sync: the full gradient accumulates unreduced
            return grad.to(ctx.target_dtype), None, None, None
        return call_reduce_grad(grad, ctx.reduce), None, None, None


class _Float8Weight(torch.autograd.Function):
    """The gathered float8 data and its scale as torchao's Float8TrainingTensor, differentiable
    with respect to `stand_in` (the gradient passes through, high precision, as torchao's own
    float8 construction passes it)."""

    @staticmethod
    def forward(ctx, stand_in, data, scale, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, stand_in.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def _gradient_target(local: torch.Tensor, spec: UnshardSpec, sync: GradSync
                     ) -> tuple[torch.Tensor, ReduceSpec | None]:
    """Where the weight's gradient goes in the current sync mode, and how it is reduced there
    (the same routes as graphshard/grad_sync.py's for the other parameters)."""
    local_dim0 = local.shape[0]
    if local.requires_grad and torch.is_grad_enabled():
        if sync.mode is SyncMode.NO_SYNC:
            return sync.full_leaves[spec.name], None
        if sync.mode is SyncMode.NO_ALL_REDUCE and len(spec.reduce_groups) > 1:
            leaf = sync.partial_leaves[spec.name]
            return leaf, spec.reduce_spec(local_dim0, leaf.dtype, shard_group_only=True)
    return local, spec.reduce_spec(local_dim0, local.dtype)


def read_float8_weight(module: nn.Module, local: torch.Tensor, spec: UnshardSpec,
                       sync: GradSync, tensor_parallel: "TensorParallelLayout | None" = None
                       ) -> torch.Tensor:
    """The full weight of a Float8Linear, gathered in float8 (module docstring). Under tensor
    parallelism: this rank's TP piece, scaled by the amax of the whole weight (the minimum
    scale over the TP group: the scale falls as the amax grows), as the TP plan's DTensor."""
    from torchao.float8.float8_utils import to_fp8_saturated

    master = local.detach()
    scale = call_float8_scale(master, spec)
    if tensor_parallel is not None:
        scale = compat.all_reduce_min(scale, tensor_parallel.mesh)
    data = to_fp8_saturated(master.to(torch.float32) * scale, spec.float8_dtype)
    full = call_unshard(data, spec)
    target, reduce = _gradient_target(local, spec, sync)
    stand_in = _ShardGradient.apply(target, full.shape, spec.compute_dtype or local.dtype, reduce)
    weight = _Float8Weight.apply(stand_in, full, scale, module.linear_mm_config)
    return weight if tensor_parallel is None else tensor_parallel.wrap(weight)
