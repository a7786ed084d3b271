"""load_pretrained(): safetensors weights (one file, an index, a Hugging Face model directory)
into a model, sharded or not, built on the meta device or not, each rank reading only its rows."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from graphshard import safetensors_io as st
from graphshard._torch_compat import non_persistent_buffer_names
from graphshard._transformers import is_transformers_model
from graphshard.checkpoint.agreement import agree
from graphshard.checkpoint.errors import CheckpointError, CheckpointNotFoundError, raise_if_unfit
from graphshard.checkpoint.state_dict import unwrap
from graphshard.checkpoint.transformers_models import (
    buffer_initialiser,
    key_conversion,
    loaded_name,
)
from graphshard.runtime.parts import cut_dim
from graphshard.sharding import bind_local_shards, is_sharded, shard_state
from graphshard.state import plain_class


@dataclass
class _Target:
    """One model tensor (tied names share one) and where each of its names is registered."""

    tensor: torch.Tensor
    names: list[str]
    owners: list[tuple[nn.Module, str]]
    is_param: bool


def _targets(model: nn.Module) -> tuple[list[_Target], list[tuple[nn.Module, str, str]]]:
    """The model's state_dict tensors grouped by identity, and its non-persistent buffers."""
    targets: dict[int, _Target] = {}
    transient: list[tuple[nn.Module, str, str]] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        not_saved = non_persistent_buffer_names(module)
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                if kind == "buffer" and name in not_saved:
                    transient.append((module, name, prefix + name))
                    continue
                target = targets.setdefault(id(tensor), _Target(tensor, [], [], kind == "param"))
                if prefix + name not in target.names:
                    target.names.append(prefix + name)
                    target.owners.append((module, name))
    return list(targets.values()), transient


def _local_region(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) per dimension of the part of `tensor` this rank holds (torch.chunk's
    split of each sharded dimension, as DTensor's Shard and graphshard.shard use)."""
    region = [(0, size) for size in tensor.shape]
    if not isinstance(tensor, DTensor):
        return region
    mesh, coordinate = tensor.device_mesh, tensor.device_mesh.get_coordinate()
    # Innermost mesh dim first: TP's cut, then graphshard's data-parallel cut of that piece.
    for mesh_dim in reversed(range(mesh.ndim)):
        placement = tensor.placements[mesh_dim]
        if placement.is_replicate():
            continue
        dim = cut_dim(placement)
        if dim is None or coordinate is None:
            raise CheckpointError(f"cannot load pretrained weights into a {placement} placement")
        start, stop = region[dim]
        length, parts = stop - start, mesh.size(mesh_dim)
        chunk = -(-length // parts)
        lo = min(coordinate[mesh_dim] * chunk, length)
        region[dim] = (start + lo, start + min(lo + chunk, length))
    local = tuple(tensor.to_local().shape)
    if tuple(b - a for a, b in region) != local:
        raise CheckpointError(f"cannot tell which part of a {tuple(tensor.shape)} tensor with "
                              f"placements {tensor.placements} this rank holds ({local})")
    return region


def _read_region(info: st.TensorInfo, region: list[tuple[int, int]],
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of one tensor: its dim-0 rows are read from disk, nothing more."""
    if not region:
        return st.read(info, out=out)
    inner = region[1:]
    if all(r == (0, size) for r, size in zip(inner, info.shape[1:])):
        return st.read(info, region[0], out=out)
    rows = st.read(info, region[0])  # sharded on an inner dimension: rows, then narrow
    part = rows[(slice(None), *(slice(a, b) for a, b in inner))]
    return out.copy_(part) if out is not None else part.contiguous()


def _device_for(model: nn.Module) -> torch.device:
    if is_sharded(model):
        kind = shard_state(model).mesh.device_type
        if kind == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(kind)
    real = [t.device for t in (*model.parameters(), *model.buffers()) if not t.is_meta]
    return real[0] if real else torch.device("cpu")


def _pretrained_plan(model: nn.Module, tensors: dict[str, st.TensorInfo], path: Path,
                     init_fn: Callable | None) -> list[tuple[_Target, str]]:
    """(target, name to read it from) for every model tensor; names checked first."""
    targets, transient = _targets(model)
    known = {name for target in targets for name in target.names}
    transient_names = {name for _, _, name in transient}
    renamings, fused = key_conversion(model)
    file_name: dict[str, str] = {}  # model's name -> file's
    for name in tensors:
        loaded = loaded_name(name, renamings)
        if loaded in file_name:  # e.g. an old `gamma` beside a new `weight`: which one is meant?
            first, second = sorted((file_name[loaded], name))
            raise CheckpointError(
                f"pretrained weights at {path} hold both {first!r} and {second!r}, "
                f"which transformers' key conversion for {type(model).__name__} both loads into "
                f"{loaded!r}: keep one of them in the file")
        file_name[loaded] = name
    plan, missing, mismatched = [], [], []
    for target in targets:
        sources = [file_name[name] for name in target.names if name in file_name]
        if not sources:
            missing.append(" = ".join(target.names))  # tied names together
            continue
        source = sources[0]
        if len(sources) > 1:  # saved from an untied model: this one holds a single tensor
            warnings.warn(f"load_pretrained: {path} holds {sources} separately, which this "
                          f"model ties into one tensor: loaded {source!r}, ignored the rest",
                          stacklevel=3)
        saved = tensors[source].shape
        if tuple(saved) != tuple(target.tensor.shape):
            mismatched.append(f"{source}: file {saved} vs model {tuple(target.tensor.shape)}")
        plan.append((target, source))
    # A non-persistent buffer is not part of the state dict; files from older libraries may
    # still hold one (rotary inv_freq): it is neither read nor unexpected.
    unexpected = [name for model_name, name in file_name.items()
                  if model_name not in known and model_name not in transient_names]
    uninitialised = [name for module, local, name in transient if module._buffers[local].is_meta]
    raise_if_unfit(missing, unexpected, mismatched, "file",
                   f"pretrained weights at {path} do not fit this model" + (
                       f" (transformers fuses this architecture's {', '.join(fused)} when it "
                       "loads a checkpoint, which load_pretrained does not: load such a model "
                       "with from_pretrained before graphshard.shard)" if fused and missing else ""))
    if uninitialised and init_fn is None and not is_transformers_model(model):
        raise CheckpointError(
            f"buffers {uninitialised} are on the meta device and not in {path} (non-persistent: "
            "computed in __init__): pass init_fn=, called on each module that owns one to "
            "compute them")
    return plan


def _init_transient_buffers(model: nn.Module, init: Callable[[nn.Module, list[str]], None],
                            device: torch.device) -> None:
    """Allocate the non-persistent buffers still on the meta device and have `init(module,
    their names)` compute them; a floating-point one it leaves unwritten is an error."""
    owners: dict[int, tuple[nn.Module, list[str]]] = {}
    for module, local, _ in _targets(model)[1]:
        if module._buffers[local].is_meta:
            owners.setdefault(id(module), (module, []))[1].append(local)
    unwritten = []
    for module, names in owners.values():
        for name in names:
            buf = module._buffers[name]
            # NaN marks what init does not write (torch.empty could hold anything).
            module._buffers[name] = (torch.full_like(buf, math.nan, device=device)
                                     if buf.is_floating_point() else
                                     torch.empty_like(buf, device=device))
        # On the plain class, as graphshard.materialize does: a sharded module's parameter
        # properties would hand init gathered copies.
        sharded_cls = type(module)
        module.__class__ = plain_class(module)
        try:
            init(module, names)
        finally:
            module.__class__ = sharded_cls
        unwritten += [f"{type(module).__name__}.{name}" for name in names
                      if module._buffers[name].is_floating_point()
                      and module._buffers[name].numel() and module._buffers[name].isnan().all()]
    if unwritten:
        raise CheckpointError(
            f"non-persistent buffers {unwritten} are not in the pretrained weights and were not "
            "computed by the model's initialisation: pass init_fn=, called on each module that "
            "owns one to compute them")


def _load_target(target: _Target, info: st.TensorInfo, device: torch.device) -> None:
    tensor = target.tensor
    region = _local_region(tensor)
    existing = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if not existing.is_meta:
        direct = existing.dtype == info.dtype and existing.is_contiguous() \
            and existing.device.type == "cpu"
        data = _read_region(info, region, out=existing.detach() if direct else None)
        if not direct:
            existing.detach().copy_(data)
        return
    local = _read_region(info, region).to(device=device, dtype=tensor.dtype)
    if isinstance(tensor, DTensor):
        local = DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                   shape=tensor.shape, stride=tensor.stride())
    if target.is_param:
        new = nn.Parameter(local, requires_grad=tensor.requires_grad)
        for key, value in tensor.__dict__.items():  # e.g. graphshard's registration order
            if key not in new.__dict__:
                setattr(new, key, value)
    else:
        new = local
    for module, name in target.owners:
        (module._parameters if target.is_param else module._buffers)[name] = new


def load_pretrained(model: nn.Module, path: str | os.PathLike, *,
                    init_fn: Callable[[nn.Module], None] | None = None) -> list[str]:
    """Load safetensors weights (one file, an index, or a Hugging Face model directory) into
    `model`, each rank reading only the rows of its own shards.

    For fine-tuning without ever building the whole model anywhere:

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        graphshard.shard(model)
        graphshard.checkpoint.load_pretrained(model, "path/to/hf_model")

    Meta parameters and buffers are allocated (this rank's shard only) on the mesh's device;
    already materialised ones are overwritten in place. Call on every rank, before creating
    the optimizer. Names are checked first: every missing, unexpected and mis-shaped name is
    reported, on every rank, before anything is read. Tied parameters need only one of their
    names in the file (save_pretrained stores a tied embedding once; a file holding several,
    from the untied model, loads the first and warns). Values are cast to each
    parameter's dtype. Non-persistent buffers are not in such files: those still on the meta
    device are allocated and computed, for a Hugging Face model as its from_pretrained does
    (its `_init_weights`, which recomputes rotary frequencies from the config), for any other
    model by `init_fn(module)`, called on each module owning one (it also overrides the
    Hugging Face way). Peak host memory per rank: its shards plus one tensor's rows. Returns
    the names read.
    """
    model = unwrap(model)
    path = Path(path)
    error: BaseException | None = None
    plan: list[tuple[_Target, str]] = []
    tensors: dict[str, st.TensorInfo] = {}
    try:
        if not path.exists():  # as checkpoint.load says it: except CheckpointNotFoundError
            raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist")
        tensors = st.resolve(path)
        plan = _pretrained_plan(model, tensors, path, init_fn)
    except (CheckpointError, st.SafetensorsError, OSError) as exc:
        error = exc
    failed, not_found = agree(error, isinstance(error, CheckpointNotFoundError))
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(str(error)) from error
    if failed:  # of the same type on every rank: one `except` serves them all
        raise (CheckpointNotFoundError if any(not_found) else CheckpointError)(
            f"cannot load pretrained weights from {path}: {failed}")
    device = _device_for(model)
    with torch.no_grad():
        if init_fn is not None:
            _init_transient_buffers(model, lambda module, names: init_fn(module), device)
        elif is_transformers_model(model):
            _init_transient_buffers(model, buffer_initialiser(model), device)
        for target, source in plan:
            _load_target(target, tensors[source], device)
    # Meta parameters were replaced by new ones, as materialize() replaces them: whatever
    # graphshard.shard keeps bound to the old ones (the local shards the compiled graph reads)
    # must follow.
    if is_sharded(model):
        bind_local_shards(model)
    return [source for _, source in plan]
