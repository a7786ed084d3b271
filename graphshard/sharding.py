"""`graphshard.shard`: turn every parameter of a model into a DTensor shard, in place.

shard() checks the model and the mesh, replaces each parameter by an `nn.Parameter` wrapping a
DTensor (Shard(0) on the shard mesh dimension), gives each module that owns one a generated
class whose properties return the gathered parameter (graphshard/runtime/sharded_class.py), and
leaves one `ShardState` on the model (graphshard/state.py).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from graphshard._transformers import is_transformers_model
from graphshard import _torch_compat as compat
from graphshard._torch_compat import is_norm_with_running_stats, tree_map
from graphshard.compiler import rank_agreement
from graphshard.early_optimizers import remember_replacement, update_live_optimizers
from graphshard.float8 import unwrap_float8_weights
from graphshard.passes.markers import UnshardSpec
from graphshard.policy import MixedPrecisionPolicy, ShardingStrategy, resolve_mixed_precision
from graphshard.runtime.gathered_weight import GatheredWeight
from graphshard.runtime.local_shards import LocalShard, bind_local_shard
from graphshard.runtime.parts import contiguous_strides, local_dim0_slice
from graphshard.runtime.sharded_class import sharded_class
from graphshard.tensor_parallel import (TensorParallelLayout, combined_mesh,
                                        data_parallel_shard_placement, layout_of,
                                        one_tensor_parallel_mesh, replicated_layout)
from graphshard.state import (MODULE_ATTR, STATE_ATTR, ModuleShards, ShardState, is_sharded,
                              module_shards, shard_state, sharded_modules)

__all__ = ["shard", "is_sharded", "shard_state", "bind_local_shards", "GatheredWeight",
           "ShardState"]


def bind_local_shards(model: nn.Module) -> None:
    """(Re)bind every sharded module's local shards to its current parameters, one per
    parameter object (tied weights share one). Called by shard(), materialize() and loading
    pretrained weights, after they replace parameters."""
    bound: dict[int, LocalShard] = {}
    for module, record in sharded_modules(model):
        shards = {}
        for name in record.specs:
            param = module._parameters[name]
            if id(param) not in bound:
                bound[id(param)] = bind_local_shard(param, record.specs[name].graph_rows)
            shards[name] = bound[id(param)]
        record.shards = shards


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


def _check_not_sharded_twice(model: nn.Module, slots: list) -> None:
    if is_sharded(model) or any(module_shards(m) is not None for m, *_ in slots):
        raise ValueError("model is already sharded by graphshard (it, or the model it belongs "
                         "to, went through graphshard.shard); call graphshard.shard once per model")


def _tensor_parallel_layouts(slots: list, mesh: DeviceMesh) -> dict[int, TensorParallelLayout]:
    """id(parameter) -> its TP layout, for each parameter a TP plan made a DTensor."""
    layouts, names = {}, {}
    for _, _, fqn, param in slots:
        if isinstance(param, DTensor) and id(param) not in layouts:
            layouts[id(param)], names[id(param)] = layout_of(param, fqn, mesh), fqn
    tp_mesh = one_tensor_parallel_mesh(layouts, names)
    if tp_mesh is not None:
        for *_, param in slots:
            if id(param) not in layouts:
                layouts[id(param)] = replicated_layout(param, tp_mesh)
    return layouts


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


def model_device_type(model: nn.Module) -> str:
    """The device type of a mesh over `model`'s parameters (a meta model's: "cuda" where there
    is a GPU, else "cpu")."""
    return _device_type(list(_named_param_slots(model)))


def _device_type(slots) -> str:
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
    return device_type


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
    float8 = unwrap_float8_weights(model)  # id(parameter) -> float8 gather dtype
    slots = list(_named_param_slots(model))
    _check_not_sharded_twice(model, slots)
    _check_dense_gradients(model)
    device_type = _device_type(slots)
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

    layouts = _tensor_parallel_layouts(slots, mesh)
    sharded: dict[int, nn.Parameter] = {}  # id(original) -> new: tied weights stay tied
    specs: dict[int, UnshardSpec] = {}
    per_module: dict[nn.Module, dict[str, UnshardSpec]] = {}
    module_layouts: dict[nn.Module, dict[str, TensorParallelLayout]] = {}
    index = _model_index()
    for module, name, fqn, param in slots:
        layout = layouts.get(id(param))
        if id(param) not in sharded:
            new_param, spec = _shard_param(param, fqn, (len(sharded), index), mesh, strategy,
                                           _module_policy(module, policy), layout,
                                           float8.get(id(param)))
            sharded[id(param)], specs[id(param)] = new_param, spec
            remember_replacement(param, new_param)  # for an optimizer created before shard()
        module._parameters[name] = sharded[id(param)]
        per_module.setdefault(module, {})[name] = specs[id(param)]
        if layout is not None and layout.parallel:
            module_layouts.setdefault(module, {})[name] = layout
    for module in model.modules():  # every Hugging Face model in it refuses save_pretrained,
        if is_transformers_model(module):  # one without parameters of its own (the root) too
            per_module.setdefault(module, {})
    state = ShardState(mesh, strategy, policy)
    for module, module_specs in per_module.items():
        object.__setattr__(module, MODULE_ATTR, ModuleShards(
            module_specs, {}, state, tensor_parallel=module_layouts.get(module, {})))
        module.__class__ = sharded_class(type(module), tuple(sorted(module_specs)))
    bind_local_shards(model)
    object.__setattr__(model, STATE_ATTR, state)
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        model.register_forward_pre_hook(functools.partial(_cast_forward_inputs, policy.param_dtype),
                                        with_kwargs=True)
    if sync_module_states:
        from graphshard.initial_sync import sync_across_tensor_parallel, sync_initial_state

        sync_initial_state(model, mesh, [(_tensor_parallel_piece(param), sharded[id(param)])
                                         for *_, param in slots])
        if layouts:  # what the TP plan left replicated, alike on every TP rank
            tp_mesh = compat.root_mesh(mesh)[next(iter(layouts.values())).mesh.mesh_dim_names]
            sync_across_tensor_parallel(model, tp_mesh, [
                sharded[id(param)] for *_, param in slots if not layouts[id(param)].parallel])
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
    if policy.param_dtype is not None and is_norm_with_running_stats(module):
        return replace(policy, param_dtype=None)
    return policy


def _tensor_parallel_piece(param: nn.Parameter) -> torch.Tensor:
    """What graphshard shards of `param`: this rank's TP piece, or the whole parameter."""
    return param.to_local() if isinstance(param, DTensor) else param


def _model_index() -> int:
    """This model's index among the models shard() made in this process, in program order:
    alike on every rank, which shard the same models in the same order. Counted per rank in
    the store ranks agree through (no module state); 0 where a process decides alone."""
    store = rank_agreement.agreement_store()
    if store is None:
        return 0
    return store.add(f"graphshard/models/{dist.get_rank()}", 1) - 1


def _shard_param(param: nn.Parameter, fqn: str, order: tuple[int, int], mesh: DeviceMesh,
                 strategy: ShardingStrategy, policy: MixedPrecisionPolicy,
                 layout: TensorParallelLayout | None, float8_dtype: torch.dtype | None = None
                 ) -> tuple[nn.Parameter, UnshardSpec]:
    whole, requires_grad = param, param.requires_grad
    param = _tensor_parallel_piece(param)
    shard_dim = mesh.ndim - 1  # the shard dimension is the last data-parallel mesh dim
    shard_group = mesh.get_group(shard_dim)
    shard_size = mesh.size(shard_dim)
    # names alike on every rank (the graphs then name no rank: one compile per host)
    shard_group_name = compat.rank_invariant_group_name(mesh, shard_dim)
    replica_groups = [(compat.rank_invariant_group_name(mesh, d), mesh.size(d))
                      for d in range(mesh.ndim - 1)]
    sharded = strategy is not ShardingStrategy.NO_SHARD and param.dim() > 0
    if sharded:
        local = local_dim0_slice(param.detach(), mesh.get_local_rank(shard_dim), shard_size)
        placements = [Replicate()] * (mesh.ndim - 1) + [data_parallel_shard_placement(layout)]
    else:
        # 0-dim parameters cannot be Shard(0); no_shard replicates everything (DDP).
        local = param.detach()
        placements = [Replicate()] * mesh.ndim
    param_mesh = mesh
    if layout is not None:  # one DTensor over the data-parallel dims, then the TP dims
        param_mesh, placements = combined_mesh(mesh, layout), placements + list(layout.placements)
    dtensor = DTensor.from_local(
        local.clone(memory_format=torch.contiguous_format), param_mesh, placements,
        run_check=False, shape=whole.shape, stride=contiguous_strides(whole.shape),
    )
    new_param = nn.Parameter(dtensor, requires_grad=requires_grad)
    compute_dtype = policy.param_dtype if param.is_floating_point() else None
    spec = UnshardSpec(
        full_dim0=param.shape[0] if param.dim() else 0,
        gather_group=shard_group_name if sharded else "",
        gather_size=shard_size if sharded else 1,
        compute_dtype=compute_dtype if compute_dtype != param.dtype else None,
        reshard_after_forward=strategy.reshard_after_forward,
        reduce_groups=(shard_group_name, *(g for g, _ in replica_groups)),
        reduce_sizes=(shard_size, *(s for _, s in replica_groups)),
        scatter=sharded,
        reduce_dtype=policy.reduce_dtype if param.is_floating_point() else None,
        name=fqn,
        order=order[0],
        model=order[1],
        backend=dist.get_backend(shard_group),
        grad_enabled=True,
        float8_dtype=float8_dtype,
    )
    return new_param, spec
