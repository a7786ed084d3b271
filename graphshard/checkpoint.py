"""Sharded checkpoints in PyTorch Distributed Checkpoint (DCP) format, and full-weight export.

The storage format is plain DCP: `get_state_dict` / `set_state_dict` with `dcp.save` /
`dcp.load` work on a sharded model directly, and DCP reshards N1 -> N2 ranks at load. The
helpers here add only what DCP leaves to the user:

    graphshard.checkpoint.save(path, model, optimizer, step=100, extra={...})
    info = graphshard.checkpoint.load(path, model, optimizer)     # info.step, info.extra
    graphshard.checkpoint.export(path, "model.safetensors")       # or `graphshard export`

- an atomic save: every rank writes into a sibling `PATH.tmp-<id>`, the ranks agree that all
  writes succeeded, then rank 0 writes the completion marker `graphshard.json` and renames the
  directory into place. A failed or killed save leaves the previous checkpoint at PATH intact;
  a directory without the marker is reported as incomplete on load;
- the step, user `extra` values (rank 0's, pickled) and per-rank RNG state;
- checks that name missing, unexpected and mis-shaped keys before DCP sees them;
- export of the full weights to safetensors, one tensor in memory at a time, at any world size.

Layout of a checkpoint directory: DCP's files (`.metadata`, `__<rank>_<n>.distcp`) holding
`model.<fqn>`, `optim.*` (DCP's flattened optimizer state dict) and `graphshard.*` (extra, RNG),
plus `graphshard.json` (step, world size, graphshard/torch versions, model keys/shapes/dtypes).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import io
import json
import os
import random
import shutil
import struct
import sys
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

MANIFEST = "graphshard.json"
FORMAT = "graphshard.checkpoint"
FORMAT_VERSION = 1
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."

# safetensors dtype names (https://github.com/huggingface/safetensors, format section).
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


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
    world_size: int  # the world size the checkpoint was saved with
    extra: dict[str, Any] = field(default_factory=dict)
    rng_restored: str = "none"  # "saved" (this rank's own state), "derived" or "none"


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


def _gather(value: Any) -> list[Any]:
    """Every rank's `value` (a single-element list outside a process group)."""
    if not _distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _agree(error: BaseException | None, payload: Any = None) -> tuple[str | None, list[Any]]:
    """Share each rank's outcome: (first failure as "rank r: message" or None, payloads).

    Every rank calls this at the same point, so one rank's exception makes all ranks fail at
    once with the same message instead of leaving the others blocked in the next collective.
    """
    message = None if error is None else _describe(error, _rank_world()[0])
    results = _gather((message, payload))
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


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of the checkpoint at `path`; raises a clear error if there is none."""
    path = Path(path)
    if not path.exists():
        moved = sorted(path.parent.glob(f"{path.name}.old-*")) if path.parent.exists() else []
        hint = (f"; a save was interrupted while replacing it, the previous checkpoint is at "
                f"{moved[-1]}" if moved else "")
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist{hint}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: a checkpoint is a directory")
    marker = path / MANIFEST
    if not marker.is_file():
        if not (path / ".metadata").is_file():
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {path}: it has no {MANIFEST} completion marker nor DCP "
                "'.metadata' (the save was interrupted or failed); use the previous checkpoint")
        raise IncompleteCheckpointError(
            f"incomplete checkpoint at {path}: it has no {MANIFEST} completion marker (the save "
            "stopped before committing it, or it was written by plain "
            "torch.distributed.checkpoint.save; load such a one with dcp.load/set_state_dict)")
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


# --------------------------------------------------------------------------- save / load


def _tensor_entries(model_state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            for name, value in model_state.items() if isinstance(value, torch.Tensor)}


def _collect_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} as DCP's get_state_dict gives them (sharded, own names)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save a (sharded) model, its optimizer, the step, RNG state and `extra` to `path`, atomically.

    Call on every rank with the same path. Each rank writes its own shards (DCP) into a
    temporary sibling directory; only when all ranks succeeded does rank 0 write the completion
    marker and rename the directory to `path`, replacing a previous checkpoint there. If any
    rank fails, every rank raises CheckpointError, the partial directory is removed and the
    previous checkpoint is untouched. `extra` must be picklable; rank 0's copy is saved.
    Works without a process group too (a single process, sharded or not).
    """
    path = Path(path)
    model = _unwrap(model)
    rank, world_size = _rank_world()
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")

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

    # 2. Write: every rank its own shards. DCP itself reports a failure on any rank to all.
    try:
        dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        error = exc
    failed, _ = _agree(error)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is past writing now
        raise CheckpointError(f"saving checkpoint to {path} failed ({failed}); the previous "
                              f"checkpoint at {path}, if any, is intact")

    # 3. Commit: rank 0 marks the directory complete and moves it into place.
    try:
        if rank == 0:
            _write_json_durably(tmp / MANIFEST, {
                "format": FORMAT, "format_version": FORMAT_VERSION,
                "graphshard_version": _graphshard_version(), "torch_version": torch.__version__,
                "step": step, "world_size": world_size, "has_optimizer": optimizer is not None,
                "optimizer_stepped": not fresh_optimizer,
                "model": _tensor_entries(state["model"]),
            })
            _commit(tmp, path, token)
    except Exception as exc:
        error = exc
    failed, _ = _agree(error)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"committing checkpoint {path} failed ({failed}); the previous "
                              f"checkpoint at {path}, if any, is intact")
    return path


def _model_keys(metadata: Metadata) -> dict[str, Any]:
    return {key[len(MODEL_PREFIX):]: md for key, md in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX)}


def _check_compatible(path: Path, metadata: Metadata, model_state: dict[str, Any]) -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped key."""
    saved = _model_keys(metadata)
    missing = [k for k in model_state if k not in saved]
    unexpected = [k for k in saved if k not in model_state]
    mismatched = []
    for key, value in model_state.items():
        md = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) \
                and tuple(md.size) != tuple(value.shape):
            mismatched.append(f"{key}: checkpoint {tuple(md.size)} vs model {tuple(value.shape)}")
    problems = []
    if missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {missing}")
    if unexpected:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatch: {'; '.join(mismatched)}")
    if problems:
        raise CheckpointError(f"checkpoint at {path} does not fit this model (is it another "
                              f"model's?): " + "; ".join(problems))


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint saved by `save` into `model` (and `optimizer`), at any world size.

    The model may be sharded over any number of ranks (DCP reshards), or unsharded in a single
    process. RNG: rank r restores the state rank r saved; a rank the checkpoint has no state for
    (more ranks now than at save) is seeded with `derived_seed(rank 0's state, r)`.
    Returns the step, the `extra` dict and the saved world size.
    """
    path = Path(path)
    model = _unwrap(model)
    rank, _ = _rank_world()

    # Validate everything before DCP's collectives, and agree on the outcome, so a bad input
    # gives the same clear error on every rank rather than a hang or an opaque DCP failure.
    error: BaseException | None = None
    state: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    try:
        # First, on every rank: get_state_dict may run collectives of its own.
        state.update(_collect_state(model, optimizer))
        manifest = read_manifest(path)
        metadata = FileSystemReader(path).read_metadata()
        if optimizer is not None and not any(k.startswith(OPTIM_PREFIX)
                                             for k in metadata.state_dict_metadata):
            raise CheckpointError(f"checkpoint at {path} has no optimizer state; "
                                  "load it with optimizer=None")
        _check_compatible(path, metadata, state["model"])
        # Rank r's own RNG state when the checkpoint has one, else rank 0's to derive from.
        source = str(rank) if f"graphshard.rng.{rank}.torch" in metadata.state_dict_metadata \
            else "0"
        rng_keys = [k.rsplit(".", 1)[1] for k in metadata.state_dict_metadata
                    if k.startswith(f"graphshard.rng.{source}.")]
        gs: dict[str, Any] = {"extra": None, "rng": {}}
        if restore_rng and "torch" in rng_keys:
            gs["rng"][source] = {k: torch.get_rng_state() if k == "torch" else None
                                 for k in rng_keys if source == str(rank) or k == "torch"}
        state["graphshard"] = gs
    except Exception as exc:
        error = exc
    failed, _ = _agree(error)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"cannot load checkpoint {path}: {failed}")

    try:
        dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
    except CheckpointException as exc:
        raise CheckpointError(f"loading checkpoint {path} failed: {_describe(exc, rank)}") from None
    if "optim" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if not manifest.get("optimizer_stepped", True):
            optimizer.state.clear()  # saved before its first step: keep it fresh (see save)
    else:
        set_model_state_dict(model, state["model"])

    rng_restored = "none"
    if restore_rng and state["graphshard"]["rng"]:
        saved_rank, rng = next(iter(state["graphshard"]["rng"].items()))
        if saved_rank == str(rank):
            _restore_rng(rng)
            rng_restored = "saved"
        else:
            seed = derived_seed(rng["torch"], rank)
            torch.manual_seed(seed)
            random.seed(seed)
            rng_restored = "derived"
    extra = state["graphshard"]["extra"]
    return CheckpointInfo(path=path, step=manifest.get("step"),
                          world_size=int(manifest.get("world_size", 0)),
                          extra=_from_bytes(extra) if extra is not None else {},
                          rng_restored=rng_restored)


# --------------------------------------------------------------------------- export


class _CachedMetadataReader(FileSystemReader):
    # dcp.load reads the metadata file on every call; export calls it once per tensor.
    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:
        return self._metadata


def _safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                        metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so tensor data is 8-aligned
    return struct.pack("<Q", len(raw)) + raw


def _export_entries(path: Path, manifest: dict[str, Any],
                    metadata: Metadata) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    saved = _model_keys(metadata)
    listed = list(manifest.get("model", {}))  # the model's state_dict order
    order = listed + [k for k in saved if k not in listed]
    entries, skipped = [], []
    for name in order:
        md = saved.get(name)
        if not isinstance(md, TensorStorageMetadata):
            skipped.append(name)
            continue
        entries.append((name, md.properties.dtype, tuple(md.size)))
    if skipped:
        warnings.warn(f"checkpoint {path}: non-tensor model state {skipped} cannot be stored in "
                      "safetensors and is not exported", stacklevel=3)
    unsupported = [f"{n} ({d})" for n, d, _ in entries if d not in _SAFETENSORS_DTYPES]
    if unsupported:
        raise CheckpointError(f"checkpoint {path}: safetensors cannot store {unsupported}")
    return entries


def _load_full(path: Path, name: str, dtype: torch.dtype, shape: tuple[int, ...],
               reader: FileSystemReader | None = None) -> torch.Tensor:
    full = torch.empty(shape, dtype=dtype)
    # The key is flattened exactly as DCP flattened {"model": {name: ...}} at save time.
    dcp.load({"model": {name: full}}, storage_reader=reader or FileSystemReader(path),
             no_dist=True)
    return full


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Write a checkpoint's full, unsharded model weights (and buffers) to a safetensors file.

    Names are the model's own state_dict keys (tied weights under each name), so
    `model.load_state_dict(safetensors.torch.load_file(out), strict=True)` works on the
    unsharded model. Streams: the header is written first, then one full tensor at a time.
    The file appears at `out` only when complete. Returns the exported names.
    """
    path, out = Path(checkpoint), Path(out)
    manifest = read_manifest(path)
    if out.is_dir() or not out.parent.is_dir():
        raise CheckpointError(f"cannot write {out}: " + (
            "it is a directory" if out.is_dir() else f"directory {out.parent} does not exist"))
    metadata = FileSystemReader(path).read_metadata()
    entries = _export_entries(path, manifest, metadata)
    reader = _CachedMetadataReader(path, metadata)
    meta = {"format": "pt", "graphshard_step": str(manifest.get("step"))}
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(_safetensors_header(entries, meta))
            for name, dtype, shape in entries:
                full = _load_full(path, name, dtype, shape, reader)
                f.write(full.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
                del full  # one full tensor at a time
        os.replace(tmp, out)
    except CheckpointException as exc:
        raise CheckpointError(f"reading checkpoint {path} failed: {_describe(exc, 0)}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return [name for name, _, _ in entries]


def main(argv: list[str] | None = None) -> int:
    """`graphshard export CHECKPOINT OUT.safetensors`."""
    parser = argparse.ArgumentParser(
        prog="graphshard export",
        description="Write a graphshard (DCP) checkpoint's full, unsharded weights to a "
                    "safetensors file, loadable into the unsharded model with "
                    "load_state_dict(safetensors.torch.load_file(OUT), strict=True).")
    parser.add_argument("checkpoint", help="checkpoint directory written by "
                                           "graphshard.checkpoint.save (any world size)")
    parser.add_argument("out", help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        names = export(args.checkpoint, args.out)
    except (CheckpointError, OSError) as exc:
        print(f"graphshard export: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(names)} tensors to {args.out}")
    return 0
