"""Sharded checkpoints in PyTorch Distributed Checkpoint (DCP) format; weights in and out.

The storage format is plain DCP: `get_state_dict` / `set_state_dict` with `dcp.save` /
`dcp.load` work on a sharded model directly, and DCP reshards N1 -> N2 ranks at load. The
helpers here add only what DCP leaves to the user:

    graphshard.checkpoint.save(path, model, optimizer, step=100, extra={...})
    handle = graphshard.checkpoint.save(path, model, optimizer, step=100, asynchronous=True)
    info = graphshard.checkpoint.load(path, model, optimizer)     # info.step, info.extra
    graphshard.checkpoint.export(path, "model.safetensors")       # or a directory (HF layout)
    graphshard.checkpoint.load_pretrained(model, "hf_model_dir")  # safetensors in, slice by slice

- an atomic save: every rank writes into a sibling `PATH.tmp-<id>`, the ranks agree that all
  writes succeeded, then rank 0 writes the completion marker `graphshard.json` and renames the
  directory into place. A failed or killed save leaves the previous checkpoint at PATH intact;
  a graphshard checkpoint without the marker is reported as incomplete on load. An asynchronous
  save does the same in the background, after staging a copy of the state;
- the step, user `extra` values (rank 0's, pickled) and per-rank RNG state;
- load and export of any DCP checkpoint of the model: graphshard's own, plain `dcp.save` of a
  state dict (at the root, or under "model" with the optimizer under "optim"/"optimizer"),
  FSDP2's (`get_state_dict` + `dcp.save`), with checks that name missing, unexpected and
  mis-shaped keys before DCP sees them;
- export of the full weights to safetensors (one file, or Hugging Face's sharded layout), one
  tensor in memory at a time, at any world size; and the way back: pretrained safetensors
  weights into a meta-built sharded model, each rank reading only its own rows.

Layout of a graphshard checkpoint directory: DCP's files (`.metadata`, `__<rank>_<n>.distcp`)
holding `model.<fqn>`, `optim.*` (DCP's flattened optimizer state dict) and `graphshard.*`
(extra, RNG), plus `graphshard.json` (step, world size, versions, model keys/shapes/dtypes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import random
import shutil
import sys
import threading
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from graphshard import safetensors_io as st
from graphshard._transformers import transformers_names
from graphshard.early_optimizers import use_sharded_parameters
from graphshard import sharding
from graphshard.sharding import is_sharded, shard_state

MANIFEST = "graphshard.json"
FORMAT = "graphshard.checkpoint"
FORMAT_VERSION = 1
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
DEFAULT_MAX_SHARD_SIZE = "5GB"  # Hugging Face's save_pretrained default
_OPTIM_KEYS = ("optim", "optimizer")  # graphshard / the README's name, torchtitan's
_ASYNC_ATTR = "_graphshard_async_save"


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, loaded or exported; the message says why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is a checkpoint whose save did not finish (no completion marker)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What `load` returns besides the restored model and optimizer."""

    path: Path
    step: int | None
    world_size: int | None  # the world size it was saved with; None when not recorded (not ours)
    extra: dict[str, Any] = field(default_factory=dict)
    rng_restored: str = "none"  # "saved" (this rank's own state), "derived" or "none"
    format: str = "graphshard"  # "graphshard" (has our marker) or "dcp" (plain DCP, FSDP2, ...)


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


# --------------------------------------------------------------------------- distributed glue


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _describe(exc: BaseException, rank: int) -> str:
    if isinstance(exc, CheckpointException):
        # DCP gathers every rank's failure; its str() is a wall of tracebacks.
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}"
                         for r, (e, _) in sorted(exc.failures.items()))
    if isinstance(exc, CheckpointError):
        return f"rank {rank}: {exc}"
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def _gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value` (a single-element list outside a process group)."""
    if not _distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _agree(error: BaseException | None, payload: Any = None,
           group: Any = None) -> tuple[str | None, list[Any]]:
    """Share each rank's outcome: (first failure as "rank r: message" or None, payloads).

    Every rank calls this at the same point, so one rank's exception makes all ranks fail at
    once with the same message instead of leaving the others blocked in the next collective.
    """
    message = None if error is None else _describe(error, _rank_world()[0])
    results = _gather((message, payload), group)
    # A DCP failure is reported identically by every rank: say it once.
    failures = dict.fromkeys(msg for msg, _ in results if msg is not None)
    return ("; ".join(failures) or None), [p for _, p in results]


def _unwrap(model: nn.Module) -> nn.Module:
    # torch.compile's OptimizedModule prefixes every key with `_orig_mod.`; save the model's
    # own names so a checkpoint does not depend on whether the model was compiled.
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return getattr(model, "_orig_mod", model)


# --------------------------------------------------------------------------- checkpoint files


def _graphshard_version() -> str:
    try:
        return importlib.metadata.version("graphshard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _check_directory(path: Path) -> None:
    if not path.exists():
        moved = sorted(path.parent.glob(f"{path.name}.old-*")) if path.parent.exists() else []
        hint = (f"; a save was interrupted while replacing it, the previous checkpoint is at "
                f"{moved[-1]}" if moved else "")
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist{hint}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: a checkpoint is a directory")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of the graphshard checkpoint at `path`; raises a clear error if
    there is none (plain DCP checkpoints have none: `load` and `export` accept them anyway)."""
    path = Path(path)
    _check_directory(path)
    marker = path / MANIFEST
    if not marker.is_file():
        if not (path / ".metadata").is_file():
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {path}: it has no {MANIFEST} completion marker nor DCP "
                "'.metadata' (the save was interrupted or failed); use the previous checkpoint")
        raise IncompleteCheckpointError(
            f"incomplete checkpoint at {path}: it has no {MANIFEST} completion marker (the save "
            "stopped before committing it, or it is not a graphshard checkpoint)")
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise IncompleteCheckpointError(f"incomplete checkpoint at {path}: unreadable {MANIFEST} "
                                        f"({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{marker} is not a graphshard checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint at {path} has format version {manifest['format_version']}; this "
            f"graphshard ({_graphshard_version()}) reads up to {FORMAT_VERSION}: upgrade it")
    return manifest


@dataclass(frozen=True)
class _Layout:
    """Where a DCP checkpoint keeps the model and optimizer state dicts."""

    model_prefix: str  # "model." (under a "model" key) or "" (the state dict at the root)
    model: dict[str, Any]  # the model's state_dict keys -> DCP storage metadata
    optim_key: str | None  # the optimizer state dict's top-level key, if there is one
    graphshard: bool  # has graphshard.* entries: written by save(), so it needs the marker


def _layout(metadata: Metadata) -> _Layout:
    entries = metadata.state_dict_metadata
    planned = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    def path_of(key: str) -> tuple:
        # DCP flattens nested dicts by joining keys with "."; its planner records each key's
        # original path, which tells {"model": {"a.b": t}} from a root key "model.a.b".
        path = planned.get(key)
        if isinstance(path, tuple) and path:
            return path
        head, dot, rest = key.partition(".")  # no record (a custom planner): guess
        return (head, rest) if dot and head in ("model", "graphshard", *_OPTIM_KEYS) else (key,)

    paths = {key: path_of(key) for key in entries}
    nested = any(p[0] == "model" and len(p) > 1 for p in paths.values())
    if nested:
        model = {key[len(MODEL_PREFIX):]: md for key, md in entries.items()
                 if paths[key][0] == "model" and len(paths[key]) > 1}
    else:
        model = {key: md for key, md in entries.items() if len(paths[key]) == 1}
    optim = [name for name in _OPTIM_KEYS
             if any(len(p) > 2 and p[0] == name and p[1] in ("state", "param_groups")
                    for p in paths.values())]
    return _Layout(MODEL_PREFIX if nested else "", model, optim[0] if optim else None,
                   any(p[0] == "graphshard" and len(p) > 1 for p in paths.values()))


def _open(path: Path) -> tuple[dict[str, Any] | None, Metadata, _Layout]:
    """(graphshard manifest or None, DCP metadata, layout) of any DCP checkpoint at `path`.

    The completion marker guards graphshard's own saves only: a plain DCP checkpoint is
    complete when it has DCP's `.metadata`, which DCP writes after every rank's data.
    """
    _check_directory(path)
    manifest = read_manifest(path) if (path / MANIFEST).is_file() else None
    if not (path / ".metadata").is_file():
        if manifest is not None:
            raise CheckpointError(f"checkpoint at {path} is damaged: it has a {MANIFEST} but no "
                                  "DCP '.metadata'")
        read_manifest(path)  # raises the incomplete-checkpoint error
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001  (a truncated or foreign file: say which)
        raise CheckpointError(f"cannot read DCP metadata of {path}: {type(exc).__name__}: "
                              f"{exc}") from None
    layout = _layout(metadata)
    if manifest is None and layout.graphshard:
        read_manifest(path)  # a graphshard save that stopped before its commit
    if not layout.model:
        raise CheckpointError(f"checkpoint at {path} holds no model state dict (looked at the "
                              "root and under 'model')")
    return manifest, metadata, layout


def _write_json_durably(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform/filesystem; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_destination(path: Path) -> None:
    # Never replace something that is not one of our checkpoints: PATH may be a typo for data.
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory")
    if any(path.iterdir()) and not (path / MANIFEST).is_file():
        raise CheckpointError(f"refusing to replace {path}: it exists and is not a complete "
                              "graphshard checkpoint; remove it or choose another path")


def _commit(tmp: Path, path: Path, token: str) -> None:
    """Move the finished `tmp` to `path`, keeping any previous checkpoint until it succeeds."""
    old = path.with_name(f"{path.name}.old-{token}") if path.exists() else None
    if old is not None:
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- RNG state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _to_bytes(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def derived_seed(saved_rank0_state: torch.Tensor, rank: int) -> int:
    """Seed for a rank the checkpoint has no RNG state for (it was saved with fewer ranks).

    Deterministic in (rank 0's saved state, rank), and different for each rank, so a resumed
    run is reproducible and its ranks do not draw identical random streams.
    """
    digest = hashlib.sha256(saved_rank0_state.numpy().tobytes() + rank.to_bytes(8, "little"))
    return int.from_bytes(digest.digest()[:8], "little")


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("python") is not None:
        random.setstate(_from_bytes(state["python"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_bytes(value: Any) -> bytes:
    # Pre-serialised so DCP stores one opaque object instead of flattening nested dicts.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# --------------------------------------------------------------------------- save


def _tensor_entries(model_state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            for name, value in model_state.items() if isinstance(value, torch.Tensor)}


@contextlib.contextmanager
def _plain_classes(model: nn.Module) -> Iterator[None]:
    """DCP's get_state_dict / set_state_dict find every parameter with getattr(module, name);
    on a sharded module that is the property that all-gathers the full parameter (one
    collective per parameter per call: most of a save's blocking time). For the call, each
    sharded module gets its plain class back, so getattr returns the sharded nn.Parameter."""
    swapped = []
    for module in model.modules():
        plain = getattr(type(module), "_graphshard_base_class", None)
        if plain is not None and plain is not type(module):
            swapped.append((module, type(module)))
            module.__class__ = plain
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _collect_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} as DCP's get_state_dict gives them (sharded, own names)."""
    with _plain_classes(model):
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        use_sharded_parameters(optimizer)  # one created before shard()
        model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


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


def _async_state(model: nn.Module) -> _AsyncState:
    state = model.__dict__.get(_ASYNC_ATTR)
    world = dist.group.WORLD if _distributed() else None
    if state is None or state.world is not world:
        # A collective: every rank gets here in the same save() call.
        group = dist.new_group(backend="gloo") if _distributed() else None
        state = _AsyncState(group, world)
        object.__setattr__(model, _ASYNC_ATTR, state)
    return state


def _wait_for_async_save(model: nn.Module) -> None:
    # One save of a model at a time: a later save (or load) waits for the one in flight. Its
    # outcome is reported by its own handle.
    state = model.__dict__.get(_ASYNC_ATTR)
    if state is not None and state.pending is not None:
        state.pending.wait()
        state.pending = None


class _AlreadyStaged(AsyncStager):
    """Hands DCP's async_save a state dict that save() already copied (and the ranks agreed
    on), so a staging failure on one rank never leaves the others writing."""

    _synchronize_after_execute = False

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
    model = _unwrap(model)
    rank, world_size = _rank_world()
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    _wait_for_async_save(model)
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
        state.update(_collect_state(model, optimizer))
        if fresh_optimizer:
            optimizer.state.clear()
        state["graphshard"] = {"rng": {str(rank): _rng_state()}}
        if rank == 0:
            state["graphshard"]["extra"] = _to_bytes(dict(extra or {}))
            _check_destination(path)
        if asynchronous:
            state = _stage(state)
    except Exception as exc:
        error = exc
    failed, payloads = _agree(error, (token, str(path)))
    if failed:
        raise CheckpointError(f"cannot save checkpoint to {path}: {failed}")
    paths = {p for _, p in payloads}
    if len(paths) > 1:
        raise CheckpointError(f"save must get the same path on every rank, got {sorted(paths)}")
    token = payloads[0][0]
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "graphshard_version": _graphshard_version(), "torch_version": torch.__version__,
        "step": step, "world_size": world_size, "has_optimizer": optimizer is not None,
        "optimizer_stepped": not fresh_optimizer, "model": _tensor_entries(state["model"]),
    }

    if background is None:
        # 2. Write: every rank its own shards. DCP itself reports a failure on any rank to all.
        try:
            dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
        except (Exception, CheckpointException) as exc:  # CheckpointException: a BaseException
            error = exc
        return _finish(error, tmp, path, token, manifest)

    handle = AsyncSave(path)
    written = dcp.async_save(state, checkpoint_id=tmp, process_group=background.group,
                             async_stager=_AlreadyStaged(), no_dist=not _distributed())

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
    rank = _rank_world()[0]
    failed, _ = _agree(error, group=group)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is past writing now
        raise CheckpointError(f"saving checkpoint to {path} failed ({failed}); the previous "
                              f"checkpoint at {path}, if any, is intact")
    error = None
    try:
        if rank == 0:
            _write_json_durably(tmp / MANIFEST, manifest)
            _commit(tmp, path, token)
    except Exception as exc:
        error = exc
    failed, _ = _agree(error, group=group)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"committing checkpoint {path} failed ({failed}); the previous "
                              f"checkpoint at {path}, if any, is intact")
    return path


# --------------------------------------------------------------------------- load


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
    _raise_if_unfit(missing, unexpected, mismatched, "checkpoint",
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
    process. RNG (graphshard checkpoints): rank r restores the state rank r saved; a rank the
    checkpoint has no state for (more ranks now than at save) is seeded with
    `derived_seed(rank 0's state, r)`. Returns the step, the `extra` dict and the saved world
    size (None for checkpoints that are not graphshard's).
    """
    path = Path(path)
    model = _unwrap(model)
    rank, _ = _rank_world()
    _wait_for_async_save(model)

    # Validate everything before DCP's collectives, and agree on the outcome, so a bad input
    # gives the same clear error on every rank rather than a hang or an opaque DCP failure.
    error: BaseException | None = None
    request: dict[str, Any] = {}
    manifest: dict[str, Any] | None = None
    layout: _Layout | None = None
    try:
        # First, on every rank: get_state_dict may run collectives of its own.
        state = _collect_state(model, optimizer)
        manifest, metadata, layout = _open(path)
        if optimizer is not None and layout.optim_key is None:
            raise CheckpointError(f"checkpoint at {path} has no optimizer state (looked under "
                                  f"{' and '.join(map(repr, _OPTIM_KEYS))}); load it with "
                                  "optimizer=None")
        _check_compatible(path, layout.model, state["model"])
        request = {"model": state["model"]} if layout.model_prefix else dict(state["model"])
        if optimizer is not None:
            request[layout.optim_key] = state["optim"]
        if layout.graphshard:
            request["graphshard"] = _rng_request(metadata, rank, restore_rng)
    except Exception as exc:
        error = exc
    failed, _ = _agree(error)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"cannot load checkpoint {path}: {failed}")

    try:
        dcp.load(request, checkpoint_id=path, no_dist=not _distributed())
    except CheckpointException as exc:
        raise CheckpointError(f"loading checkpoint {path} failed: {_describe(exc, rank)}") from None
    # DCP fills tensors in place and replaces other values in `request`: read them back there.
    model_state = request["model"] if layout.model_prefix else {
        k: request[k] for k in state["model"]}
    with _plain_classes(model):
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
    rng_restored = "none"
    if restore_rng and gs["rng"]:
        saved_rank, rng = next(iter(gs["rng"].items()))
        if saved_rank == str(rank):
            _restore_rng(rng)
            rng_restored = "saved"
        else:
            seed = derived_seed(rng["torch"], rank)
            torch.manual_seed(seed)
            random.seed(seed)
            rng_restored = "derived"
    if manifest is None:
        return CheckpointInfo(path=path, step=None, world_size=None, format="dcp")
    return CheckpointInfo(path=path, step=manifest.get("step"),
                          world_size=int(manifest.get("world_size", 0)),
                          extra=_from_bytes(gs["extra"]) if gs["extra"] is not None else {},
                          rng_restored=rng_restored)


def _rng_request(metadata: Metadata, rank: int, restore_rng: bool) -> dict[str, Any]:
    """The graphshard.* entries to read: `extra`, and rank r's own RNG state when the
    checkpoint has one, else rank 0's to derive from."""
    keys = metadata.state_dict_metadata
    source = str(rank) if f"graphshard.rng.{rank}.torch" in keys else "0"
    rng_keys = [k.rsplit(".", 1)[1] for k in keys if k.startswith(f"graphshard.rng.{source}.")]
    request: dict[str, Any] = {"extra": None, "rng": {}}
    if restore_rng and "torch" in rng_keys:
        request["rng"][source] = {k: torch.get_rng_state() if k == "torch" else None
                                  for k in rng_keys if source == str(rank) or k == "torch"}
    return request


# --------------------------------------------------------------------------- export


class _CachedMetadataReader(FileSystemReader):
    # dcp.load reads the metadata file on every call; export calls it once per tensor.
    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:
        return self._metadata


Entry = tuple[str, torch.dtype, tuple[int, ...]]


def _export_entries(path: Path, manifest: dict[str, Any] | None, layout: _Layout) -> list[Entry]:
    listed = list((manifest or {}).get("model", {}))  # the model's state_dict order
    order = listed + [k for k in layout.model if k not in listed]
    entries, skipped = [], []
    for name in order:
        md = layout.model.get(name)
        if not isinstance(md, TensorStorageMetadata):
            skipped.append(name)
            continue
        entries.append((name, md.properties.dtype, tuple(md.size)))
    if skipped:
        warnings.warn(f"checkpoint {path}: non-tensor model state {skipped} cannot be stored in "
                      "safetensors and is not exported", stacklevel=3)
    unsupported = [f"{n} ({d})" for n, d, _ in entries if d not in st.DTYPES]
    if unsupported:
        raise CheckpointError(f"checkpoint {path}: safetensors cannot store {unsupported}")
    return entries


def _load_full(path: Path, name: str, dtype: torch.dtype, shape: tuple[int, ...],
               reader: FileSystemReader | None = None, prefix: str = MODEL_PREFIX) -> torch.Tensor:
    full = torch.empty(shape, dtype=dtype)
    # The key is flattened exactly as DCP flattened the state dict at save time.
    request = {"model": {name: full}} if prefix else {name: full}
    dcp.load(request, storage_reader=reader or FileSystemReader(path), no_dist=True)
    return full


def _write_safetensors(out: Path, entries: list[Entry], metadata: dict[str, str],
                       tensor: Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor]) -> None:
    """Header first, then one full tensor at a time; `out` must not be the final name."""
    with open(out, "wb") as f:
        f.write(st.header(entries, metadata))
        for name, dtype, shape in entries:
            st.write_tensor(f, tensor(name, dtype, shape))  # dropped before the next one
        f.flush()
        os.fsync(f.fileno())


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
           max_shard_size: int | str | None = None,
           config: str | os.PathLike | None = None) -> list[str]:
    """Write a DCP checkpoint's full, unsharded model weights (and buffers) to safetensors.

    `out` ending in `.safetensors`: one file, loadable into the unsharded model with
    `model.load_state_dict(safetensors.torch.load_file(out), strict=True)`. Any other `out`
    is a directory in Hugging Face's layout, loadable with `from_pretrained(out)`:
    `model-0000i-of-0000N.safetensors` files of at most `max_shard_size` (default "5GB";
    bytes, "500MB", "2GiB") and `model.safetensors.index.json`, or a single
    `model.safetensors` when everything fits in one; `config` (a config.json) is copied in as
    `config.json`. Weight files of an earlier export there are replaced.

    Accepts graphshard's checkpoints and plain DCP / FSDP2 ones. Names are the model's own
    state_dict keys (tied weights under each name). Streams: one full tensor in memory at a
    time; files appear under their final names only when complete. Returns the exported names.
    """
    path, out = Path(checkpoint), Path(out)
    manifest, metadata, layout = _open(path)
    directory = out.is_dir() or out.suffix != ".safetensors"
    if not directory and (max_shard_size is not None or config is not None):
        raise CheckpointError(f"{out} is a single .safetensors file; max_shard_size and config "
                              "apply to a directory in Hugging Face's layout")
    if not out.parent.is_dir():
        raise CheckpointError(f"cannot write {out}: directory {out.parent} does not exist")
    if directory and out.exists() and not out.is_dir():
        raise CheckpointError(f"cannot write a Hugging Face layout to {out}: it is a file")
    try:
        limit = st.parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    except st.SafetensorsError as exc:
        raise CheckpointError(f"max_shard_size: {exc}") from None
    config_text = _read_config(config) if config is not None else None
    entries = _export_entries(path, manifest, layout)
    reader = _CachedMetadataReader(path, metadata)
    meta = {"format": "pt"}  # transformers refuses files whose format is not "pt"
    if manifest is not None:
        meta["graphshard_step"] = str(manifest.get("step"))

    def tensor(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return _load_full(path, name, dtype, shape, reader, layout.model_prefix)

    token = uuid.uuid4().hex[:8]
    temporary: list[Path] = []
    try:
        if not directory:
            temporary.append(out.with_name(f"{out.name}.tmp-{token}"))
            _write_safetensors(temporary[0], entries, meta, tensor)
            os.replace(temporary[0], out)
        else:
            _export_directory(out, entries, meta, tensor, limit, config_text, token, temporary)
    except CheckpointException as exc:
        raise CheckpointError(f"reading checkpoint {path} failed: {_describe(exc, 0)}") from None
    finally:
        for tmp in temporary:
            if tmp.exists():
                tmp.unlink()
    return [name for name, _, _ in entries]


def _read_config(config: str | os.PathLike) -> str:
    try:
        text = Path(config).read_text()
        if not isinstance(json.loads(text), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"config {config} is not a readable JSON config: {exc}") from None
    return text


def _export_directory(out: Path, entries: list[Entry], meta: dict[str, str],
                      tensor: Callable, limit: int, config_text: str | None, token: str,
                      temporary: list[Path]) -> None:
    out.mkdir(exist_ok=True)
    shards = st.plan_shards(entries, limit)
    names = st.shard_file_names(len(shards))
    for name, shard in zip(names, shards):
        temporary.append(out / f".{name}.tmp-{token}")
        _write_safetensors(temporary[-1], shard, meta, tensor)
    # Every file is complete: move them in, then the index, then drop an earlier export's
    # files (from_pretrained prefers model.safetensors to an index, so a stale one must go).
    for tmp, name in zip(temporary, names):
        os.replace(tmp, out / name)
    if len(names) > 1:
        weight_map = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
        total = sum(st.nbytes(dtype, shape) for _, dtype, shape in entries)
        _write_json_durably(out / st.INDEX_FILE, st.index(weight_map, total))
    if config_text is not None:
        (out / "config.json").write_text(config_text)
    for stale in out.iterdir():
        if st.is_layout_file(stale.name) and stale.name not in names \
                and not (stale.name == st.INDEX_FILE and len(names) > 1):
            stale.unlink()
    _fsync_dir(out)


# --------------------------------------------------------------------------- pretrained weights


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
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                if kind == "buffer" and name in module._non_persistent_buffers_set:
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
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard or coordinate is None:
            raise CheckpointError(f"cannot load pretrained weights into a {placement} placement")
        start, stop = region[placement.dim]
        length, parts = stop - start, mesh.size(mesh_dim)
        chunk = -(-length // parts)
        lo = min(coordinate[mesh_dim] * chunk, length)
        region[placement.dim] = (start + lo, start + min(lo + chunk, length))
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


def _transformers_conversion(model: nn.Module) -> tuple[list, list[str]]:
    """transformers' conversion of `model`'s checkpoint keys, as its from_pretrained applies it
    and its save_pretrained undoes it: (the renamings: GPT-NeoX's embed_out -> lm_head, old
    LayerNorm gamma/beta -> weight/bias, ...; the weights it fuses from several checkpoint
    tensors, such as MoE experts, which load_pretrained does not). Nothing for other models."""
    pretrained = transformers_names("transformers", "PreTrainedModel")
    if pretrained is None or not isinstance(model, pretrained[0]):
        return [], []
    conversion = transformers_names("transformers.conversion_mapping", "WeightConverter",
                                    "WeightRenaming", "get_model_conversion_mapping")
    if conversion is None:  # a transformers from before its conversion mapping
        return [], []
    WeightConverter, WeightRenaming, get_model_conversion_mapping = conversion
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [target for t in transforms if isinstance(t, WeightConverter)
             for target in t.target_patterns])


def _loaded_name(name: str, renamings: list) -> str:
    for renaming in renamings:
        name = renaming.rename_source_key(name)[0]
    return name


def _pretrained_plan(model: nn.Module, tensors: dict[str, st.TensorInfo], path: Path,
                     init_fn: Callable | None) -> list[tuple[_Target, str]]:
    """(target, name to read it from) for every model tensor; names checked first."""
    targets, transient = _targets(model)
    known = {name for target in targets for name in target.names}
    transient_names = {name for _, _, name in transient}
    renamings, fused = _transformers_conversion(model)
    file_name: dict[str, str] = {}  # model's name -> file's
    for name in tensors:
        loaded = _loaded_name(name, renamings)
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
    _raise_if_unfit(missing, unexpected, mismatched, "file",
                    f"pretrained weights at {path} do not fit this model" + (
                        f" (transformers fuses this architecture's {', '.join(fused)} when it "
                        "loads a checkpoint, which load_pretrained does not: load such a model "
                        "with from_pretrained before graphshard.shard)" if fused and missing else ""))
    if uninitialised and init_fn is None:
        raise CheckpointError(
            f"buffers {uninitialised} are on the meta device and not in {path} (non-persistent: "
            "computed in __init__): pass init_fn=, called on each module that owns one to "
            "compute them, e.g. init_fn=model._init_weights for a Hugging Face model")
    return plan


def _init_transient_buffers(model: nn.Module, init_fn: Callable, device: torch.device) -> None:
    modules = {id(m): m for m, local, _ in _targets(model)[1] if m._buffers[local].is_meta}
    for module in modules.values():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device=device)
        # On the plain class, as graphshard.materialize does: a sharded module's parameter
        # properties would hand init_fn gathered copies.
        sharded_cls = type(module)
        module.__class__ = getattr(sharded_cls, "_graphshard_base_class", sharded_cls)
        try:
            init_fn(module)
        finally:
            module.__class__ = sharded_cls


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
        graphshard.checkpoint.load_pretrained(model, "path/to/hf_model",
                                              init_fn=model._init_weights)

    Meta parameters and buffers are allocated (this rank's shard only) on the mesh's device;
    already materialised ones are overwritten in place. Call on every rank, before creating
    the optimizer. Names are checked first: every missing, unexpected and mis-shaped name is
    reported, on every rank, before anything is read. Tied parameters need only one of their
    names in the file (save_pretrained stores a tied embedding once; a file holding several,
    from the untied model, loads the first and warns). Values are cast to each
    parameter's dtype. Non-persistent buffers are not in such files: those still on the meta
    device are allocated and `init_fn(module)` is called on each module owning one (for a
    Hugging Face model, `model._init_weights` recomputes rotary frequencies). Peak host memory
    per rank: its shards plus one tensor's rows. Returns the names read.
    """
    model = _unwrap(model)
    path = Path(path)
    error: BaseException | None = None
    plan: list[tuple[_Target, str]] = []
    tensors: dict[str, st.TensorInfo] = {}
    try:
        tensors = st.resolve(path)
        plan = _pretrained_plan(model, tensors, path, init_fn)
    except (CheckpointError, st.SafetensorsError, OSError) as exc:
        error = exc
    failed, _ = _agree(error)
    if error is not None:
        raise (error if isinstance(error, CheckpointError) else CheckpointError(str(error)))
    if failed:
        raise CheckpointError(f"cannot load pretrained weights from {path}: {failed}")
    device = _device_for(model)
    with torch.no_grad():
        if init_fn is not None:
            _init_transient_buffers(model, init_fn, device)
        for target, source in plan:
            _load_target(target, tensors[source], device)
    # Meta parameters were replaced by new ones, as materialize() replaces them: whatever
    # graphshard.shard keeps bound to the old ones (the local shards the compiled graph reads)
    # must follow.
    rebind = getattr(sharding, "bind_local_shards", None)
    if rebind is not None and is_sharded(model):
        rebind(model)
    return [source for _, source in plan]


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """`graphshard export CHECKPOINT OUT.safetensors | OUT_DIR [--max-shard-size] [--config]`."""
    parser = argparse.ArgumentParser(
        prog="graphshard export",
        description="Write a DCP checkpoint's full, unsharded weights to safetensors: one file "
                    "(OUT ends in .safetensors), loadable with load_state_dict("
                    "safetensors.torch.load_file(OUT), strict=True), or a directory in Hugging "
                    "Face's layout (sharded files and an index) that from_pretrained loads.")
    parser.add_argument("checkpoint", help="checkpoint directory: graphshard.checkpoint.save, "
                                           "plain dcp.save or FSDP2 (any world size)")
    parser.add_argument("out", help="output .safetensors file, or a directory")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help=f"directory output: largest file (default {DEFAULT_MAX_SHARD_SIZE}; "
                             "KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)")
    parser.add_argument("--config", default=None, metavar="CONFIG_JSON",
                        help="directory output: a config.json to copy in (for from_pretrained)")
    args = parser.parse_args(argv)
    try:
        names = export(args.checkpoint, args.out, max_shard_size=args.max_shard_size,
                       config=args.config)
    except (CheckpointError, OSError) as exc:
        print(f"graphshard export: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(names)} tensors to {args.out}")
    return 0


def _raise_if_unfit(missing: list, unexpected: list, mismatched: list, source: str,
                    headline: str) -> None:
    """One CheckpointError naming every key that does not fit, before anything is loaded."""
    problems = []
    if missing:
        problems.append(f"missing (in the model, not in the {source}): {missing}")
    if unexpected:
        problems.append(f"unexpected (in the {source}, not in the model): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatch: {'; '.join(mismatched)}")
    if problems:
        raise CheckpointError(f"{headline}: " + "; ".join(problems))
