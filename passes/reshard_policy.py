"""Decide, explicitly, what the forward keeps for backward: each unit's gathered weights or not.

Runs on the joint graph before partitioning. A parameter that is resharded after forward is
tagged MUST_RECOMPUTE, so the partitioner saves its (small) shard and the backward gathers it
again; one kept gathered is tagged MUST_SAVE. Left untagged, the min-cut partitioner would save
full gathered weights whenever that looks cheaper, which is exactly the memory FSDP exists to
avoid.

Who decides (backend option `reshard_after_forward`, decided per unit: a repeated block such as
`layers.3`, or the module owning a parameter outside repeated blocks):
- None (default): the sharding strategy. full_shard reshards every unit except the tail of
  forward: the unit forward uses last (its weights are still gathered when forward ends and
  backward needs them first: keeping them saves a gather at no cost in peak memory, as FSDP2
  keeps its root), and, where that costs no peak memory either (`keeping_costs_peak_memory`,
  decided by the backend on the partition), the last repeated block and the other units forward
  uses from its start on (a language model's last block and final norm), as torchtitan keeps
  its last block: backward gathers it again at once, where nothing comes early enough to hide
  the gather. shard_grad_op keeps every unit.
- True / False: every unit resharded / kept.
- {module-name pattern: bool}: fnmatch patterns on module names ("layers.*", "layers.0.attn");
  a pattern covers a module and everything in it; where several match, the deepest module wins
  (then the later pattern). Unmatched units follow the default.
- "auto": the backend measures, keeps the units that save the most communication time per byte
  kept within `memory_budget_mb`, and hands the choice to this pass as `ctx.keep_gathered`
  (parameter names; see `rank_units_to_keep`), always with the last unit of forward.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping, Sequence

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import is_reduce_grad, is_unshard, tensor_bytes
from graphshard.passes.liveness import Buffers, live_bytes, saved_activations
from graphshard.passes.markers import UnshardSpec
from graphshard.passes.units import block_of, unit_of


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


def _forward_uses(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """Parameter name -> (first, last) index of its forward uses in the joint graph."""
    forward = _forward_nodes(gm)
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    uses: dict[str, tuple[int, int]] = {}
    for node in gm.graph.nodes:
        if is_unshard(node):
            name = UnshardSpec.from_node(node).name
            at = [index[u] for u in node.users if u in forward]
            if at:
                first, last = uses.get(name, (len(index), -1))
                uses[name] = (min(first, min(at)), max(last, max(at)))
    return uses


def last_forward_unit(gm: fx.GraphModule) -> frozenset[str]:
    """Parameters of the unit whose weight forward uses last (of a joint graph): still gathered
    when forward ends, and the first backward needs."""
    return _last_unit(_forward_uses(gm))


def _last_unit(uses: Mapping[str, tuple[int, int]]) -> frozenset[str]:
    if not uses:
        return frozenset()
    unit = unit_of(max(uses, key=lambda name: uses[name][1]))
    return frozenset(name for name in uses if unit_of(name) == unit)


def tail_of_forward(gm: fx.GraphModule) -> frozenset[str]:
    """Parameters of the last repeated block forward runs and of every other unit forward uses
    from that block's start on (of a joint graph), but not the last unit's: what the default
    also keeps where that costs no peak memory. Empty without repeated blocks."""
    return _tail(_forward_uses(gm))


def _tail(uses: Mapping[str, tuple[int, int]]) -> frozenset[str]:
    in_blocks = [name for name in uses if block_of(name) is not None]
    if not in_blocks:
        return frozenset()
    last_block = block_of(max(in_blocks, key=lambda name: uses[name][1]))
    start = min(uses[name][0] for name in in_blocks if block_of(name) == last_block)
    units = {unit_of(name) for name, (_, last) in uses.items() if last >= start}
    return frozenset(name for name in uses if unit_of(name) in units) - _last_unit(uses)


def kept_from_forward(forward: fx.GraphModule) -> frozenset[str]:
    """Parameters whose gathered weights a partitioned forward (unshard markers, before
    lowering) saves for backward: what the policy kept, where backward uses it."""
    buffers = Buffers(forward)
    output = next(iter(forward.graph.find_nodes(op="output")))
    saved = {b for value in output.all_input_nodes for b in buffers.owned.get(value, ())}
    return frozenset(UnshardSpec.from_node(node).name for node in forward.graph.nodes
                     if is_unshard(node) and saved & set(buffers.owned[node]))


def _read_spans(nodes: Sequence[fx.Node], buffers: Buffers, skip: fx.Node | None = None
                ) -> dict[int, tuple[int, int]]:
    """Buffer -> (first, last) index of the nodes but `skip` that read a value holding it."""
    spans: dict[int, tuple[int, int]] = {}
    for i, node in enumerate(nodes):
        if node is skip:
            continue
        for arg in node.all_input_nodes:
            for b in buffers.owned.get(arg, ()):
                first, last = spans.get(b, (i, i))
                spans[b] = (min(first, i), max(last, i))
    return spans


def keeping_costs_peak_memory(forward: fx.GraphModule, backward: fx.GraphModule,
                              params: Collection[str], compute_seconds: Callable[[fx.Node], float],
                              gather_seconds: Callable[[int], float], send_buffer: bool) -> bool:
    """Whether keeping `params` gathered from forward to backward raises the step's predicted
    peak, judged on the partition that keeps them (before lowering: unshard markers, no
    buckets yet) against the least that resharding them could hold: each unit's gathered
    weights freed after their last use in forward, and gathered again in backward where the
    scheduler would issue that gather at the latest (the last slot whose compute before the
    weights' first use covers the gather's time, by the cost model; else the start, as
    reorder_collectives issues a graph's first gathers), beside the send buffer of their size
    that the all-to-all transport holds until then (`send_buffer`). Where the peak lies outside the
    stretches this adds, keeping costs nothing. Only sizes that are the same on every rank
    count (not the reduced gradient shards: uneven shards differ), so every rank decides alike
    without a collective."""
    counted = lambda node: not is_reduce_grad(node)  # noqa: E731
    fw_nodes, fw_buffers = list(forward.graph.nodes), Buffers(forward)
    fw_live = live_bytes(fw_nodes, fw_buffers, counted)
    fw_freed = [0] * len(fw_nodes)  # [t]: bytes resharding frees just before slot t
    output = fw_nodes[-1]
    fw_spans = _read_spans(fw_nodes, fw_buffers, skip=output)
    saved_buffers = {saved: set(fw_buffers.owned.get(saved, ())) for saved in output.all_input_nodes}
    unit_of_saved: dict[str, str] = {}  # saved value's name -> the unit whose weights it holds
    for index, node in enumerate(fw_nodes):
        if not (is_unshard(node) and UnshardSpec.from_node(node).name in params):
            continue
        mine = set(fw_buffers.owned[node])
        for saved, holds in saved_buffers.items():
            if mine & holds:
                unit_of_saved[saved.name] = unit_of(UnshardSpec.from_node(node).name)
        last_read = max((fw_spans[b][1] for b in mine if b in fw_spans), default=index)
        if last_read + 1 < len(fw_nodes):
            fw_freed[last_read + 1] += fw_buffers.bytes_of([node])
    fw_resharded = [live - freed for live, freed in zip(fw_live, itertools.accumulate(fw_freed))]

    bw_nodes = list(backward.graph.nodes)
    bw_buffers = Buffers(backward, saved_activations(backward))
    bw_live = live_bytes(bw_nodes, bw_buffers, counted)
    bw_resharded = list(bw_live)
    compute_before = [0.0]  # [i]: the compute of bw_nodes[:i] (not our markers)
    for node in bw_nodes:
        model_op = node.op == "call_function" and not (is_unshard(node) or is_reduce_grad(node))
        compute_before.append(compute_before[-1] + (compute_seconds(node) if model_op else 0.0))
    bw_spans = _read_spans(bw_nodes, bw_buffers)  # placeholders read nothing
    held: dict[str, list[fx.Node]] = {}
    for node in bw_nodes:
        if node.op == "placeholder" and node.name in unit_of_saved:
            held.setdefault(unit_of_saved[node.name], []).append(node)
    for nodes in held.values():
        mine = {b for node in nodes for b in bw_buffers.owned[node]}
        first = min((bw_spans[b][0] for b in mine if b in bw_spans), default=len(bw_nodes))
        nbytes = sum(bw_buffers.sizes[b] for b in mine)
        needed = gather_seconds(nbytes)
        covered = [i for i in range(first) if compute_before[first] - compute_before[i] >= needed]
        issue = max(covered, default=0)
        for t in range(issue):
            bw_resharded[t] -= nbytes
        for t in range(issue, first if send_buffer else issue):
            bw_resharded[t] += nbytes
    return max(fw_live + bw_live) > max(fw_resharded + bw_resharded)


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


def params_to_keep(gm: fx.GraphModule, option, keep_tail: bool = True) -> frozenset[str]:
    """Parameters whose gathered weights forward keeps for backward, for every option but
    "auto"; `keep_tail`: whether the default keeps `tail_of_forward` too."""
    uses = _forward_uses(gm)
    tail = _last_unit(uses) | (_tail(uses) if keep_tail else frozenset())
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
            choice = _pattern_choice(unit_of(spec.name), option)
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
            unit = unit_of(spec.name)
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
        params_to_keep(gm, None if option == "auto" else option, ctx.keep_tail if ctx else True))
    for node in gm.graph.nodes:
        if is_unshard(node):
            kept = UnshardSpec.from_node(node).name in keep
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.MUST_RECOMPUTE
    return gm
