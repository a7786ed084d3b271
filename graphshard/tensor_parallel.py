"""Tensor parallelism under graphshard: parameters a TP plan already made DTensors.

The user parallelises with torch's own API on the "tp" dimension of a mesh and shards with
graphshard on its data-parallel dimensions, as with FSDP2:

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"attn.q": ColwiseParallel(), ...})
    graphshard.shard(model, mesh["dp"])

A TP parameter's local tensor (this rank's TP piece) is what graphshard shards on dim 0 over
the data-parallel dimensions; the parameter becomes one DTensor over both, data-parallel
dimensions first, so optimizers, clip_grad_norm_, full_tensor() and DCP see the whole weight.
When a TP piece is itself cut on dim 0 (ColwiseParallel), the data-parallel cut of it is a
`_StridedShard` (FSDP2's layout for the same thing). A compiled graph still reads the plain
local shard: the unshard marker gathers the TP piece over the data-parallel group, and the
parameter read wraps it back into a DTensor on the TP mesh (`TensorParallelLayout.wrap`), so
the TP plan's DTensor ops trace into the graph as functional collectives beside graphshard's.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from graphshard import _torch_compat as compat


@dataclass(frozen=True, eq=False)
class TensorParallelLayout:
    """How a TP parameter's gathered piece is laid out on its TP mesh."""

    mesh: DeviceMesh  # the TP (sub)mesh the plan parallelised on
    placements: tuple[Placement, ...]
    shape: torch.Size  # the whole parameter's
    stride: tuple[int, ...]
    # False for a parameter outside the TP plan in a model with TP parameters: it is
    # replicated over the TP dims and computes as a plain tensor.
    parallel: bool = True

    def wrap(self, piece: torch.Tensor) -> DTensor:
        """This rank's gathered TP piece as the DTensor the TP plan's modules compute with."""
        return DTensor.from_local(piece, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def piece_shape(self) -> torch.Size:
        """The shape of this rank's TP piece (what the parameter read gathers)."""
        shape = list(self.shape)
        for d, placement in enumerate(self.placements):
            if placement.is_shard():
                shape[placement.dim] //= self.mesh.size(d)
        return torch.Size(shape)

    def dim0_split(self) -> int:
        """Into how many pieces TP cuts dim 0 (ColwiseParallel: the TP degree; else 1)."""
        return prod(self.mesh.size(d) for d, p in enumerate(self.placements)
                    if p.is_shard() and p.dim == 0)


def layout_of(param: DTensor, fqn: str, dp_mesh: DeviceMesh) -> TensorParallelLayout:
    """`param`'s TP layout, after checking that it composes with sharding over `dp_mesh`."""
    tp_mesh = param.device_mesh
    _check_sibling_meshes(fqn, param, dp_mesh)
    for d, placement in enumerate(param.placements):
        if type(placement) is Shard:
            size, parts = param.shape[placement.dim], tp_mesh.size(d)
            if size % parts:
                raise ValueError(
                    f"graphshard.shard: parameter {fqn!r} (shape {tuple(param.shape)}) is cut on "
                    f"dim {placement.dim} over {parts} TP ranks, but its size there ({size}) is "
                    f"not divisible by {parts}: choose a TP degree that divides the layer's "
                    "width (heads, hidden and intermediate sizes), or leave this module out of "
                    "the TP plan")
        elif type(placement) is not Replicate:
            raise ValueError(
                f"graphshard.shard: parameter {fqn!r} has placement {placement} on TP mesh "
                f"dim {tp_mesh.mesh_dim_names[d]!r}; graphshard composes with TP parameters "
                "cut with Shard(dim) or replicated (ColwiseParallel, RowwiseParallel, "
                "SequenceParallel), not with partial or strided ones")
    return TensorParallelLayout(tp_mesh, tuple(param.placements), param.shape, param.stride())


def replicated_layout(param: torch.Tensor, tp_mesh: DeviceMesh) -> TensorParallelLayout:
    """The layout of a parameter the TP plan left alone, in a model with TP parameters: every
    parameter then lives on the one (data-parallel, TP) mesh, so clip_grad_norm_ and other
    foreach ops over all parameters see one mesh, as over a TP plan that covers every module."""
    return TensorParallelLayout(tp_mesh, (Replicate(),) * tp_mesh.ndim, param.shape,
                                param.stride(), parallel=False)


def one_tensor_parallel_mesh(layouts: dict, names: dict[int, str]) -> DeviceMesh | None:
    """The TP mesh every TP parameter shares (None without TP parameters)."""
    meshes = {}
    for key, layout in layouts.items():
        meshes.setdefault((layout.mesh.mesh_dim_names, tuple(layout.mesh.mesh.flatten().tolist())),
                          (layout.mesh, names[key]))
    if len(meshes) > 1:
        found = ", ".join(f"{fqn!r} on {dims}" for (dims, _), (_, fqn) in meshes.items())
        raise ValueError(f"graphshard.shard: the TP parameters lie on different meshes ({found}); "
                         "parallelise every module on the same TP mesh")
    return next(iter(meshes.values()))[0] if meshes else None


def _check_sibling_meshes(fqn: str, param: DTensor, dp_mesh: DeviceMesh) -> None:
    tp_mesh = param.device_mesh
    recipe = ("build both from one mesh, e.g. mesh = init_device_mesh(device, (dp, tp), "
              "mesh_dim_names=('dp', 'tp')), parallelise on mesh['tp'] and call "
              "graphshard.shard(model, mesh['dp'])")
    if tp_mesh.mesh_dim_names is None or dp_mesh.mesh_dim_names is None:
        raise ValueError(f"graphshard.shard: parameter {fqn!r} is already a DTensor "
                         f"({tuple(param.placements)} on {tp_mesh}); graphshard composes with a "
                         "TP plan only on named meshes, and this mesh or the data-parallel mesh "
                         f"has no dimension names: {recipe}")
    root = compat.root_mesh(dp_mesh)
    names = root.mesh_dim_names
    if not set(dp_mesh.mesh_dim_names) <= set(names):
        raise ValueError(
            f"graphshard.shard: the data-parallel mesh's dims {dp_mesh.mesh_dim_names} are not "
            f"dims of the mesh {names} it was sliced from (a flattened mesh); with TP pass the "
            "data-parallel dims themselves: mesh['dp'], or mesh['replicate', 'shard'] with "
            "strategy='hybrid_shard'")
    # The TP mesh must be the dp mesh's sibling: the same ranks as slicing the dp mesh's root
    # by the TP mesh's names (torch may hand out an equal slice of another root it cached).
    if not set(tp_mesh.mesh_dim_names) <= set(names) or not torch.equal(
            root[tp_mesh.mesh_dim_names].mesh, tp_mesh.mesh):
        raise ValueError(
            f"graphshard.shard: parameter {fqn!r} is a DTensor on mesh "
            f"{tp_mesh.mesh_dim_names} over ranks {tp_mesh.mesh.flatten().tolist()}, which is "
            f"not a sibling of the data-parallel mesh {dp_mesh.mesh_dim_names} (not sliced "
            f"from the same DeviceMesh {names}): {recipe}")
    shared = set(tp_mesh.mesh_dim_names) & set(dp_mesh.mesh_dim_names)
    if shared:
        raise ValueError(
            f"graphshard.shard: parameter {fqn!r} is parallelised over mesh dims "
            f"{sorted(shared)}, which the data-parallel mesh {dp_mesh.mesh_dim_names} also "
            f"holds: a mesh dimension is either tensor- or data-parallel; {recipe}")
    if max(names.index(n) for n in dp_mesh.mesh_dim_names) > min(
            names.index(n) for n in tp_mesh.mesh_dim_names):
        raise ValueError(
            f"graphshard.shard: the data-parallel mesh dims {dp_mesh.mesh_dim_names} must come "
            f"before the TP dims {tp_mesh.mesh_dim_names} in the mesh {names} (TP innermost, "
            "within a node, as FSDP2 + TP lays it out): build the mesh as (dp, tp)")


def combined_mesh(dp_mesh: DeviceMesh, layout: TensorParallelLayout) -> DeviceMesh:
    """The mesh of data-parallel dims followed by the TP dims, sliced from their root."""
    return compat.root_mesh(dp_mesh)[(*dp_mesh.mesh_dim_names, *layout.mesh.mesh_dim_names)]


def data_parallel_shard_placement(layout: TensorParallelLayout | None) -> Placement:
    """The data-parallel cut of dim 0: of the TP piece, so strided where TP cuts dim 0 too."""
    split = layout.dim0_split() if layout is not None else 1
    return Shard(0) if split == 1 else compat.strided_shard(0, split)


def tensor_parallel_params(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
