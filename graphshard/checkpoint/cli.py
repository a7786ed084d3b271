"""`graphshard export`: a checkpoint's full weights to safetensors, from the command line."""

from __future__ import annotations

import argparse
import sys

from graphshard.checkpoint.errors import CheckpointError
from graphshard.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, export


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

