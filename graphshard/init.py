"""Meta-device initialisation: build a model with no memory, shard it, then allocate only shards.

    with torch.device("meta"):
        model = Transformer(config)
    graphshard.shard(model)                       # DTensor parameters with meta local shards
    graphshard.materialize(model, device="cpu")   # each rank allocates and initialises its shard

How parameters are initialised, and why: one module at a time, materialize allocates that
module's *full* parameters on `device`, runs the module's own `reset_parameters()` (or
`init_fn(module)`) on a plain copy of the module class, keeps this rank's dim-0 shard and drops
the full tensors before the next module. The peak is therefore the sharded model plus the
largest single module's parameters (a tied parameter stays full until its last module is done).
The alternative, running `nn.init` on DTensor parameters, needs DTensor's offset-based random
generator, which does not cover CPU: there every rank would draw the same values for its own
shard. Initialising full tensors with the same seed on every rank gives exactly the values of an
unsharded model built with that seed (same module order, same RNG draws), which tests can check.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from graphshard._torch_compat import version_counter
from graphshard.runtime.parts import this_rank_part
from graphshard.sharding import bind_local_shards
from graphshard.state import module_shards, plain_class, shard_state


def _default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def materialize(model: nn.Module, device: str | torch.device = "cpu",
                init_fn: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Allocate this rank's shard of every meta parameter (and every meta buffer in full) on
    `device`, initialised by each module's `reset_parameters()` or by `init_fn(module)`, which
    is called on every module that directly owns parameters or buffers. Returns `model`.

    What the initialisation leaves unwritten (a module without `reset_parameters` and no
    `init_fn`; a buffer computed in `__init__`, which `init_fn` must recompute) holds NaN (zeros
    in an integer or bool tensor), not whatever memory held, and a warning names it: load
    weights into it, or pass `init_fn`.
    """
    state = shard_state(model)
    device = torch.device(device)
    if device.type != state.mesh.device_type:
        raise ValueError(f"materialize device {device} does not match the mesh's device type "
                         f"{state.mesh.device_type!r}")
    init_fn = init_fn or _default_init
    modules = [m for m in model.modules() if m._parameters or m._buffers]
    # A tied parameter stays full until the last module that owns it has run its init.
    remaining: dict[int, int] = {}
    for module in modules:
        for param in module._parameters.values():
            if param is not None:
                remaining[id(param)] = remaining.get(id(param), 0) + 1
    full_of: dict[int, nn.Parameter] = {}  # id(sharded param) -> full plain parameter
    sharded_of: dict[int, nn.Parameter] = {}  # id(old sharded param) -> new sharded param
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    module_names = {id(m): name for name, m in model.named_modules()}
    allocated_at: dict[int, int] = {}  # id(new full tensor) -> its version when allocated
    unwritten: list[str] = []

    def allocate(meta: torch.Tensor, wrap=lambda t: t) -> torch.Tensor:
        tensor = wrap(_unwritten(meta, device))
        allocated_at[id(tensor)] = version_counter(tensor)
        return tensor

    def written(allocated: torch.Tensor, now: torch.Tensor | None) -> bool:
        """Whether init wrote `allocated` in place or put another tensor (or none) there."""
        return now is not allocated or version_counter(now) != allocated_at[id(allocated)]

    def where(module: nn.Module, name: str) -> str:
        return f"{module_names[id(module)]}.{name}".lstrip(".")

    for module in modules:
        new_buffers = {name: allocate(buf) for name, buf in module._buffers.items()
                       if buf is not None and buf.is_meta}
        module._buffers.update(new_buffers)
        record = module_shards(module)
        specs = record.specs if record is not None else {}
        originals = dict(module._parameters)
        for name, param in originals.items():
            if param is None or not param.is_meta:
                continue
            if id(param) not in full_of:
                full_of[id(param)] = allocate(param, lambda t: nn.Parameter(
                    t, requires_grad=param.requires_grad))
            owners.setdefault(id(param), []).append((module, name))
            module._parameters[name] = full_of[id(param)]
        # The sharded class's properties would return a fresh gathered tensor, so in-place
        # init through `module.weight` would be lost: init on the plain class.
        sharded_cls = type(module)
        module.__class__ = plain_class(module)
        try:
            with torch.no_grad():
                init_fn(module)
        finally:
            module.__class__ = sharded_cls
        unwritten += [where(module, name) for name, buf in new_buffers.items()
                      if not written(buf, module._buffers.get(name))]
        for name, param in originals.items():
            if param is None or not param.is_meta:
                continue
            module._parameters[name] = param  # back to the sharded one until it is replaced
            remaining[id(param)] -= 1
            if remaining[id(param)] == 0:
                full = full_of.pop(id(param))
                if not written(full, full):
                    unwritten.append(where(module, name))
                sharded_of[id(param)] = _shard_of(full, param, specs[name], state.mesh)
                for owner, owner_name in owners.pop(id(param)):
                    owner._parameters[owner_name] = sharded_of[id(param)]
    bind_local_shards(model)
    if unwritten:  # every rank runs the same initialisation: every rank warns alike
        shown = ", ".join(unwritten[:8]) + (f" and {len(unwritten) - 8} more"
                                             if len(unwritten) > 8 else "")
        warnings.warn(f"graphshard.materialize: {len(unwritten)} parameter(s) or buffer(s) were "
                      f"not initialised and hold NaN (integers: zeros): {shown} (their modules have no "
                      "reset_parameters, or init_fn left them unwritten). Load weights into them "
                      "(checkpoint.load, load_state_dict), or pass init_fn= (a Hugging Face "
                      "model: init_fn=model._init_weights)", stacklevel=2)
    return model


def _unwritten(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of `meta`'s shape and dtype on `device`, NaN where the dtype has one (what an
    initialisation leaves unwritten shows), else zeros (alike on every rank; torch.empty could
    hold anything)."""
    if meta.is_floating_point() or meta.is_complex():
        return torch.full(meta.shape, math.nan, dtype=meta.dtype, device=device)
    return torch.zeros(meta.shape, dtype=meta.dtype, device=device)


def _shard_of(full: nn.Parameter, old: nn.Parameter, spec, mesh) -> nn.Parameter:
    if not isinstance(old, DTensor):
        return nn.Parameter(full.detach(), requires_grad=old.requires_grad)
    # this rank's part as `old` lays it out (a TP piece first, then the dim-0 shard of it)
    local = this_rank_part(full, old).clone(memory_format=torch.contiguous_format)
    dtensor = DTensor.from_local(local, old.device_mesh, old.placements, run_check=False,
                                 shape=old.shape, stride=old.stride())
    return nn.Parameter(dtensor, requires_grad=old.requires_grad)
