"""A SimpleFSDP-style peer baseline: FSDP as DTensor redistributes that torch.compile traces.

Every parameter becomes an `nn.Parameter(DTensor)` sharded on dim 0. Each module's class is
swapped for a subclass with one property per parameter name; reading the attribute all-gathers
the shard (`redistribute` to Replicate) and hands the module a plain tensor whose gradient is
declared Partial, so autograd turns it back into a reduce-scatter onto the shard. The gather
is selectively checkpointed (recomputed in backward), so full weights are not held from forward
to backward. Under torch.compile the collectives appear in the graph, unbucketed (one per
parameter): the baseline graphshard's bucketing and reordering passes are measured against.

Written for the benchmarks after the SimpleFSDP paper and torchtitan's
`experiments/simple_fsdp/simple_fsdp.py`; FSDP (fully sharded) mode only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_POLICY_ATTR = "_simple_fsdp_policy"


@dataclass(frozen=True)
class Policy:
    """Mixed precision dtypes, and whether gathered weights are freed after forward."""

    param_dtype: torch.dtype | None = None  # dtype the gathered parameters are computed in
    reduce_dtype: torch.dtype | None = None  # dtype gradients are reduce-scattered in
    # full_shard: all-gather again in backward rather than saving the full weights
    reshard_after_forward: bool = True


_GATHER_OPS = (
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
)


def _recompute_gathers(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if op in _GATHER_OPS else CheckpointPolicy.PREFER_SAVE


def _gather_recompute_context():
    return create_selective_checkpoint_contexts(_recompute_gathers)


def replicate_for_compute(param: DTensor, policy: Policy) -> torch.Tensor:
    """All-gather a sharded parameter for compute; its gradient is reduce-scattered (averaged).

    `to_local(grad_placements=[Partial("avg")])` is what makes the backward a reduce-scatter:
    each rank's gradient of the full weight is only its partial contribution.
    """
    full = param.redistribute(
        placements=[Replicate()],
        forward_dtype=policy.param_dtype,
        backward_dtype=policy.reduce_dtype,
    )
    return full.to_local(grad_placements=[Partial("avg")])


def _parameter_property(name: str) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        param, policy = module._parameters[name], getattr(module, _POLICY_ATTR)
        if not policy.reshard_after_forward:
            return replicate_for_compute(param, policy)
        # Selective checkpoint of the gather alone: the backward all-gathers again, so the
        # full weight is not kept from forward to backward (as FSDP2's reshard_after_forward).
        return checkpoint(replicate_for_compute, param, policy, use_reentrant=False,
                          context_fn=_gather_recompute_context)

    return property(get)


@functools.lru_cache(maxsize=None)
def _sharded_class(cls: type, param_names: tuple[str, ...]) -> type:
    # Cached so every instance of a module type shares one class: torch.compile then reuses
    # the same guards and code for all blocks of a model instead of recompiling per block.
    properties = {name: _parameter_property(name) for name in param_names}
    return type(f"SimpleFSDP{cls.__name__}", (cls,), properties)


def data_parallel(
    model: nn.Module, mesh: DeviceMesh, policy: Policy = Policy()
) -> nn.Module:
    """Shard `model` in place, SimpleFSDP style, over the 1-D `mesh`; returns `model`."""
    if mesh.ndim != 1:
        raise ValueError(f"simple_fsdp.data_parallel needs a 1-D mesh, got {mesh.ndim}-D")
    sharded_by_id: dict[int, nn.Parameter] = {}  # tied weights stay tied: shard each once
    for module_name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params or type(module).__name__.startswith("SimpleFSDP"):
            continue
        for name, param in params.items():
            if param.dim() == 0:
                raise ValueError(
                    f"parameter {module_name}.{name} is 0-dim and cannot be sharded on dim 0; "
                    "this baseline supports parameters with at least one dimension"
                )
            if id(param) not in sharded_by_id:
                sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
                sharded_by_id[id(param)] = nn.Parameter(sharded, param.requires_grad)
            module.register_parameter(name, sharded_by_id[id(param)])
        setattr(module, _POLICY_ATTR, policy)
        module.__class__ = _sharded_class(type(module), tuple(params))
    return model
