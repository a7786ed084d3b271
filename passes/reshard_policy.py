"""Decide, explicitly, what the forward keeps for backward: each unit's gathered weights or not.

Runs on the joint graph before partitioning. A parameter that is resharded after forward is
tagged MUST_RECOMPUTE, so the partitioner saves its (small) shard and the backward gathers it
again; one kept gathered is tagged MUST_SAVE. Left untagged, the min-cut partitioner would save
full gathered weights whenever that looks cheaper, which is exactly the memory FSDP exists to
avoid.

Who decides (backend option `reshard_after_forward`, decided per unit: a repeated block such as
`layers.3`, or the module owning a parameter outside repeated blocks):
- None (default): the sharding strategy. full_shard reshards every unit except the tail of
  forward (`kept_by_default`): the last repeated block and what forward uses from its start on
  (a language model's last block, final norm and output projection), as torchtitan keeps its
  last block and FSDP2 its root. Backward needs them first: the last unit's weights are still
  gathered when forward ends, and the last block is gathered again at once (prefetched at the
  start of backward, where the all-to-all transport also holds a send buffer of its size), so
  keeping them costs its weights only over forward's tail, below backward's peak, and saves
  the gathers that nothing in backward comes early enough to hide. shard_grad_op keeps every
  unit.
- True / False: every unit resharded / kept.
- {module-name pattern: bool}: fnmatch patterns on module names ("layers.*", "layers.0.attn");
  a pattern covers a module and everything in it; where several match, the deepest module wins
  (then the later pattern). Unmatched units follow the default.
- "auto": the backend measures, keeps the units that save the most communication time per byte
  kept within `memory_budget_mb`, and hands the choice to this pass as `ctx.keep_gathered`
  (parameter names; see `rank_units_to_keep`), always with the default's tail of forward.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import is_unshard, tensor_bytes, unit_of
from graphshard.passes.markers import UnshardSpec


def reshard_unit(param_name: str) -> str:
    """The unit a parameter is kept or resharded with: its repeated block, else its module."""
    return unit_of(param_name) or param_name.rpartition(".")[0]


def _backward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of the joint graph that depend on a tangent (the output's gradient): backward."""
    backward: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return backward


def _forward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of the joint graph that forward's outputs need. Not the nodes that need no
    tangent but only backward uses (a weight's transpose for a gradient matmul): the joint
    graph may place those anywhere."""
    backward = _backward_nodes(gm)
    output = next(iter(gm.graph.find_nodes(op="output")))
    frontier = [node for node in output.all_input_nodes if node not in backward]
    forward: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node not in forward:
            forward.add(node)
            frontier.extend(node.all_input_nodes)
    return forward


def kept_by_default(gm: fx.GraphModule) -> frozenset[str]:
    """Parameters full_shard keeps gathered from forward to backward (of a joint graph): those of
    the last repeated block forward runs and of every unit forward uses from that block's start
    on (the final norm, the output projection, a tied embedding); in a model without repeated
    blocks, those of the unit forward uses last. Backward needs them first, in that order."""
    forward = _forward_nodes(gm)
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    first_use: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for node in gm.graph.nodes:
        if is_unshard(node):
            name = UnshardSpec.from_node(node).name
            uses = [index[u] for u in node.users if u in forward]
            if uses:
                first_use[name] = min(first_use.get(name, len(index)), min(uses))
                last_use[name] = max(last_use.get(name, -1), max(uses))
    if not last_use:
        return frozenset()
    in_blocks = [name for name in last_use if unit_of(name) is not None]
    if not in_blocks:
        last = reshard_unit(max(last_use, key=last_use.get))
        return frozenset(name for name in last_use if reshard_unit(name) == last)
    last_block = unit_of(max(in_blocks, key=last_use.get))
    start = min(first_use[name] for name in in_blocks if unit_of(name) == last_block)
    units = {reshard_unit(name) for name, last in last_use.items() if last >= start}
    return frozenset(name for name in last_use if reshard_unit(name) in units)


def _pattern_choice(unit: str, patterns: Mapping[str, bool]) -> bool | None:
    """The value of the deepest module matched by a pattern (later patterns win ties)."""
    parts = unit.split(".") if unit else []
    prefixes = [".".join(parts[:depth]) for depth in range(len(parts) + 1)]
    best: tuple[int, bool] | None = None
    for pattern, value in patterns.items():
        depth = max((d for d, prefix in enumerate(prefixes) if fnmatch.fnmatchcase(prefix, pattern)),
                    default=None)
        if depth is not None and (best is None or depth >= best[0]):
            best = (depth, value)
    return None if best is None else best[1]


def params_to_keep(gm: fx.GraphModule, option) -> frozenset[str]:
    """Parameters whose gathered weights forward keeps for backward, for every option but "auto"."""
    tail = kept_by_default(gm)
    keep = set()
    for node in gm.graph.nodes:
        if not is_unshard(node):
            continue
        spec = UnshardSpec.from_node(node)
        default = not spec.reshard_after_forward or spec.name in tail  # keep gathered?
        if option is None:
            kept = default
        elif isinstance(option, bool):
            kept = not option
        else:
            choice = _pattern_choice(reshard_unit(spec.name), option)
            kept = default if choice is None else not choice
        if kept:
            keep.add(spec.name)
    return frozenset(keep)


@dataclass(frozen=True)
class UnitCost:
    unit: str
    kept_bytes: int  # gathered bytes held from forward to backward if kept (rank-invariant)
    saved_seconds: float  # the backward all-gather(s) keeping it saves (rank-invariant)


def unit_costs(joint: fx.GraphModule, regathered: Collection[str],
               gather_seconds: Callable[[int, int], float]) -> list[UnitCost]:
    """Per unit, the bytes keeping it gathered holds and the backward gather that saves: one
    bucketed all-gather of its parameters that backward gathers again when resharded
    (`regathered`: not an embedding's, whose backward needs no weight). Full sizes and group
    sizes are the same on every rank (uneven shards differ; these do not)."""
    nbytes: dict[str, int] = {}
    group_size: dict[str, int] = {}
    for node in joint.graph.nodes:
        if is_unshard(node) and UnshardSpec.from_node(node).name in regathered:
            spec = UnshardSpec.from_node(node)
            unit = reshard_unit(spec.name)
            nbytes[unit] = nbytes.get(unit, 0) + tensor_bytes(node.meta["val"])
            group_size[unit] = spec.gather_size
    # Last unit of forward first: ties in rank_units_to_keep go to the units backward gathers
    # first, whose gathers have the least compute before them to hide behind.
    return [UnitCost(unit, size, gather_seconds(size, group_size[unit]))
            for unit, size in reversed(nbytes.items())]


def rank_units_to_keep(costs: Iterable[UnitCost]) -> list[str]:
    """Most communication time saved per byte kept first (ties: the given order).

    Every input is rank-invariant, so every rank ranks the units identically; the backend keeps
    the longest prefix that fits the budget, its length agreed across ranks, so all ranks keep
    the same units and run the same collectives.
    """
    return [c.unit for c in sorted(costs, key=lambda c: -c.saved_seconds / max(c.kept_bytes, 1))]


def tag_reshard_policy(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    option = ctx.options.reshard_after_forward if ctx else None
    keep = ctx.keep_gathered if ctx and ctx.keep_gathered is not None else (
        params_to_keep(gm, None if option == "auto" else option))
    for node in gm.graph.nodes:
        if is_unshard(node):
            kept = UnshardSpec.from_node(node).name in keep
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.MUST_RECOMPUTE
    return gm
