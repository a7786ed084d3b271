"""torchtitan's SimpleFSDP, as torchtitan's graph trainer applies and compiles it.

The peer is torchtitan's own code, loaded from the installed `torchtitan` package
(`pip install --no-deps torchtitan==0.3.0`: its dependencies ask for a nightly torch):
`experiments/graph_trainer/simple_fsdp.py` (`data_parallel`) and
`experiments/graph_trainer/jit_backend.py` (`get_compile_backend_with_passes`, the JIT recipe's
bucketing and reordering passes). Both are imported at their own module names; the shim is the
smallest that lets them import without torchtitan's config stack:

- `torchtitan.protocols.module` stands in as `Module = nn.Module`: the real one imports
  `spmd_types` and torchtitan's config stack (tyro, ...), and SimpleFSDP uses `Module` only as
  the base class of its `ReplicateComputation`, with none of its configuration.
- `torchtitan.experiments.graph_trainer.configs` stands in with `GraphTrainerCompileConfig`
  (a type annotation there): the real one imports torchtitan's Trainer.
- `torchtitan.experiments.graph_trainer.fsdp_passes` stands in with its two pass names, which
  only the `aot_eager` backend calls; the Inductor backend measured here runs torch's passes
  (`manual_overlap_bucketing`, `schedule_overlap_bucketing_from_inductor_configs`).

The stand-ins are in `sys.modules` only while the two modules import. What this bench sets up
around them, and why:

- `get_compile_backend_with_passes` sets Inductor's global config; its changes are taken back
  and handed to this method's `torch.compile(options=...)` alone, so the other methods in the
  same process compile as they would on their own. torchtitan's `apply_compile` also sets
  `reorder_for_peak_memory=False` (passed the same way).
- torchtitan's passes do not run on a CPU-only torch: both estimate each node's runtime with a
  roofline that reads the GPU's DRAM bandwidth through Triton (`get_gpu_dram_gbps`), and raise
  `ModuleNotFoundError: triton`. The bench's methods compile with `passes="none"` (one gather
  per parameter, as torchtitan's JIT mode without a pass); `simple_fsdp(..., passes=...)` picks
  one where Triton is present.
- Tied weights: `data_parallel` shards each module's parameters separately, which would untie
  a shared embedding and output weight (torchtitan's Llama has none); the bench ties them
  again, so the model trained is every method's.
- torchtitan's wrapper-class cache is cleared before each `data_parallel` (see there): it
  assumes one SimpleFSDP configuration per process, the bench sets up two.
- SimpleFSDP reduces gradients as `Partial("sum")`: torchtitan divides its loss by the global
  token count. The harness's loss is each rank's mean, so the compiled model scales its output's
  gradient by 1 / world size, which is the same normalization.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graphshard._torch_compat import inductor_config_changes_made_by
from graphshard.passes.units import block_of, named_blocks

VERSION = "0.3.0"  # the torchtitan release this shim was written against
MODES = ("fully_shard", "hybrid_shard")
PASSES = ("transformer_block_bucketing", "auto_bucketing", "none")
_PACKAGE = "torchtitan.experiments.graph_trainer"


class TorchtitanUnavailable(RuntimeError):
    """torchtitan is not installed, or its SimpleFSDP modules are not where 0.3.0 has them."""


def _stub(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def _unused_aot_eager_pass(*args, **kwargs):
    raise NotImplementedError("the aot_eager backend's passes are not loaded by the bench")


def _stand_ins() -> dict[str, types.ModuleType]:
    return {
        "torchtitan.protocols.module": _stub("torchtitan.protocols.module", Module=nn.Module),
        f"{_PACKAGE}.configs": _stub(f"{_PACKAGE}.configs", GraphTrainerCompileConfig=object),
        f"{_PACKAGE}.fsdp_passes": _stub(
            f"{_PACKAGE}.fsdp_passes",
            autobucketing_reordering_pass=_unused_aot_eager_pass,
            transformer_block_bucketing_reordering_pass=_unused_aot_eager_pass),
    }


@contextmanager
def _standing_in(modules: dict[str, types.ModuleType]) -> Iterator[None]:
    clashes = [name for name in modules if name in sys.modules]
    if clashes:
        raise TorchtitanUnavailable(
            f"{clashes} already imported: the bench loads SimpleFSDP in a process that has not "
            "imported torchtitan's config stack")
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)


def torchtitan_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """torchtitan's (simple_fsdp, jit_backend) modules, imported once."""
    names = (f"{_PACKAGE}.simple_fsdp", f"{_PACKAGE}.jit_backend")
    if all(name in sys.modules for name in names):
        return tuple(sys.modules[name] for name in names)
    if importlib.util.find_spec("torchtitan") is None:
        raise TorchtitanUnavailable(
            f"torchtitan is not installed (pip install --no-deps torchtitan=={VERSION}: without "
            "--no-deps pip would replace torch with the nightly torchtitan asks for)")
    with _standing_in(_stand_ins()):
        try:
            return tuple(importlib.import_module(name) for name in names)
        except ImportError as exc:
            raise TorchtitanUnavailable(
                f"torchtitan's SimpleFSDP did not import ({exc}); the shim is written for "
                f"torchtitan {VERSION}") from exc


def bucket_plan(model: nn.Module) -> list[list[str] | str]:
    """torchtitan's `get_transformer_block_buckets` for any model with repeated blocks: the
    modules before the blocks (embeddings) as one bucket, those after (norm, output) as one,
    then one bucket per block."""
    blocks = list(named_blocks(model))
    before: list[str] = []
    after: list[str] = []
    seen_block = False
    for name, module in model.named_modules():
        if block_of(f"{name}.x") is not None:
            seen_block = True
            continue
        if name and any(True for _ in module.parameters(recurse=False)):
            (after if seen_block else before).append(name)
    return [group for group in (before, after) if group] + blocks


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) of every parameter held by more than one module."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _hybrid_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """(replicate, shard) over the ranks: 2 replicas of world / 2 ranks each (at world size 2,
    each replica one rank: the replicate dimension does all the reducing)."""
    world = mesh.size()
    if world % 2:
        raise ValueError(f"hybrid_shard needs an even world size (2 replicas), got {world}")
    return init_device_mesh(mesh.device_type, (2, world // 2),
                            mesh_dim_names=("dp_replicate", "fsdp"))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GlobalTokenLoss(nn.Module):
    """The model, its output's gradient divided by the world size: torchtitan's loss over the
    global token count, for a loss that is each rank's mean."""

    def __init__(self, model: nn.Module, world_size: int):
        super().__init__()
        self.model = model
        self.scale = 1.0 / world_size

    def forward(self, *args, **kwargs):
        return _ScaleGrad.apply(self.model(*args, **kwargs), self.scale)


def data_parallel(model: nn.Module, mesh: DeviceMesh, mode: str) -> nn.Module:
    """torchtitan's `data_parallel(model, mesh, mode)` on the bench's 1-D mesh (a 2-D one for
    hybrid_shard), tied weights tied again; returns the model (sharded in place)."""
    if mode not in MODES:
        raise ValueError(f"unknown SimpleFSDP mode {mode!r}; valid: {', '.join(MODES)}")
    simple_fsdp, _ = torchtitan_modules()
    tied = _tied_groups(model)
    dp_mesh = _hybrid_mesh(mesh) if mode == "hybrid_shard" else mesh
    # torchtitan caches one wrapper class per module class, and that class's properties call
    # the parametrization (mesh, mode) of the call that made it: a second data_parallel in the
    # process (hybrid after full) would gather with the first's. Each call makes its own.
    simple_fsdp._wrap_class_cache.clear()
    model = simple_fsdp.data_parallel(model, dp_mesh, mode=mode)
    for (first, first_name), *others in tied:
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    return model


def compile_options(model: nn.Module, passes: str) -> dict:
    """The Inductor options torchtitan's JIT recipe sets for `passes` (compile.passes):
    `get_compile_backend_with_passes`'s config changes, kept for this compile alone."""
    if passes not in PASSES:
        raise ValueError(f"unknown SimpleFSDP passes {passes!r}; valid: {', '.join(PASSES)}")
    _, jit_backend = torchtitan_modules()
    compile_config = types.SimpleNamespace(backend="inductor",
                                           passes=[] if passes == "none" else [passes])
    changes = inductor_config_changes_made_by(
        lambda: jit_backend.get_compile_backend_with_passes(compile_config, bucket_plan(model)))
    return {"reorder_for_peak_memory": False} | changes


def simple_fsdp(model: nn.Module, mesh: DeviceMesh, mode: str,
                passes: str = "none") -> nn.Module:
    """The peer as the bench trains it: sharded, compiled whole (fullgraph, Inductor) with
    torchtitan's passes."""
    options = compile_options(model, passes)  # reads the unsharded model's module names
    sharded = GlobalTokenLoss(data_parallel(model, mesh, mode), mesh.size())
    return torch.compile(sharded, backend="inductor", fullgraph=True, options=options)
