"""Command-line values the tools share, parsed one way: `--model-args` and `--ac`.

Each parser is an argparse `type=` function: bad input raises argparse.ArgumentTypeError with a
message saying what is accepted (argparse puts the flag's name before it).
"""

from __future__ import annotations

import argparse
import ast

from graphshard.activation_checkpointing import MODES as AC_MODES

AC_HELP = ("activation checkpointing of the repeated blocks: none, full (recompute each block "
           "in backward) or selective (keep its matmul and attention outputs)")


def parse_model_args(text: str) -> tuple[tuple[str, object], ...]:
    """'dim=32,n_layers=1' -> (('dim', 32), ('n_layers', 1)); values are Python literals, or
    strings where they are not (name=gpt2)."""
    pairs = []
    for item in (part for part in text.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        try:
            pairs.append((key.strip(), ast.literal_eval(value.strip())))
        except (ValueError, SyntaxError):
            pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def parse_ac_modes(text: str) -> tuple[str, ...]:
    """'none,full' -> ('none', 'full'): activation checkpointing modes, comma-separated."""
    modes = tuple(mode.strip() for mode in text.split(",") if mode.strip())
    bad = [mode for mode in modes if mode not in AC_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"expected {', '.join(AC_MODES)} (comma-separated), got {text!r}")
    return modes


def parse_ac_mode(text: str) -> str:
    """One activation checkpointing mode (as `parse_ac_modes` spells them)."""
    modes = parse_ac_modes(text)
    if len(modes) != 1:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(AC_MODES)}, got {text!r} "
                                         "(`graphshard plan --ac` tries several)")
    return modes[0]
