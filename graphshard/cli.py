"""The `graphshard` command: one entry point, one subcommand per tool.

Each subcommand lives in its own module with a `main(argv) -> int`; they are imported lazily
so `graphshard --help` stays fast and one tool's import cost does not burden another.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "train": ("graphshard.train", "train the built-in Transformer on N local processes"),
    "dump": ("graphshard.dump", "show what the compiler does to a model, at any world size"),
    "export": ("graphshard.checkpoint", "write a sharded checkpoint's full weights to safetensors"),
    "calibrate": ("graphshard.cost_model", "measure this machine's cost-model parameters"),
    "bench": ("bench.__main__", "compare graphshard with DDP, FSDP2 and SimpleFSDP"),
}


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
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
