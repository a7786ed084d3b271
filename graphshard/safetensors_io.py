"""The safetensors format and Hugging Face's sharded layout, read and written a piece at a time.

graphshard reads and writes the format itself rather than through the `safetensors` package:
the package's PyTorch reader maps the whole file and hands out views into the mapping, so every
page a rank touches stays resident until the file and all views are released (loading half a
file's rows measured the rows twice over: the copy plus the mapped pages). Here a rank reads
exactly its own byte ranges into its own tensors with `readinto`, and a writer streams one
tensor at a time. The format (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}} padded to 8 bytes, then the tensors' bytes, row-major, little-endian.

Hugging Face's sharded layout: `model-00001-of-0000N.safetensors` files plus
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}});
a checkpoint that fits in one shard is a single `model.safetensors` with no index.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


class SafetensorsError(ValueError):
    """A file is not valid safetensors, or a layout cannot be read or written; says why."""


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- writing


def header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
           metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for tensors written afterwards in `entries` order."""
    head: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise SafetensorsError(f"safetensors cannot store {name} ({dtype})")
        size = nbytes(dtype, shape)
        head[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so tensor data is 8-aligned
    return struct.pack("<Q", len(raw)) + raw


def write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Append one tensor's bytes (the next entry of the header)."""
    f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def parse_size(size: int | str) -> int:
    """Bytes in a size like Hugging Face's `max_shard_size`: 5000000, "5GB", "5GiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
        if not match:
            raise SafetensorsError(f"invalid size {size!r}: use bytes or a number with a unit "
                                   "(KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB: of 1024)")
        unit = (match.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        power = "BKMGT".index(unit[0])
        value = int(float(match.group(1)) * base ** power)
    if value <= 0:
        raise SafetensorsError(f"size must be positive, got {size!r}")
    return value


def plan_shards(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                max_bytes: int) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Split entries, in order, into files of at most `max_bytes` (a bigger tensor alone), as
    Hugging Face's save_pretrained does."""
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        entry_bytes = nbytes(entry[1], entry[2])
        if shards[-1] and size + entry_bytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry_bytes
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def is_layout_file(name: str) -> bool:
    """A weights file of Hugging Face's layout (what an export into a directory replaces)."""
    return name in (SINGLE_FILE, INDEX_FILE) or bool(_SHARD_NAME.fullmatch(name))


def index(weight_map: dict[str, str], total_size: int) -> dict[str, Any]:
    return {"metadata": {"total_size": total_size}, "weight_map": weight_map}


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte, from the start of the file


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Each tensor's dtype, shape and position in `file`, checked against the file's size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(f"{file} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_MAX_HEADER, size - 8):
                raise SafetensorsError(f"{file} is not a safetensors file (header length {length})")
            head = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"cannot read safetensors header of {file}: {exc}") from exc
    if not isinstance(head, dict):
        raise SafetensorsError(f"{file} is not a safetensors file (header is not an object)")
    start = 8 + length
    tensors = {}
    for name, entry in head.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _TORCH_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except KeyError as exc:
            raise SafetensorsError(f"{file}: tensor {name!r} has unsupported dtype or no "
                                   f"{exc}") from exc
        except (TypeError, ValueError) as exc:
            raise SafetensorsError(f"{file}: malformed header entry for {name!r}") from exc
        if end - begin != nbytes(dtype, shape) or start + end > size or begin < 0:
            raise SafetensorsError(f"{file}: tensor {name!r} has data_offsets {[begin, end]} that "
                                   f"do not fit its shape {list(shape)} or the file")
        tensors[name] = TensorInfo(file, dtype, shape, start + begin)
    return tensors


def resolve(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors checkpoint: one file, an index file, or a directory with
    `model.safetensors.index.json` or `model.safetensors` (Hugging Face's names)."""
    path = Path(path)
    if not path.exists():
        raise SafetensorsError(f"no checkpoint at {path}: the path does not exist")
    if path.is_dir():
        # Hugging Face's own order of preference, then any single weights file or index.
        standard = [path / name for name in (SINGLE_FILE, INDEX_FILE) if (path / name).is_file()]
        found = standard[:1] or sorted(path.glob("*.safetensors.index.json")) \
            or sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            what = ", ".join(p.name for p in found) or "no .safetensors files"
            raise SafetensorsError(f"cannot tell which weights to load in {path} ({what}): "
                                   f"expected {SINGLE_FILE} or {INDEX_FILE}, or pass a file")
        path = found[0]
    if path.name.endswith(".json"):
        return _resolve_index(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        raise SafetensorsError(f"{path} is a pickle checkpoint; only safetensors is read "
                               "(convert it with transformers' save_pretrained)")
    return read_header(path)


def _resolve_index(path: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SafetensorsError(f"{path} is not a safetensors index (no weight_map: "
                               f"{exc})") from exc
    headers: dict[str, dict[str, TensorInfo]] = {}
    tensors = {}
    for name, file in weight_map.items():
        if file not in headers:
            if not (path.parent / file).is_file():
                raise SafetensorsError(f"{path} maps {name!r} to {file}, which does not exist")
            headers[file] = read_header(path.parent / file)
        if name not in headers[file]:
            raise SafetensorsError(f"{path} maps {name!r} to {file}, which does not contain it")
        tensors[name] = headers[file][name]
    return tensors


def read(info: TensorInfo, rows: tuple[int, int] | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, stop) of dim 0 (all of it when None), read from disk, nothing else.

    Into `out` (a contiguous CPU tensor of that dtype and shape) when given, else a new tensor.
    """
    start, stop = rows if rows is not None else (0, info.shape[0] if info.shape else 1)
    row_shape = info.shape[1:]
    shape = (stop - start, *row_shape) if info.shape else ()
    if out is None:
        out = torch.empty(shape, dtype=info.dtype)
    if tuple(out.shape) != shape or out.dtype != info.dtype or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise SafetensorsError(f"cannot read {shape} {info.dtype} into a {tuple(out.shape)} "
                               f"{out.dtype} tensor on {out.device}")
    row_bytes = nbytes(info.dtype, row_shape)
    buffer = out.reshape(-1).view(torch.uint8).numpy()
    if buffer.nbytes == 0:
        return out
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.offset + start * row_bytes)
        view = memoryview(buffer)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise SafetensorsError(f"{info.file} ends before its tensor data does")
            done += got
    return out
