"""`graphshard.parallelize`: apply a model's tensor-parallel plan with torch's own TP API.

A plan maps module names (`*` matches one name component, as in torch's parallelize_module)
to torch ParallelStyles or to the names Hugging Face configs use ("colwise", "rowwise", ...).
Without a plan, the model's own is used: a Hugging Face model's `config.base_model_tp_plan`
(and its head's, unless the head is tied to the embedding), or a `tp_plan` attribute
(graphshard's built-in Llama has one). Each entry must name at least one module, and the
attention-head counts the config declares must divide by the TP degree, so that no head is cut.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from graphshard._transformers import is_transformers_model

# Hugging Face's plan vocabulary -> torch's styles (a new instance per use).
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(),
    "sequence_parallel_output": lambda: RowwiseParallel(output_layouts=Shard(1)),
}


def parallelize(model: nn.Module, tp_mesh: DeviceMesh,
                plan: Mapping[str, str | ParallelStyle] | None = None) -> nn.Module:
    """Apply `plan` (default: the model's own TP plan) on the 1-D mesh `tp_mesh`, in place,
    with torch's parallelize_module; returns `model`. Then shard with
    `graphshard.shard(model, mesh["dp"])` on the same mesh's data-parallel dims."""
    if tp_mesh.ndim != 1 or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"graphshard.parallelize: the TP mesh must be one named dimension of a mesh, e.g. "
            f"mesh['tp'] of init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); "
            f"got a {tp_mesh.ndim}-D mesh with names {tp_mesh.mesh_dim_names}")
    plan = check_tensor_parallel(model, tp_mesh.size(), plan)
    names = [name for name, _ in model.named_modules() if name]
    styles = {}
    for pattern, style in plan.items():
        if not any(_matches(pattern, name) for name in names):
            raise ValueError(
                f"graphshard.parallelize: the TP plan's entry {pattern!r} names no module of "
                f"{type(model).__name__} (module names look like {names[:3]}...); fix the "
                "entry or leave it out")
        styles[pattern] = _style(pattern, style)
    tied = _tied_names(model)
    parallelize_module(model, tp_mesh, styles)
    _check_still_tied(model, tied)
    return model


def check_tensor_parallel(model: nn.Module, tp: int,
                          plan: Mapping[str, str | ParallelStyle] | None = None) -> dict:
    """What parallelize refuses before it changes anything: no plan, or a degree `tp` that
    splits attention heads. Returns the plan (default: the model's own)."""
    plan = dict(model_tp_plan(model) if plan is None else plan)
    if not plan:
        raise ValueError(
            f"graphshard.parallelize: {type(model).__name__} has no tensor-parallel plan (no "
            "Hugging Face base_model_tp_plan, no tp_plan attribute): pass plan={'module.name': "
            "'colwise' | 'rowwise' | ColwiseParallel() | ..., ...}; or, on a model of your "
            "own, set that dict as its tp_plan attribute (what `graphshard dump --tp` and "
            "`graphshard plan` read)")
    _check_heads_divide(model, tp)
    return plan


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Names of each parameter registered under several names (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _check_still_tied(model: nn.Module, tied: list[list[str]]) -> None:
    # The plan replaces each module's parameters by its own DTensors: a weight tied to a module
    # the plan leaves alone (or styles differently) would come apart, and train untied.
    params = dict(model.named_parameters(remove_duplicate=False))
    for group in tied:
        if len({id(params[name]) for name in group}) > 1:
            raise ValueError(
                f"graphshard.parallelize: the TP plan untied the weights {group} (tied before): "
                "give every module sharing the weight the same entry, or leave them all out of "
                "the plan (an input embedding tied to the output head stays whole)")


def model_tp_plan(model: nn.Module) -> dict[str, str | ParallelStyle]:
    """The model's own TP plan, with module names from `model`."""
    if is_transformers_model(model):
        return _transformers_plan(model)
    return dict(getattr(model, "tp_plan", None) or {})


def _transformers_plan(model: nn.Module) -> dict[str, str]:
    config = model.config
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    base_is_sub = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    plan = {f"{prefix}.{k}" if base_is_sub else k: v for k, v in base_plan.items()}
    head_plan = dict(getattr(type(model), "_tp_plan", None) or {})
    for name, style in head_plan.items():
        head = model.get_submodule(name) if _has_module(model, name) else None
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        tied = (head is not None and embeddings is not None
                and getattr(head, "weight", None) is getattr(embeddings, "weight", 0))
        if head is not None and not tied:  # a tied head stays whole, like its embedding
            plan[name] = style
    return plan


def _has_module(model: nn.Module, name: str) -> bool:
    return any(n == name for n, _ in model.named_modules())


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def _style(pattern: str, style: str | ParallelStyle) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    if style not in STYLES:
        raise ValueError(
            f"graphshard.parallelize: the TP plan's entry {pattern!r} asks for {style!r}, which "
            f"graphshard does not translate; use one of {sorted(STYLES)} or pass a torch "
            "ParallelStyle (ColwiseParallel(...), RowwiseParallel(...), ...)")
    return STYLES[style]()


def _check_heads_divide(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    counts = {}
    for key in ("num_attention_heads", "num_key_value_heads", "n_heads", "n_kv_heads"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value:
            counts[key] = value
    bad = {k: v for k, v in counts.items() if v % tp}
    if bad:
        raise ValueError(
            f"graphshard.parallelize: TP degree {tp} does not divide the model's head counts "
            f"{bad}: each TP rank must hold whole attention heads; choose a TP degree that "
            "divides them")
