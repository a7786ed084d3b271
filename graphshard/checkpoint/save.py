"""save(): every rank writes its shards (DCP), the ranks agree, rank 0 commits; synchronously,
or in a background thread after staging a copy of the state."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from graphshard.checkpoint.agreement import (agree, check_sharded_over_the_world, distributed,
                                             rank_world)
from graphshard.checkpoint.commit import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    check_destination,
    commit,
    graphshard_version,
    write_json_durably,
)
from graphshard.checkpoint.errors import CheckpointError
from graphshard.checkpoint.rng import rng_state, to_bytes
from graphshard.checkpoint.state_dict import collect_state, tensor_entries, unwrap
from graphshard.state import is_sharded, shard_state

ASYNC_ATTR = "_graphshard_async_save"  # where an unsharded model keeps its _AsyncState


class AsyncSave:
    """A checkpoint being written in the background: what `save(..., asynchronous=True)` returns.

    The write, the ranks' agreement that every write succeeded, the completion marker and the
    rename into place all happen in a background thread; the checkpoint at `path` appears only
    when all of that is done. `result()` waits and returns `path`, or raises CheckpointError
    (the same failure on every rank; the previous checkpoint, if any, intact). Call `result()`
    (or `wait()`) before the end of training, and before destroying the process group.
    """

    def __init__(self, path: Path):
        self.path = path
        self._future: concurrent.futures.Future[Path] = concurrent.futures.Future()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the save finished (or failed); True if it did within `timeout` seconds."""
        concurrent.futures.wait([self._future], timeout=timeout)
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        return self._future.result(timeout)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else (
            "failed" if self._future.exception() else "done")
        return f"AsyncSave({str(self.path)!r}, {state})"


@dataclass
class _AsyncState:
    """Per model: the process group its background saves use, and the save in flight.

    The background write's collectives (DCP's, and our agreement on the outcome) run on a gloo
    group of their own: on the default group they could interleave with training's collectives
    issued by the main thread, and ranks would pair different collectives.
    """

    group: Any
    world: Any  # the default group `group` was made for (a new one after re-initialisation)
    pending: AsyncSave | None = None

    # A copied or pickled model makes its own group when it first saves.
    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (_no_async_state, ())


def _no_async_state() -> None:
    return None


def _saved_async_state(model: nn.Module) -> _AsyncState | None:
    """A sharded model keeps it in its ShardState; an unsharded one on itself."""
    if is_sharded(model):
        return shard_state(model).async_save
    return model.__dict__.get(ASYNC_ATTR)


def _async_state(model: nn.Module) -> _AsyncState:
    state = _saved_async_state(model)
    world = dist.group.WORLD if distributed() else None
    if state is None or state.world is not world:
        # A collective: every rank gets here in the same save() call.
        group = dist.new_group(backend="gloo") if distributed() else None
        state = _AsyncState(group, world)
        if is_sharded(model):
            shard_state(model).async_save = state
        else:
            object.__setattr__(model, ASYNC_ATTR, state)
    return state


def wait_for_async_save(model: nn.Module) -> None:
    # One save of a model at a time: a later save (or load) waits for the one in flight. Its
    # outcome is reported by its own handle.
    state = _saved_async_state(model)
    if state is not None and state.pending is not None:
        state.pending.wait()
        state.pending = None


class _AlreadyStaged(AsyncStager):
    """Hands DCP's async_save a state dict that save() already copied (and the ranks agreed
    on), so a staging failure on one rank never leaves the others writing."""

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


def _stage(state: dict[str, Any]) -> dict[str, Any]:
    # DCP's default staging: a deep copy on CPU, so training may update the originals.
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        return stager.stage(state)
    finally:
        stager.close()


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
) -> Path | AsyncSave:
    """Save a (sharded) model, its optimizer, the step, RNG state and `extra` to `path`, atomically.

    Call on every rank with the same path. Each rank writes its own shards (DCP) into a
    temporary sibling directory; only when all ranks succeeded does rank 0 write the completion
    marker and rename the directory to `path`, replacing a previous checkpoint there. If any
    rank fails, every rank raises CheckpointError, the partial directory is removed and the
    previous checkpoint is untouched. `extra` must be picklable; rank 0's copy is saved.
    Works without a process group too (a single process, sharded or not). Returns `path`.

    asynchronous=True (DCP's async_save): copies the state to CPU memory (the only part that
    blocks), returns an AsyncSave handle at once, and writes and commits in a background
    thread while training goes on; the marker is written only after every rank's write
    finished. A later save or load of the same model first waits for it. The staged copy costs
    one more copy of the rank's model and optimizer shards in host memory until it is written.
    """
    path = Path(path)
    model = unwrap(model)
    check_sharded_over_the_world(model, "save")
    rank, world_size = rank_world()
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    wait_for_async_save(model)
    background = _async_state(model) if asynchronous else None

    # 1. Prepare: build the state dict, and rank 0 checks the destination and names the
    #    temporary directory (a sibling, so the final rename stays on one filesystem).
    error: BaseException | None = None
    state: dict[str, Any] = {}
    token = uuid.uuid4().hex[:12]
    # get_state_dict gives a never-stepped optimizer state by running a zero-lr step (Adam's
    # step count becomes 1); undo that, and record it, so a save changes no training run.
    fresh_optimizer = optimizer is not None and not optimizer.state
    try:
        # First, on every rank: get_state_dict may run collectives of its own.
        state.update(collect_state(model, optimizer))
        if fresh_optimizer:
            optimizer.state.clear()
        state["graphshard"] = {"rng": {str(rank): rng_state()}}
        if rank == 0:
            state["graphshard"]["extra"] = to_bytes(dict(extra or {}))
            check_destination(path)
        if asynchronous:
            state = _stage(state)
    except Exception as exc:
        error = exc
    failed, payloads = agree(error, (token, str(path)))
    if failed:
        raise CheckpointError(f"cannot save checkpoint to {path}: {failed}")
    paths = {p for _, p in payloads}
    if len(paths) > 1:
        raise CheckpointError(f"save must get the same path on every rank, got {sorted(paths)}")
    token = payloads[0][0]
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "graphshard_version": graphshard_version(), "torch_version": torch.__version__,
        "step": step, "world_size": world_size, "has_optimizer": optimizer is not None,
        "optimizer_stepped": not fresh_optimizer, "model": tensor_entries(state["model"]),
    }

    if background is None:
        # 2. Write: every rank its own shards. DCP itself reports a failure on any rank to all.
        try:
            dcp.save(state, checkpoint_id=tmp, no_dist=not distributed())
        except (Exception, CheckpointException) as exc:  # CheckpointException: a BaseException
            error = exc
        return _finish(error, tmp, path, token, manifest)

    handle = AsyncSave(path)
    written = dcp.async_save(state, checkpoint_id=tmp, process_group=background.group,
                             async_stager=_AlreadyStaged(), no_dist=not distributed())

    def finish_in_background() -> None:
        error: BaseException | None = None
        try:
            written.result()
        except (Exception, CheckpointException) as exc:
            error = exc
        try:
            handle._future.set_result(_finish(error, tmp, path, token, manifest,
                                              background.group))
        except BaseException as exc:  # noqa: BLE001  (reported through the handle)
            handle._future.set_exception(exc)

    background.pending = handle
    threading.Thread(target=finish_in_background, name=f"graphshard-save-{path.name}",
                     daemon=True).start()
    return handle


def _finish(error: BaseException | None, tmp: Path, path: Path, token: str,
            manifest: dict[str, Any], group: Any = None) -> Path:
    """3. Commit, once every rank's write is done: rank 0 marks the directory complete and
    moves it into place. Every rank returns or raises the same outcome."""
    rank = rank_world()[0]
    failed, _ = agree(error, group=group)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is past writing now
        raise CheckpointError(f"saving checkpoint to {path} failed ({failed}); the previous "
                              f"checkpoint at {path}, if any, is intact")
    error = None
    try:
        if rank == 0:
            write_json_durably(tmp / MANIFEST, manifest)
            commit(tmp, path, token)
    except Exception as exc:
        error = exc
    failed, _ = agree(error, group=group)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"committing checkpoint {path} failed ({failed}); the previous "
                              f"checkpoint at {path}, if any, is intact")
    return path
