"""`graphshard.apply_plan`: set a model up as a configuration of `graphshard plan` says (its
`--out` JSON, or `--json`'s list, best first), on this job's process group."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch.nn as nn


@dataclass(frozen=True)
class AppliedPlan:
    """What the training loop still needs once `apply_plan` has set the model up."""

    options: dict[str, Any]  # torch.compile(model, backend="graphshard", options=...)
    micro_batch: int  # rows per data-parallel rank per forward
    accumulation_steps: int  # micro-batches per optimizer step (no_sync for all but the last)
    mesh: Any  # the job's DeviceMesh: the data-parallel dims, then "tp" where TP is on


def apply_plan(model: nn.Module, plan: str | os.PathLike | dict,
               device_type: str | None = None) -> AppliedPlan:
    """Build the plan's device mesh over this job's ranks, then, in the planner's order: convert
    the model to torchao's float8 training where the plan says float8, checkpoint its repeated
    blocks, apply its tensor-parallel plan on mesh["tp"] where the plan has TP, and shard it
    over the data-parallel dims. `plan`: a path to the JSON, or the loaded dict (a single
    configuration, or `--json`'s {"configs": [...]}, whose best is taken). `device_type`: the
    mesh's ("cuda", "cpu"); by default "cuda" under NCCL, else "cpu". Call it on every rank,
    after init_process_group and before torch.compile."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard

    config = _configuration(plan)
    shard_kwargs = dict(config["shard"])
    try:
        shape = tuple(shard_kwargs.pop("mesh_shape"))
        names = tuple(shard_kwargs.pop("mesh_dim_names"))
        tp = shard_kwargs.pop("tensor_parallel")
        options, micro_batch = config["options"], config["micro_batch"]
        accumulation_steps = config["accumulation_steps"]
    except KeyError as e:
        raise ValueError(f"apply_plan: the configuration has no {e.args[0]!r}: pass the JSON "
                         "`graphshard plan --out` (or --json) wrote") from None
    if not dist.is_initialized():
        raise RuntimeError("apply_plan: no process group: call "
                           "torch.distributed.init_process_group() first, on every rank")
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(f"apply_plan: the plan is for {math.prod(shape)} devices (mesh "
                         f"{list(shape)}, dims {list(names)}), this job has {world} ranks: "
                         f"plan again with --devices {world}, or launch {math.prod(shape)} ranks")
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if "float8" in config:
        from graphshard.tools.plan.capture import convert_to_float8

        convert_to_float8(model)
    graphshard.apply_activation_checkpointing(model, config.get("activation_checkpointing",
                                                                "none"))
    if tp > 1:
        graphshard.parallelize(model, mesh["tp"])
    graphshard.shard(model, mesh[tuple(name for name in names if name != "tp")], **shard_kwargs)
    return AppliedPlan(dict(options), micro_batch, accumulation_steps, mesh)


def _configuration(plan: str | os.PathLike | dict) -> dict:
    if not isinstance(plan, dict):
        try:
            with open(plan) as f:
                plan = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"apply_plan: cannot read the plan {os.fspath(plan)!r}: {e}") from None
    if "configs" in plan:  # --json: every configuration tried, best first
        if not plan["configs"]:
            raise ValueError("apply_plan: the plan lists no configuration")
        plan = plan["configs"][0]
    if "shard" not in plan:
        raise ValueError("apply_plan: not a configuration of `graphshard plan` (no 'shard'): "
                         "pass the JSON its --out (or --json) wrote")
    if not plan.get("fits", True):
        raise ValueError(f"apply_plan: the plan's configuration does not fit in memory "
                         f"({plan.get('why', 'see graphshard plan')}): plan again with more "
                         "devices or a smaller batch")
    return plan
