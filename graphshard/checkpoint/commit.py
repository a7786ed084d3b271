"""A checkpoint directory on disk: its completion marker (the manifest), the atomic commit of a
finished save, and durable writes.

Every rank writes into a sibling `PATH.tmp-<id>`; once all ranks' writes succeeded, rank 0
writes the marker `graphshard.json` and renames the directory into place, moving a previous
checkpoint aside until the rename succeeded. A failed or killed save leaves the previous
checkpoint at PATH intact, and a directory without the marker reads as incomplete.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import Any

from graphshard.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
)

MANIFEST = "graphshard.json"
FORMAT = "graphshard.checkpoint"
FORMAT_VERSION = 1
DCP_METADATA = ".metadata"


def graphshard_version() -> str:
    try:
        return importlib.metadata.version("graphshard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_directory(path: Path) -> None:
    if not path.exists():
        moved = sorted(path.parent.glob(f"{path.name}.old-*")) if path.parent.exists() else []
        hint = (f"; a save was interrupted while replacing it, the previous checkpoint is at "
                f"{moved[-1]}" if moved else "")
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist{hint}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: a checkpoint is a directory")


def checkpoints_in(folder: Path) -> list[Path]:
    """The complete checkpoints directly inside `folder` (graphshard's, or plain DCP ones),
    oldest first by the time their save finished."""
    found = []
    for child in folder.iterdir():
        if not child.is_dir() or ".tmp-" in child.name:
            continue
        marker = child / MANIFEST if (child / MANIFEST).is_file() else child / DCP_METADATA
        if marker.is_file():
            found.append((marker.stat().st_mtime, child.name, child))
    return [child for *_, child in sorted(found)]


def _not_a_checkpoint(path: Path, inside: list[Path]) -> CheckpointError:
    names = ", ".join(child.name for child in inside)
    return CheckpointError(
        f"{path} is not a checkpoint but a folder holding {len(inside)} checkpoint"
        f"{'s' if len(inside) > 1 else ''} ({names}; newest last): pass one of them, e.g. "
        f"{inside[-1]} to resume from the newest")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of the graphshard checkpoint at `path`; raises a clear error if
    there is none (plain DCP checkpoints have none: `load` and `export` accept them anyway)."""
    path = Path(path)
    check_directory(path)
    marker = path / MANIFEST
    if not marker.is_file():
        if not (path / DCP_METADATA).is_file():
            inside = checkpoints_in(path)
            if inside:
                raise _not_a_checkpoint(path, inside)
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
                                        f"({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{marker} is not a graphshard checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint at {path} has format version {manifest['format_version']}; this "
            f"graphshard ({graphshard_version()}) reads up to {FORMAT_VERSION}: upgrade it")
    return manifest


def write_json_durably(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable, where the platform can (the rename itself is
    atomic either way; some filesystems cannot open or fsync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_destination(path: Path) -> None:
    # Never replace something that is not one of our checkpoints: PATH may be a typo for data.
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory")
    if any(path.iterdir()) and not (path / MANIFEST).is_file():
        raise CheckpointError(f"refusing to replace {path}: it exists and is not a complete "
                              "graphshard checkpoint; remove it or choose another path")


def commit(tmp: Path, path: Path, token: str) -> None:
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
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
