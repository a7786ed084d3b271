"""What a unit is: the group of parameters bucketed, resharded and checkpointed together.

A parameter's *block* is its repeated block: its name up to the first numeric component, the
index into a ModuleList or Sequential (`model.layers.3.self_attn.q_proj.weight` ->
`model.layers.3`; `encoder.layers.0.linear1.weight` -> `encoder.layers.0`). Nested lists count
at their outermost index (`blocks.2.experts.5.w` -> `blocks.2`). A parameter outside repeated
blocks (embeddings, the final norm, the head) has no block, and is the unit of its module
(`lm_head.weight` -> `lm_head`; a parameter of the root module: the root, ""). Names are those
of a parameter's first registration, as the marker ops carry them: a tied weight belongs to
the unit of the name it was first registered under.

Used by bucketing (a bucket never spans two blocks), the reshard policy (what stays gathered
for backward, decided per unit), activation checkpointing and the bench's FSDP2 wrapping (the
blocks of a model), and the planner (its depth).
"""

from __future__ import annotations

import torch.nn as nn


def block_of(param_name: str) -> str | None:
    """The repeated block a parameter belongs to, or None outside repeated blocks."""
    parts = param_name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return None


def unit_of(param_name: str) -> str:
    """The unit a parameter is bucketed, kept or resharded with: its block, else its module."""
    return block_of(param_name) or param_name.rpartition(".")[0]


def named_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The model's repeated blocks by name, in registration order (`block_of` of each of its
    parameters)."""
    names = dict.fromkeys(block for name, _ in model.named_parameters()
                          if (block := block_of(name)) is not None)
    return {name: model.get_submodule(name) for name in names}


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (`named_blocks`); raises ValueError if it has none."""
    blocks = list(named_blocks(model).values())
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (no parameter inside an "
                         "nn.ModuleList or nn.Sequential)")
    return blocks
