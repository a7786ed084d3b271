"""This rank's part of a full tensor, cut as graphshard.shard cuts it: torch.chunk along dim 0
over the shard (last) mesh dimension, or whole where the parameter is replicated."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from graphshard import _torch_compat as compat


def local_dim0_slice(full: torch.Tensor, coordinate: int, size: int) -> torch.Tensor:
    """The `coordinate`-th of `size` torch.chunk pieces of `full` along dim 0 (empty past the
    last piece: uneven shards)."""
    chunks = torch.chunk(full, size, dim=0)
    if coordinate < len(chunks):
        return chunks[coordinate]
    return full.new_empty((0, *full.shape[1:]))


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    # The local shard is a contiguous clone, so the global layout is contiguous too (the
    # original parameter may have been a transposed view).
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def cut_dim(placement) -> int | None:
    """The tensor dim a placement cuts (Shard, or the strided data-parallel cut of a TP
    piece), or None where it replicates."""
    if placement.is_shard() or compat.is_strided_shard(placement):
        return placement.dim
    return None


def this_rank_part(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's local shard of `full` (`param`'s global shape), on `param`'s device: cut as
    the placements were applied, the innermost mesh dim first (TP, then graphshard's dim-0 cut
    over the data-parallel dims), each a torch.chunk."""
    mesh = param.device_mesh
    part = full.detach()
    for mesh_dim in reversed(range(mesh.ndim)):
        dim = cut_dim(param.placements[mesh_dim])
        if dim is not None:
            part = local_slice(part, dim, mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim))
    local = param.to_local()
    return part.to(torch.device(mesh.device_type) if local.is_meta else local.device)


def data_parallel_part(piece: torch.Tensor, param: nn.Parameter, tp_ndim: int) -> DTensor:
    """This rank's shard of its TP piece `piece` (what a TP parameter's read gathers) as a
    DTensor laid out like `param`: only the data-parallel dims' cuts, innermost first."""
    mesh = param.device_mesh
    part = piece.detach()
    for mesh_dim in reversed(range(mesh.ndim - tp_ndim)):
        dim = cut_dim(param.placements[mesh_dim])
        if dim is not None:
            part = local_slice(part, dim, mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim))
    return DTensor.from_local(part, mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def local_slice(full: torch.Tensor, dim: int, coordinate: int, size: int) -> torch.Tensor:
    """local_dim0_slice along `dim`."""
    if dim == 0:
        return local_dim0_slice(full, coordinate, size)
    return local_dim0_slice(full.transpose(0, dim), coordinate, size).transpose(0, dim)


def dtensor_part(full: torch.Tensor, param: nn.Parameter, own_storage: bool) -> DTensor:
    """This rank's part of `full` as a DTensor laid out like `param`."""
    part = this_rank_part(full, param)
    if own_storage:
        part = part.clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(part, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
