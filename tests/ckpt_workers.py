"""Rank functions for tests/test_checkpoint.py (module-level so `run_local` can spawn them,
and kept apart from the test module so spawned ranks do not import pytest)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import graphshard
from graphshard import checkpoint
from zoo import Zoo, zoo_loss

GLOBAL_BATCH, SEQ, VOCAB = 12, 8, 11  # 12 rows split evenly over 1, 2, 3 and 4 ranks
SAVE_STEP, LAST_STEP = 3, 6


def make(seed: int, sharded: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Zoo(vocab=VOCAB)
    if sharded:
        graphshard.shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ),
                         generator=torch.Generator().manual_seed(100 + step))


def train(model, optimizer, start: int, stop: int) -> list[float]:
    """Data-parallel steps over a fixed global batch; returns the global mean losses."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for step in range(start, stop):
        tokens = global_batch(step).chunk(world)[rank]
        loss = zoo_loss(model(tokens), tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    """Unsharded copies of the model's state_dict (a collective on a sharded model)."""
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for name, value in model.state_dict().items()}


def reference(rank: int, world: int, root: str) -> dict[str, Any]:
    """The uninterrupted run at world size 4, saving at SAVE_STEP (replacing an earlier save)."""
    path = Path(root) / "ckpt"
    model, optimizer = make(seed=0)
    losses = train(model, optimizer, 0, 1)
    checkpoint.save(path, model, optimizer, step=1)
    losses += train(model, optimizer, 1, SAVE_STEP)
    checkpoint.save(path, model, optimizer, step=SAVE_STEP, extra={"tokens_seen": 36})
    at_save = full_state(model)
    draws = torch.rand(4)  # what rank `rank` draws right after the save
    losses += train(model, optimizer, SAVE_STEP, LAST_STEP)
    return {"losses": losses, "at_save": at_save, "final": full_state(model), "draws": draws}


def _inject_write_failure() -> None:
    # This rank writes its shards, then fails: a save that breaks half-way.
    original = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        original(self, plan, planner).wait()
        raise RuntimeError("injected failure in the middle of the save")

    FileSystemWriter.write_data = write_then_fail


def resume(rank: int, world: int, root: str, compiled: bool) -> dict[str, Any]:
    """Resume from the world-size-4 checkpoint with graphshard.checkpoint.load and train on.

    At world size 2 also: a save that fails on rank 1 half-way must leave the step-3
    checkpoint intact and loadable, and leave no temporary directory behind.
    """
    path = Path(root) / "ckpt"
    model, optimizer = make(seed=1000 + rank)  # different weights: the load must replace them
    runner = (torch.compile(model, backend="graphshard", options={"compiler": "eager"})
              if compiled else model)
    info = checkpoint.load(path, runner, optimizer)
    result: dict[str, Any] = {"step": info.step, "world_size": info.world_size,
                              "extra": info.extra, "rng": info.rng_restored,
                              "draws": torch.rand(4)}
    result["losses"] = train(runner, optimizer, SAVE_STEP, LAST_STEP)
    result["final"] = full_state(model)
    if world == 2:
        if rank == 1:
            _inject_write_failure()
        try:
            checkpoint.save(path, runner, optimizer, step=LAST_STEP)
            result["failed_save"] = None
        except checkpoint.CheckpointError as exc:
            result["failed_save"] = str(exc)
        dist.barrier()
        result["dir_after_failure"] = sorted(os.listdir(root))
        model2, optimizer2 = make(seed=7)
        result["reloaded_step"] = checkpoint.load(path, model2, optimizer2).step
        result["reloaded"] = full_state(model2)
    return result


def resume_plain_dcp(rank: int, world: int, root: str, single: str) -> dict[str, Any]:
    """Resume with only the standard DCP calls; then check a bad path fails on every rank,
    and load `single` (saved by one unsharded process) with graphshard.checkpoint.load."""
    path = Path(root) / "ckpt"
    model, optimizer = make(seed=1000 + rank)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    result: dict[str, Any] = {"losses": train(model, optimizer, SAVE_STEP, LAST_STEP),
                              "final": full_state(model)}
    # ... and a standard DCP save at world size 3 loads back with the standard calls too.
    plain = Path(root) / "plain-dcp-3"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=plain)
    model2, optimizer2 = make(seed=7)
    model_sd, optim_sd = get_state_dict(model2, optimizer2)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=plain)
    set_state_dict(model2, optimizer2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    result["plain_reloaded"] = full_state(model2)
    result["plain_next_loss"] = train(model2, optimizer2, LAST_STEP, LAST_STEP + 1)
    result["next_loss"] = train(model, optimizer, LAST_STEP, LAST_STEP + 1)
    info = checkpoint.load(single, model2, optimizer2)
    result.update(single_rng=info.rng_restored, single_draws=torch.rand(4),
                  single_state=full_state(model2))
    try:
        checkpoint.load(Path(root) / "missing", model, optimizer)
    except checkpoint.CheckpointNotFoundError as exc:
        result["missing_error"] = str(exc)
    return result
