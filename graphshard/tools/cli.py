"""The `graphshard` command: one entry point, one subcommand per tool.

Each subcommand lives in its own module with a `main(argv) -> int`; they are imported lazily
so `graphshard --help` stays fast and one tool's import cost does not burden another.
"""

from __future__ import annotations

import importlib
import sys
import warnings

SUBCOMMANDS = {
    "train": ("graphshard.tools.train", "the demo: a byte-level LM on Python's own sources, N ranks"),
    "dump": ("graphshard.tools.dump", "show what the compiler does to a model, at any world size"),
    "export": ("graphshard.checkpoint", "write a checkpoint's weights to safetensors (or HF dir)"),
    "calibrate": ("graphshard.tools.calibrate", "measure this machine's cost-model parameters"),
    "plan": ("graphshard.tools.plan", "pick the fastest configuration that fits a cluster you do not have"),
    "bench": ("graphshard.bench.__main__", "compare graphshard with DDP, FSDP2 and SimpleFSDP"),
}

# Warnings that say nothing to a user of a command. Export reads a checkpoint in one process by
# design; torch.distributed.checkpoint warns at every load without a process group.
SILENCED_WARNINGS = {
    "export": (r"torch\.distributed is disabled, unavailable or uninitialized",),
}


def parse_dtype(name: str):
    """A dtype flag's value -> torch.dtype ("bf16", "bfloat16" and "torch.bfloat16" alike).
    Raises argparse.ArgumentTypeError (argparse's message for a `type=` function) otherwise."""
    import argparse

    from graphshard.policy import dtype_from_name

    try:
        return dtype_from_name(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _usage() -> str:
    lines = ["usage: graphshard COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `graphshard COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"graphshard: unknown command {command!r}; valid: {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        for message in SILENCED_WARNINGS.get(command, ()):
            warnings.filterwarnings("ignore", message=message)
        module = importlib.import_module(SUBCOMMANDS[command][0])
        return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
