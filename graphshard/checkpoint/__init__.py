"""Sharded checkpoints in PyTorch Distributed Checkpoint (DCP) format; weights in and out.

The storage format is plain DCP: `get_state_dict` / `set_state_dict` with `dcp.save` /
`dcp.load` work on a sharded model directly, and DCP reshards N1 -> N2 ranks at load. The
helpers here add only what DCP leaves to the user:

    graphshard.checkpoint.save(path, model, optimizer, step=100, extra={...})
    handle = graphshard.checkpoint.save(path, model, optimizer, step=100, asynchronous=True)
    info = graphshard.checkpoint.load(path, model, optimizer)     # info.step, info.extra
    graphshard.checkpoint.export(path, "model.safetensors")       # or a directory (HF layout)
    graphshard.checkpoint.load_pretrained(model, "hf_model_dir")  # safetensors in, slice by slice

- an atomic save (commit.py): every rank writes into a sibling `PATH.tmp-<id>`, the ranks agree
  that all writes succeeded (agreement.py), then rank 0 writes the completion marker
  `graphshard.json` and renames the directory into place. A failed or killed save leaves the
  previous checkpoint at PATH intact; a graphshard checkpoint without the marker is reported
  as incomplete on load. An asynchronous save (save.py) does the same in the background,
  after staging a copy of the state;
- the step, user `extra` values (rank 0's, pickled) and per-rank RNG state (rng.py);
- load (load.py) and export (export.py) of any DCP checkpoint of the model: graphshard's own,
  plain `dcp.save` of a state dict (at the root, or under "model" with the optimizer under
  "optim"/"optimizer"), FSDP2's (`get_state_dict` + `dcp.save`), told apart by layout.py, with
  checks that name missing, unexpected and mis-shaped keys before DCP sees them;
- export of the full weights to safetensors (one file, or Hugging Face's sharded layout), one
  tensor in memory at a time, at any world size; and the way back (pretrained.py): pretrained
  safetensors weights into a meta-built sharded model, each rank reading only its own rows,
  following transformers' key renames and buffer initialisation (transformers_models.py).

Layout of a graphshard checkpoint directory: DCP's files (`.metadata`, `__<rank>_<n>.distcp`)
holding `model.<fqn>`, `optim.*` (DCP's flattened optimizer state dict) and `graphshard.*`
(extra, RNG), plus `graphshard.json` (step, world size, versions, model keys/shapes/dtypes).
"""

from graphshard.checkpoint.cli import main
from graphshard.checkpoint.commit import FORMAT, FORMAT_VERSION, MANIFEST, read_manifest
from graphshard.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
)
from graphshard.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, export
from graphshard.checkpoint.layout import MODEL_PREFIX, OPTIM_PREFIX
from graphshard.checkpoint.load import CheckpointInfo, load
from graphshard.checkpoint.pretrained import load_pretrained
from graphshard.checkpoint.rng import derived_seed
from graphshard.checkpoint.save import AsyncSave, save

__all__ = [
    "save", "load", "export", "load_pretrained", "read_manifest", "derived_seed", "main",
    "AsyncSave", "CheckpointInfo", "CheckpointError", "CheckpointNotFoundError",
    "IncompleteCheckpointError", "MANIFEST", "FORMAT", "FORMAT_VERSION", "MODEL_PREFIX",
    "OPTIM_PREFIX", "DEFAULT_MAX_SHARD_SIZE",
]
