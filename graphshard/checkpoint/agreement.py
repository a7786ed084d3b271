"""Ranks agree on an outcome: one rank's failure becomes the same error on every rank.

Every rank calls `agree` at the same point, so a bad input or a failed write on one rank makes
all ranks fail at once with one message, instead of leaving the others blocked in the next
collective. Outside a process group everything here is the single-process case.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from graphshard.checkpoint.errors import CheckpointError
from graphshard.state import is_sharded, shard_state


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def check_sharded_over_the_world(model, what: str) -> None:
    """Saves and loads agree, write and commit over the default process group (rank 0
    commits): a model sharded over part of the world would leave them waiting for ranks that
    never call them."""
    if not (distributed() and is_sharded(model)):
        return
    # The ranks the parameters live on: the data-parallel mesh, and with TP the (dp, tp) mesh
    # each parameter's DTensor spans (a sibling dim of the data-parallel one).
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters()
              if isinstance(p, DTensor)} or {0: shard_state(model).mesh}
    ranks = sorted({r for mesh in meshes.values() for r in mesh.mesh.flatten().tolist()})
    if ranks != list(range(dist.get_world_size())):
        raise CheckpointError(
            f"checkpoint.{what} needs a model sharded over every rank of the process group; "
            f"this model's mesh spans ranks {ranks} of {dist.get_world_size()}, and the ranks "
            f"outside it would never join. Shard the model over every rank, or {what} its "
            "state_dict() (DTensors) with torch.distributed.checkpoint, passing "
            "process_group= a group over the mesh's ranks.")


def describe(exc: BaseException, rank: int) -> str:
    if isinstance(exc, CheckpointException):
        # DCP gathers every rank's failure; its str() is a wall of tracebacks.
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}"
                         for r, (e, _) in sorted(exc.failures.items()))
    if isinstance(exc, CheckpointError):
        return f"rank {rank}: {exc}"
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value` (a single-element list outside a process group)."""
    if not distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def agree(error: BaseException | None, payload: Any = None,
          group: Any = None) -> tuple[str | None, list[Any]]:
    """Share each rank's outcome: (first failure as "rank r: message" or None, payloads)."""
    message = None if error is None else describe(error, rank_world()[0])
    results = gather((message, payload), group)
    # A DCP failure is reported identically by every rank: say it once.
    failures = dict.fromkeys(msg for msg, _ in results if msg is not None)
    return ("; ".join(failures) or None), [p for _, p in results]
