"""Per-rank RNG state in a checkpoint: saved by each rank, restored by the same rank, derived
for a rank the checkpoint has none for (resumed on more ranks than it was saved with)."""

from __future__ import annotations

import hashlib
import io
import random
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": to_bytes(random.getstate()),
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


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("python") is not None:
        random.setstate(from_bytes(state["python"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def restore_or_derive(saved: dict[str, dict[str, Any]], rank: int) -> str:
    """Restore this rank's saved state, or seed from rank 0's: "saved", "derived" or "none"."""
    if not saved:
        return "none"
    saved_rank, state = next(iter(saved.items()))
    if saved_rank == str(rank):
        restore_rng(state)
        return "saved"
    seed = derived_seed(state["torch"], rank)
    torch.manual_seed(seed)
    random.seed(seed)
    return "derived"


def rng_request(metadata: Metadata, rank: int, restore_rng: bool) -> dict[str, Any]:
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


def to_bytes(value: Any) -> bytes:
    # Pre-serialised so DCP stores one opaque object instead of flattening nested dicts.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)
