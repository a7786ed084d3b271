"""The collective schedule of a lowered graph, as every rank must run it, and its digest.

A rank pairs each collective it issues with the one the other ranks of its group issue in the
same place of their sequence: ranks whose graphs differ in that sequence (a rank-dependent
branch in forward, a decision taken on rank-local sizes) hang, abort, or pair collectives of
equal size and compute a wrong answer. The record keeps what must match across ranks: the op,
its group (by the order groups first appear in, not by name: ranks of different replicas of
a hybrid mesh name their groups differently), dtype and the sizes that are the same on every
rank, and, for messages, the parameters it serves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch.fx as fx

from graphshard.passes.graph_utils import (ALL_REDUCE, ALL_TO_ALL, collective_group, collective_kind,
                                           collective_params, is_collective,
                                           is_exchange_with_peers)


@dataclass(frozen=True)
class CollectiveRecord:
    op: str  # the collective that runs: all_gather_into_tensor, all_to_all_single, ...
    kind: str  # what it does for graphshard: all_gather, reduce_scatter, all_reduce
    group: int  # index of its process group in order of first use; its size beside
    group_size: int
    dtype: str
    size: str  # elements exchanged, the same on every rank
    params: tuple[str, ...]  # the parameters it serves: two gathers of equal size swapped
    # between ranks would pair without error and mix the two parameters' shards

    def key(self) -> str:
        return (f"{self.op}:{self.kind}:g{self.group}/{self.group_size}:{self.dtype}:{self.size}:"
                + ",".join(self.params))

    def describe(self) -> str:
        served = ", ".join(self.params[:3]) + (f" and {len(self.params) - 3} more"
                                               if len(self.params) > 3 else "")
        return (f"{self.kind} ({self.op}, group {self.group} of size {self.group_size}, "
                f"{self.dtype}, {self.size} elements) for {served or 'no parameter'}")


def _size(node: fx.Node) -> str:
    if node.target is ALL_TO_ALL:
        return "chunk " + "/".join(sorted({str(s) for s in node.args[1]}))  # each pair's
    if is_exchange_with_peers(node):  # the own chunk left out: N - 1 chunks received
        return f"chunk {node.meta['val'].shape[0] // (collective_group(node)[1] - 1)}"
    if node.target is ALL_REDUCE:
        return "shard"  # a hybrid replica all-reduce of the rank's shard: sizes differ by replica
    value = node.args[0].meta.get("val")
    return str(value.numel()) if value is not None else "?"


def collective_sequence(gm: fx.GraphModule) -> list[CollectiveRecord]:
    """The graph's collectives in the order they are issued (node order)."""
    groups: dict[str, int] = {}
    records = []
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        name, size = collective_group(node)
        value = node.args[0].meta.get("val")
        records.append(CollectiveRecord(
            op=node.target.name().split("::")[-1].split(".")[0], kind=collective_kind(node),
            group=groups.setdefault(name, len(groups)), group_size=int(size),
            dtype=str(value.dtype).removeprefix("torch.") if value is not None else "?",
            size=_size(node), params=collective_params(node)))
    return records


def schedule_digest(records: list[CollectiveRecord]) -> str:
    return hashlib.sha256("\n".join(r.key() for r in records).encode()).hexdigest()[:24]
