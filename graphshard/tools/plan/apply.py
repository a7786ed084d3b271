"""`graphshard.apply_plan`: set a model up as a configuration of `graphshard plan` says (its
`--out` JSON, or `--json`'s list, best first), on this job's process group."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn


@dataclass(frozen=True)
class AppliedPlan:
    """What the training loop still needs once `apply_plan` has set the model up."""

    options: dict[str, Any]  # torch.compile(model, backend="graphshard", options=...)
    micro_batch: int  # rows per data-parallel rank (a TP group's ranks share them) per forward
    accumulation_steps: int  # micro-batches per optimizer step (no_sync for all but the last)
    mesh: Any  # the job's DeviceMesh: the data-parallel dims, then "tp" where TP is on


def apply_plan(model: nn.Module, plan: str | os.PathLike | dict,
               device_type: str | None = None) -> AppliedPlan:
    """Build the plan's device mesh over this job's ranks, then, as the planner's captures do,
    convert the model to torchao's float8 training where the plan says float8, checkpoint its
    repeated blocks, apply its tensor-parallel plan on mesh["tp"] where the plan has TP, and
    shard it over the data-parallel dims. `plan`: a path to the JSON, or the loaded dict (a
    single configuration, or `--json`'s {"configs": [...]}, whose best is taken); rank 0's is
    every rank's. `device_type`: the mesh's; by default the model's parameters' ("cuda" for a
    meta model where there is a GPU).
    Call it on every rank, after init_process_group and before torch.compile. A plan that does
    not fit this job is a ValueError on every rank, before the model is changed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from graphshard.activation_checkpointing import apply_activation_checkpointing
    from graphshard.sharding import model_device_type
    from graphshard.tensor_parallel_plan import check_tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError("apply_plan: no process group: call "
                           "torch.distributed.init_process_group() first, on every rank")
    config = _rank0_configuration(plan)
    layout = _Layout.of(config, dist.get_world_size())
    if layout.tp > 1:  # the model's TP plan refuses the degree before anything changes
        check_tensor_parallel(model, layout.tp)
    mesh = init_device_mesh(device_type or model_device_type(model), layout.shape,
                            mesh_dim_names=layout.names)
    if layout.float8 is not None:
        from graphshard.tools.plan.capture import convert_to_float8

        convert_to_float8(model, layout.float8)
    apply_activation_checkpointing(model, layout.ac)
    parallelize_and_shard(model, mesh, layout.shard_kwargs)
    return AppliedPlan(dict(config["options"]), config["micro_batch"],
                       config["accumulation_steps"], mesh)


def parallelize_and_shard(model: nn.Module, mesh, shard_kwargs: dict,
                          tp_refused: Callable[[ValueError], Exception] | None = None) -> None:
    """The model's TP plan on mesh["tp"] where the mesh has that dim, then shard() over the
    others: how the planner's captures and apply_plan lay a configuration out. `tp_refused`
    turns the TP plan's refusal (heads the degree does not divide) into the caller's error."""
    import graphshard

    names = mesh.mesh_dim_names
    if "tp" in names:
        try:
            graphshard.parallelize(model, mesh["tp"])
        except ValueError as e:
            if tp_refused is None:
                raise
            raise tp_refused(e) from None
    graphshard.shard(model, mesh[tuple(name for name in names if name != "tp")], **shard_kwargs)


@dataclass(frozen=True)
class _Layout:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    shard_kwargs: dict
    ac: str
    float8: dict | None  # torchao's Float8LinearConfig arguments
    tp: int

    @staticmethod
    def of(config: dict, world: int) -> "_Layout":
        """The configuration, checked whole against graphshard's API and this job's world size
        (everything apply_plan could refuse, before it changes anything)."""
        import graphshard
        from graphshard.activation_checkpointing import MODES
        from graphshard.compiler.options import GraphshardOptions
        from graphshard.policy import ShardingStrategy, resolve_mixed_precision

        shard_kwargs = dict(config["shard"])
        try:
            shape = tuple(int(n) for n in shard_kwargs.pop("mesh_shape"))
            names = tuple(shard_kwargs.pop("mesh_dim_names"))
            tp = int(shard_kwargs.pop("tensor_parallel"))
            options, micro_batch = config["options"], config["micro_batch"]
            accumulation_steps = config["accumulation_steps"]
        except KeyError as e:
            raise ValueError(f"apply_plan: the configuration has no {e.args[0]!r}: pass the JSON "
                             "`graphshard plan --out` (or --json) wrote") from None
        if math.prod(shape) != world:
            raise ValueError(f"apply_plan: the plan is for {math.prod(shape)} devices (mesh "
                             f"{list(shape)}, dims {list(names)}), this job has {world} ranks: "
                             f"plan again with --devices {world}, or launch {math.prod(shape)} "
                             "ranks")
        strategy = ShardingStrategy.parse(shard_kwargs.get("strategy", "full_shard"))
        data_parallel = 2 if strategy is ShardingStrategy.HYBRID_SHARD else 1
        with_tp = tp > 1
        if (len(names) != len(shape) or len(set(names)) != len(names)
                or len(shape) != data_parallel + with_tp or ("tp" in names) != with_tp
                or (with_tp and (names[-1] != "tp" or shape[-1] != tp))):
            raise ValueError(f"apply_plan: mesh {list(shape)} with dims {list(names)} does not "
                             f"fit strategy {strategy.value!r} with tensor_parallel {tp} (a "
                             f"{data_parallel}-D data-parallel mesh, then a 'tp' dim of {tp} "
                             "where tensor_parallel > 1)")
        accepted = set(inspect.signature(graphshard.shard).parameters) - {"model", "mesh"}
        unknown = sorted(set(shard_kwargs) - accepted)
        if unknown:
            raise ValueError(f"apply_plan: the configuration's shard arguments {unknown} are not "
                             f"graphshard.shard's ({sorted(accepted)})")
        resolve_mixed_precision(shard_kwargs.get("mixed_precision"),
                                shard_kwargs.get("param_dtype"), shard_kwargs.get("reduce_dtype"))
        ac = config.get("activation_checkpointing", "none")
        if ac not in MODES:
            raise ValueError(f"apply_plan: activation_checkpointing {ac!r} is not one of {MODES}")
        GraphshardOptions.from_dict(options)
        if not all(isinstance(n, int) and n >= 1 for n in (micro_batch, accumulation_steps)):
            raise ValueError(f"apply_plan: micro_batch {micro_batch!r} and accumulation_steps "
                             f"{accumulation_steps!r} must be positive integers")
        float8 = config.get("float8")
        if float8 is not None:
            if importlib.util.find_spec("torchao") is None:
                raise ValueError("apply_plan: the plan trains in float8, which needs torchao: "
                                 "pip install 'graphshard[float8]'")
            float8 = dict(float8.get("config", {}))
        return _Layout(shape, names, shard_kwargs, ac, float8, tp)


def _rank0_configuration(plan: str | os.PathLike | dict) -> dict:
    """Rank 0's configuration, on every rank (only rank 0 needs the file; no rank goes on with a
    stale copy of its own), or the same ValueError on every rank."""
    import torch.distributed as dist

    shared: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            shared[0] = ("configuration", _configuration(plan))
        except ValueError as e:
            shared[0] = ("error", str(e))
    dist.broadcast_object_list(shared, src=0)
    kind, value = shared[0]
    if kind == "error":
        raise ValueError(value + ("" if dist.get_rank() == 0 else " (read on rank 0)"))
    return value


def _configuration(plan: str | os.PathLike | dict) -> dict:
    if not isinstance(plan, dict):
        try:
            with open(plan) as f:
                plan = json.load(f)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"apply_plan: cannot read the plan {plan!r}: {e}") from None
    if "configs" in plan:  # --json: every configuration tried, best first
        if not plan["configs"]:
            raise ValueError("apply_plan: the plan lists no configuration")
        plan = plan["configs"][0]
    if not isinstance(plan, dict) or "shard" not in plan:
        raise ValueError("apply_plan: not a configuration of `graphshard plan` (no 'shard'): "
                         "pass the JSON its --out (or --json) wrote")
    if not plan.get("fits", True):
        raise ValueError(f"apply_plan: the plan's configuration does not fit in memory "
                         f"({plan.get('why') or 'see graphshard plan'}): plan again with more "
                         "devices or a smaller batch")
    return plan
