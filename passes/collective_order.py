"""Put a scheduled graph's collectives in an order given from outside (another rank's plan).

The scheduler (reorder_collectives.py) weighs compute and memory, which depend on the local
batch, so ranks given different batches may plan different issue orders, and ranks pair
collectives by their place in the sequence. The backend has every rank adopt one plan: the
order is written as each collective's identity (what it exchanges, for which parameters:
the same on every rank), and a rank whose own order differs moves as little as it must: a
collective waits until the one before it in the agreed order is issued, everything else keeps
this rank's priorities.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch.fx as fx

from graphshard.passes.graph_utils import apply_order, finalize_graph, is_collective, list_schedule
from graphshard.passes.schedule_digest import collective_sequence


def collective_identities(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Each collective, in node order, with its identity: the same string on every rank
    (op, kind, group size, dtype, size, parameters; an occurrence count where one repeats).
    The group's index is left out: it counts groups in order of first use, which the
    order itself changes."""
    nodes = [node for node in gm.graph.nodes if is_collective(node)]
    seen: Counter[str] = Counter()
    identities = []
    for node, record in zip(nodes, collective_sequence(gm)):
        text = (f"{record.op}:{record.kind}:{record.group_size}:{record.dtype}:{record.size}:"
                + ",".join(record.params))
        identities.append((node, f"{text}#{seen[text]}"))
        seen[text] += 1
    return identities


def issue_order(gm: fx.GraphModule) -> list[str]:
    """The identities of the graph's collectives in the order they are issued."""
    return [identity for _, identity in collective_identities(gm)]


def _contradicts_data(gm: fx.GraphModule, ordered: Sequence[fx.Node]) -> bool:
    """Whether some collective needs (through its inputs) one that `ordered` puts after it:
    then no schedule of this graph issues them in that order."""
    index = {node: i for i, node in enumerate(ordered)}
    before: dict[fx.Node, int] = {}  # bit i: collective i is an ancestor of the node
    for node in gm.graph.nodes:
        mask = 0
        for arg in node.all_input_nodes:
            mask |= before[arg] | (1 << index[arg] if arg in index else 0)
        before[node] = mask
        if node in index and mask >> (index[node] + 1):  # an ancestor ordered after it
            return True
    return False


def follow_collective_order(gm: fx.GraphModule, order: Sequence[str]) -> fx.GraphModule | None:
    """`gm` with its collectives issued in `order` (identities, as `issue_order` gives them),
    every other node as close to its current place as that allows; None where `gm` does not
    hold exactly those collectives, or its data dependencies forbid that order (a graph that
    is not the one the order was planned on: the schedule check then names the difference)."""
    by_identity = {identity: node for node, identity in collective_identities(gm)}
    if sorted(by_identity) != sorted(order) or len(order) != len(by_identity):
        return None
    ordered = [by_identity[identity] for identity in order]
    if _contradicts_data(gm, ordered):
        return None
    nodes = list(gm.graph.nodes)
    priority = {node: float(index) for index, node in enumerate(nodes)}
    after = dict(zip(ordered[1:], ordered[:-1]))
    apply_order(gm.graph, list_schedule(nodes, priority, after=after))
    return finalize_graph(gm)
