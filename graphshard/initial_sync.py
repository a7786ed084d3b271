"""Same initial model on every rank: what `graphshard.shard(model, sync_module_states=True)` does.

shard() slices whatever each rank built. Ranks that were not seeded alike would hold slices of
different full tensors, and their replicated parameters (0-dim ones, all of them under
`no_shard`) and buffers would differ for the whole run, silently: each rank would train a model
of its own. So, as DDP broadcasts from rank 0 at construction (FSDP1: `sync_module_states`),
every rank takes rank 0's model, sent as shards, never in full to every rank:

- a sharded parameter: one scatter per parameter over rank 0's shard group (rank 0 sends the
  (S-1)/S of its full tensor that it does not keep; each rank receives only its own shard);
- a replicated parameter, a buffer: one broadcast each;
- on a 2-D (replicate, shard) mesh, rank 0's shard group then passes its shards on to the other
  replica groups, one broadcast of each shard along the replicate dimension.

"Rank 0" is the mesh's rank at coordinate (0, ...): global rank 0 for the default mesh. All in
place, into each DTensor parameter's local tensor: parameter objects are never replaced (the
local-shard leaves the compiled graph reads share their storage).

Cost: one collective per parameter and per buffer (one more per parameter across replica groups
on a hybrid mesh); rank 0 sends about the model's size once and holds one padded copy of one
parameter at a time; every other rank receives its shards and the replicated tensors. For the
demo Transformer (3.4 M parameters in 53 tensors) at world size 2 that is 40-60 ms on gloo.

A model on the meta device holds nothing to send. Its values are drawn later by
`graphshard.materialize`, which initialises full tensors module by module from the default
random generator, the same draws at any world size; so shard() instead gives every rank rank 0's
default generator states (CPU, and the accelerator's for a non-CPU mesh), and materialize()
then builds rank 0's model on every rank, whatever each rank was seeded with.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from graphshard.runtime.parts import cut_dim


def sync_initial_state(model: nn.Module, mesh: DeviceMesh,
                       params: Iterable[tuple[torch.Tensor, nn.Parameter]]) -> None:
    """Make every rank hold rank 0's model, in place. `params`: for each parameter, this rank's
    full tensor from before sharding and the DTensor parameter that replaced it (tied
    parameters may repeat). Buffers are read from `model`. Every rank of `mesh` must call it."""
    if dist.get_backend(mesh.get_group(0)) == "fake" or mesh.size() == 1:
        return  # nothing can be received from a fake process group; one rank agrees with itself
    pairs: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}
    for full, param in params:
        pairs.setdefault(id(param), (full, param))
    buffers = [b for b in model.buffers() if b is not None]
    _check_same_structure(mesh, [p for _, p in pairs.values()], buffers)
    unmaterialized = False
    shard_dim = mesh.ndim - 1
    with torch.no_grad():
        for full, param in pairs.values():
            local = param.to_local()  # a view of the DTensor's storage
            if full.is_meta or local.is_meta:
                unmaterialized = True
                continue
            if cut_dim(param.placements[shard_dim]) is not None:
                _scatter_dim0_from_origin(mesh, full.detach(), local)
            else:
                _broadcast_from_origin(mesh, local)
        for buf in buffers:
            if buf.is_meta:
                unmaterialized = True
            else:
                _broadcast_from_origin(mesh, buf)
    if unmaterialized:
        _sync_rng_states(mesh)


def sync_across_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh,
                                replicated: Iterable[nn.Parameter]) -> None:
    """The TP ranks of a data-parallel rank hold TP rank 0's copy of what the TP plan left
    replicated: parameters outside the plan (`replicated`, this rank's shards of them) and
    buffers; and, for a model still on the meta device, its RNG states (materialize then draws
    rank 0's values everywhere). The plan's own parameters came from TP rank 0 already (torch's
    distribute_tensor). Every rank of the TP mesh must call it."""
    if tp_mesh.size() == 1 or dist.get_backend(tp_mesh.get_group(0)) == "fake":
        return
    seen, unmaterialized = set(), False
    with torch.no_grad():
        for param in replicated:
            if id(param) in seen:
                continue
            seen.add(id(param))
            local = param.to_local()
            if local.is_meta:
                unmaterialized = True
            else:
                _broadcast_from_origin(tp_mesh, local)
        for buf in model.buffers():
            if buf is not None and buf.is_meta:
                unmaterialized = True
            elif buf is not None:
                _broadcast_from_origin(tp_mesh, buf)
    if unmaterialized:
        _sync_rng_states(tp_mesh)


def _in_origin_group(mesh: DeviceMesh, dims: int) -> bool:
    """Whether this rank's coordinates on mesh dims [0, dims) are all 0."""
    return all(c == 0 for c in mesh.get_coordinate()[:dims])


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool or complex collectives: move the same bytes as another dtype
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t)
    return t


def _broadcast_from_origin(mesh: DeviceMesh, tensor: torch.Tensor) -> None:
    """Origin's `tensor` to every rank of the mesh: along the last (shard) dimension within
    the origin's group, then along each replicate dimension."""
    if tensor.numel() == 0:
        return
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    _pass_on_from_origin(mesh, buf, first_dim=mesh.ndim - 1)
    if buf is not tensor:
        tensor.copy_(buf)


def _pass_on_from_origin(mesh: DeviceMesh, buf: torch.Tensor, first_dim: int) -> None:
    # Dim d is sent along by ranks whose coordinates on dims before d are 0; going from the last
    # dim to the first, each step's senders were receivers of the step before.
    for dim in range(first_dim, -1, -1):
        if mesh.size(dim) > 1 and _in_origin_group(mesh, dim):
            dist.broadcast(_wire(buf), group=mesh.get_group(dim), group_src=0)


def _scatter_dim0_from_origin(mesh: DeviceMesh, full: torch.Tensor, local: torch.Tensor) -> None:
    """Each rank's dim-0 shard (torch.chunk layout, as shard() cuts it) of the origin's `full`,
    into `local`. Chunks are padded to one size: gloo scatters equal sizes only."""
    shard_dim = mesh.ndim - 1
    size = mesh.size(shard_dim)
    rows = -(-full.shape[0] // size) if full.dim() else 0
    if rows == 0 or full[:1].numel() == 0:
        return
    if size > 1 and _in_origin_group(mesh, shard_dim):
        received = local.new_empty((rows, *local.shape[1:]))
        chunks = None
        if mesh.get_local_rank(shard_dim) == 0:
            padded = full.new_empty((rows * size, *full.shape[1:]))
            padded[:full.shape[0]].copy_(full)
            chunks = [_wire(c) for c in padded.chunk(size)]
        dist.scatter(_wire(received), chunks, group=mesh.get_group(shard_dim), group_src=0)
        local.copy_(received[:local.shape[0]])
    # The other replica groups receive their shard from the origin group's rank with the same
    # shard coordinate.
    if mesh.ndim > 1:
        buf = local if local.is_contiguous() else local.contiguous()
        if buf.numel():
            _pass_on_from_origin(mesh, buf, first_dim=shard_dim - 1)
        if buf is not local:
            local.copy_(buf)


def _check_same_structure(mesh: DeviceMesh, params: list[nn.Parameter],
                          buffers: list[torch.Tensor]) -> None:
    """Every rank must send and receive the same tensors, or the collectives would mismatch
    (hang or garble): compare a digest of shapes and dtypes with the origin's, on every rank."""
    text = repr([(tuple(t.shape), t.dtype) for t in (*params, *buffers)]).encode()
    digest = torch.frombuffer(bytearray(hashlib.sha256(text).digest()[:8]), dtype=torch.int64)
    device = torch.device(mesh.device_type)
    origin = digest.clone().to(device)
    _pass_on_from_origin(mesh, origin, first_dim=mesh.ndim - 1)
    differs = torch.tensor([int(not torch.equal(origin.cpu(), digest))], device=device)
    for dim in range(mesh.ndim):
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if differs.item():
        raise ValueError(
            "graphshard.shard: the ranks built different models (parameter or buffer shapes or "
            "dtypes differ from rank 0's), so they cannot start from rank 0's weights; build "
            "the same model on every rank")


def _sync_rng_states(mesh: DeviceMesh) -> None:
    """Every rank takes the origin's default generator states, so that materialize() draws
    rank 0's values on every rank."""
    device = torch.device(mesh.device_type)
    state = torch.get_rng_state().to(device)
    _pass_on_from_origin(mesh, state, first_dim=mesh.ndim - 1)
    torch.set_rng_state(state.cpu())
    if device.type != "cpu":
        accel = torch.get_device_module(device.type)
        state = accel.get_rng_state().to(device)
        _pass_on_from_origin(mesh, state, first_dim=mesh.ndim - 1)
        accel.set_rng_state(state.cpu())
