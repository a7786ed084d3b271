"""Process groups, device meshes and DTensor internals.

Part of graphshard._torch_compat (see its docstring): every public name here is re-exported there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_invariant_group_name(mesh, dim: int) -> str:
    """The name graphshard's graphs give this rank's process group along `dim` of `mesh`. Where
    the mesh has several groups along `dim` (hybrid sharding's replica and shard groups), each
    rank's own has its own c10d name, which would make every rank's graphs its own; so every
    rank registers its group under one alias, alike on all of them (the mesh's layout and the
    dim), and c10d resolves the alias to the rank's own group when a collective runs. Where
    the group spans the whole mesh, its own name is already alike on every rank.
    Public replacement: none (c10d's process-group registry)."""
    import hashlib

    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

    group = mesh.get_group(dim)
    if mesh.size(dim) == mesh.size():
        return group.group_name
    layout = repr((mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names))
    alias = f"graphshard:mesh-{hashlib.sha256(layout.encode()).hexdigest()[:16]}:dim-{dim}"
    try:
        _resolve_process_group(alias)  # an equal mesh made again: its groups have the same ranks
    except RuntimeError:  # not registered yet (destroy_process_group() clears the registry)
        _register_process_group(alias, group)
    return alias


def process_group_size(group_name: str) -> int:
    """Size of a live process group known only by the name a functional collective carries
    (all_reduce nodes carry no size). Public replacement: none (groups by name are private)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def process_group_rank(group_name: str) -> int:
    """This process's rank in a live process group known only by its name (as above)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).rank()


def process_group(group_name: str):
    """A live process group known only by its name (as above): the eager collectives' tag
    exchange runs on it. Public replacement: none."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def process_group_ranks(group_name: str) -> list[int]:
    """The global ranks of a live process group known only by its name (as above)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group of any world size in one process, whose collectives do nothing: how
    `graphshard dump` traces a cluster it does not have. Public replacement: the "fake" backend
    is built in, but is registered (with its store) only by torch's testing package."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def sharded_like(param, local: torch.Tensor):
    """`local` (this rank's shard, param's dtype and local shape) as a DTensor laid out like the
    DTensor `param`, without DTensor.from_local's autograd Function and spec building: ~4 us
    against ~40 us, for every gradient of every step. Public replacement: DTensor.from_local."""
    from torch.distributed.tensor import DTensor

    if local.dtype != param.dtype or local.shape != param._local_tensor.shape:
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return DTensor(local, param._spec, requires_grad=False)


def set_local_tensor(param, local: torch.Tensor) -> None:
    """Make the DTensor `param` hold `local` (its dtype, device and local shape; other storage)
    as its local shard, the parameter object and its global metadata unchanged. Public
    replacement: torch.utils.swap_tensors with a new DTensor, which also swaps the autograd
    metadata (hooks, the optimizer's identity checks) that must stay."""
    old = param._local_tensor
    if (local.dtype, local.device, local.shape) != (old.dtype, old.device, old.shape):
        raise ValueError(f"graphshard: a local shard {tuple(local.shape)} {local.dtype} cannot "
                         f"replace {tuple(old.shape)} {old.dtype}")
    param._local_tensor = local


def root_mesh(mesh):
    """The DeviceMesh `mesh` was sliced from (itself if not). Public replacement: none."""
    return mesh._get_root_mesh()


def strided_shard(dim: int, split_factor: int):
    """A data-parallel cut of a TP piece cut on the same dim (FSDP2 + TP's layout). Public
    replacement: none."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding results, keyed by mesh equality (ranks, names: not groups):
    after a fake process group is remade (dump, plan) they would name dead groups. Public
    replacement: none."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()


def all_reduce_min(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """The elementwise minimum of `tensor` over the 1-D `mesh`, as a traceable functional
    collective (a float8 weight's scale over its TP group). Public replacement: none
    (torch.distributed's all_reduce is in place and not traced as a graph collective)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(tensor, "min", mesh)


def is_strided_shard(placement) -> bool:
    """Whether `placement` is a `_StridedShard` (not is_shard()). Public replacement: none."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def default_store():
    """The default process group's key-value store: ranks compare their compiled schedules
    through it, without a collective (a rank recompiling alone must not wait for the others).
    Public replacement: none (torch.distributed exposes no accessor for the default store)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
