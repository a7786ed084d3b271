"""load(): any DCP checkpoint of the model into it, at any world size, checked first."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

from graphshard.checkpoint.agreement import (agree, check_sharded_over_the_world, describe,
                                             distributed, rank_world)
from graphshard.checkpoint.errors import CheckpointError, CheckpointNotFoundError, raise_if_unfit
from graphshard.checkpoint.layout import OPTIM_KEYS, Layout, open_checkpoint
from graphshard.checkpoint.rng import from_bytes, restore_or_derive, rng_request
from graphshard.checkpoint.save import wait_for_async_save
from graphshard.checkpoint.state_dict import check_materialised, collect_state, plain_classes, unwrap


@dataclass(frozen=True)
class CheckpointInfo:
    """What `load` returns besides the restored model and optimizer."""

    path: Path
    step: int | None
    world_size: int | None  # the world size it was saved with; None when not recorded (not ours)
    extra: dict[str, Any] = field(default_factory=dict)
    rng_restored: str = "none"  # "saved" (this rank's own state), "derived" or "none"
    format: str = "graphshard"  # "graphshard" (has our marker) or "dcp" (plain DCP, FSDP2, ...)


def _check_compatible(path: Path, saved: dict[str, Any], model_state: dict[str, Any]) -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped key."""
    missing = [k for k in model_state if k not in saved]
    # Only tensors count as unexpected: a trainer may keep its own objects next to the
    # weights of a root-level state dict (torchtitan's train_state, for one).
    unexpected = [k for k, md in saved.items()
                  if k not in model_state and isinstance(md, TensorStorageMetadata)]
    mismatched = []
    for key, value in model_state.items():
        md = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) \
                and tuple(md.size) != tuple(value.shape):
            mismatched.append(f"{key}: checkpoint {tuple(md.size)} vs model {tuple(value.shape)}")
    raise_if_unfit(missing, unexpected, mismatched, "checkpoint",
                   f"checkpoint at {path} does not fit this model (is it another model's?)")


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> CheckpointInfo:
    """Load a DCP checkpoint into `model` (and `optimizer`), at any world size.

    Reads graphshard's own checkpoints and any other DCP checkpoint of the model: a plain
    `dcp.save` of `model.state_dict()` (at the root) or of {"model": ..., "optim" or
    "optimizer": ...} as `get_state_dict` gives them, which is also what FSDP2 runs save.
    The model may be sharded over any number of ranks (DCP reshards), or unsharded in a single
    process; it must hold memory (a model built on the meta device: graphshard.materialize it
    first). RNG (graphshard checkpoints): rank r restores the state rank r saved; a rank the
    checkpoint has no state for (more ranks now than at save) is seeded with
    `derived_seed(rank 0's state, r)`. Returns the step, the `extra` dict and the saved world
    size (None for checkpoints that are not graphshard's).
    """
    path = Path(path)
    model = unwrap(model)
    check_sharded_over_the_world(model, "load")
    rank, _ = rank_world()
    wait_for_async_save(model)

    # Validate everything before DCP's collectives, and agree on the outcome, so a bad input
    # gives the same clear error on every rank rather than a hang or an opaque DCP failure.
    error: BaseException | None = None
    request: dict[str, Any] = {}
    manifest: dict[str, Any] | None = None
    layout: Layout | None = None
    try:
        check_materialised(model, path)  # before get_state_dict, which would fail on it first
        # On every rank: get_state_dict may run collectives of its own.
        state = collect_state(model, optimizer)
        manifest, metadata, layout = open_checkpoint(path)
        if optimizer is not None and layout.optim_key is None:
            raise CheckpointError(f"checkpoint at {path} has no optimizer state (looked under "
                                  f"{' and '.join(map(repr, OPTIM_KEYS))}); load it with "
                                  "optimizer=None")
        _check_compatible(path, layout.model, state["model"])
        request = {"model": state["model"]} if layout.model_prefix else dict(state["model"])
        if optimizer is not None:
            request[layout.optim_key] = state["optim"]
        if layout.graphshard:
            request["graphshard"] = rng_request(metadata, rank, restore_rng)
    except Exception as exc:
        error = exc
    failed, not_found = agree(error, isinstance(error, CheckpointNotFoundError))
    if error is not None:
        raise error
    if failed:  # of the same type on every rank: one `except` serves them all
        raise (CheckpointNotFoundError if any(not_found) else CheckpointError)(
            f"cannot load checkpoint {path}: {failed}")

    try:
        dcp.load(request, checkpoint_id=path, no_dist=not distributed())
    except CheckpointException as exc:
        raise CheckpointError(f"loading checkpoint {path} failed: {describe(exc, rank)}") from exc
    # DCP fills tensors in place and replaces other values in `request`: read them back there.
    model_state = request["model"] if layout.model_prefix else {
        k: request[k] for k in state["model"]}
    with plain_classes(model):
        if optimizer is not None:
            try:
                set_state_dict(model, optimizer, model_state_dict=model_state,
                               optim_state_dict=request[layout.optim_key])
            except RuntimeError as exc:
                if "Missing optimizer state" not in str(exc):
                    raise
                # e.g. saved with untied weights, loaded into tied ones; DCP's advice
                # (StateDictOptions) is not an option of this call
                raise CheckpointError(
                    f"the optimizer state in checkpoint {path} does not fit this model's "
                    f"parameters ({str(exc).strip().splitlines()[0]}); was it saved from a model "
                    "with other tied weights? Load with optimizer=None to load the weights alone "
                    "and start the optimizer afresh") from exc
        else:
            set_model_state_dict(model, model_state)
    if optimizer is not None and manifest is not None \
            and not manifest.get("optimizer_stepped", True):
        optimizer.state.clear()  # saved before its first step: keep it fresh (see save)

    gs = request.get("graphshard", {"extra": None, "rng": {}})
    rng_restored = restore_or_derive(gs["rng"], rank) if restore_rng else "none"
    if manifest is None:
        return CheckpointInfo(path=path, step=None, world_size=None, format="dcp")
    return CheckpointInfo(path=path, step=manifest.get("step"),
                          world_size=int(manifest.get("world_size", 0)),
                          extra=from_bytes(gs["extra"]) if gs["extra"] is not None else {},
                          rng_restored=rng_restored)
