"""Where a DCP checkpoint keeps the model and optimizer state dicts.

graphshard's own saves, a plain `dcp.save` of a state dict (at the root, or under "model" with
the optimizer under "optim"/"optimizer") and FSDP2 runs (`get_state_dict` + `dcp.save`) all
read the same way once their layout is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from graphshard.checkpoint.commit import DCP_METADATA, MANIFEST, check_directory, read_manifest
from graphshard.checkpoint.errors import CheckpointError

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
OPTIM_KEYS = ("optim", "optimizer")  # graphshard's / the DCP tutorials' name, torchtitan's


@dataclass(frozen=True)
class Layout:
    """Where a DCP checkpoint keeps the model and optimizer state dicts."""

    model_prefix: str  # "model." (under a "model" key) or "" (the state dict at the root)
    model: dict[str, Any]  # the model's state_dict keys -> DCP storage metadata
    optim_key: str | None  # the optimizer state dict's top-level key, if there is one
    graphshard: bool  # has graphshard.* entries: written by save(), so it needs the marker


def layout_of(metadata: Metadata) -> Layout:
    entries = metadata.state_dict_metadata
    planned = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    def path_of(key: str) -> tuple:
        # DCP flattens nested dicts by joining keys with "."; its planner records each key's
        # original path, which tells {"model": {"a.b": t}} from a root key "model.a.b".
        path = planned.get(key)
        if isinstance(path, tuple) and path:
            return path
        head, dot, rest = key.partition(".")  # no record (a custom planner): guess
        return (head, rest) if dot and head in ("model", "graphshard", *OPTIM_KEYS) else (key,)

    paths = {key: path_of(key) for key in entries}
    nested = any(p[0] == "model" and len(p) > 1 for p in paths.values())
    if nested:
        model = {key[len(MODEL_PREFIX):]: md for key, md in entries.items()
                 if paths[key][0] == "model" and len(paths[key]) > 1}
    else:
        model = {key: md for key, md in entries.items() if len(paths[key]) == 1}
    optim = [name for name in OPTIM_KEYS
             if any(len(p) > 2 and p[0] == name and p[1] in ("state", "param_groups")
                    for p in paths.values())]
    return Layout(MODEL_PREFIX if nested else "", model, optim[0] if optim else None,
                  any(p[0] == "graphshard" and len(p) > 1 for p in paths.values()))


def open_checkpoint(path: Path) -> tuple[dict[str, Any] | None, Metadata, Layout]:
    """(graphshard manifest or None, DCP metadata, layout) of any DCP checkpoint at `path`.

    The completion marker guards graphshard's own saves only: a plain DCP checkpoint is
    complete when it has DCP's `.metadata`, which DCP writes after every rank's data.
    """
    check_directory(path)
    manifest = read_manifest(path) if (path / MANIFEST).is_file() else None
    if not (path / DCP_METADATA).is_file():
        if manifest is not None:
            raise CheckpointError(f"checkpoint at {path} is damaged: it has a {MANIFEST} but no "
                                  "DCP '.metadata'")
        read_manifest(path)  # raises: incomplete, or a folder of checkpoints
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001  (a truncated or foreign file: say which)
        raise CheckpointError(f"cannot read DCP metadata of {path}: {type(exc).__name__}: "
                              f"{exc}") from exc
    layout = layout_of(metadata)
    if manifest is None and layout.graphshard:
        read_manifest(path)  # a graphshard save that stopped before its commit
    if not layout.model:
        raise CheckpointError(f"checkpoint at {path} holds no model state dict (looked at the "
                              "root and under 'model')")
    return manifest, metadata, layout
