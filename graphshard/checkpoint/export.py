"""export(): a DCP checkpoint's full weights to safetensors, one file or Hugging Face's sharded
layout, one full tensor in memory at a time, at any world size the checkpoint was saved with."""

from __future__ import annotations

import json
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from graphshard import safetensors_io as st
from graphshard.checkpoint.agreement import describe
from graphshard.checkpoint.commit import fsync_dir, write_json_durably
from graphshard.checkpoint.errors import CheckpointError
from graphshard.checkpoint.layout import MODEL_PREFIX, Layout, open_checkpoint

DEFAULT_MAX_SHARD_SIZE = "5GB"  # Hugging Face's save_pretrained default

Entry = tuple[str, torch.dtype, tuple[int, ...]]


class _CachedMetadataReader(FileSystemReader):
    # dcp.load reads the metadata file on every call; export calls it once per tensor.
    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self.cached_metadata = metadata

    def read_metadata(self) -> Metadata:
        return self.cached_metadata


def _export_entries(path: Path, manifest: dict[str, Any] | None, layout: Layout) -> list[Entry]:
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
    `config.json`. Weight files of a previous export there are replaced.

    Accepts graphshard's checkpoints and plain DCP / FSDP2 ones. Names are the model's own
    state_dict keys (tied weights under each name). Streams: one full tensor in memory at a
    time; files appear under their final names only when complete. Returns the exported names.
    """
    path, out = Path(checkpoint), Path(out)
    manifest, metadata, layout = open_checkpoint(path)
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
        raise CheckpointError(f"max_shard_size: {exc}") from exc
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
        raise CheckpointError(f"reading checkpoint {path} failed: {describe(exc, 0)}") from exc
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
        raise CheckpointError(f"config {config} is not a readable JSON config: {exc}") from exc
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
    # Every file is complete: move them in, then the index, then drop a previous export's
    # files (from_pretrained prefers model.safetensors to an index, so a stale one must go).
    for tmp, name in zip(temporary, names):
        os.replace(tmp, out / name)
    if len(names) > 1:
        weight_map = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
        total = sum(st.nbytes(dtype, shape) for _, dtype, shape in entries)
        write_json_durably(out / st.INDEX_FILE, st.index(weight_map, total))
    if config_text is not None:
        (out / "config.json").write_text(config_text)
    for stale in out.iterdir():
        if st.is_layout_file(stale.name) and stale.name not in names \
                and not (stale.name == st.INDEX_FILE and len(names) > 1):
            stale.unlink()
    fsync_dir(out)
