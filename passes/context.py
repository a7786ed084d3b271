"""What a pass may know besides the graph it rewrites."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

GRAPH_KINDS = ("dynamo", "joint", "forward", "backward", "inference")


@dataclass(frozen=True)
class PassContext:
    graph_kind: str  # one of GRAPH_KINDS
    options: Any  # graphshard.compiler.options.GraphshardOptions: passes read bucket_mb, prefetch, ...
    param_order: Mapping[str, int] = field(default_factory=dict)  # name -> registration index
    cluster: Any = None  # graphshard.compiler.cost_model.ClusterSpec for the cost model (None: default)
    # collective kinds to exchange by all-to-all: resolved from the options and the group's backend
    via_all_to_all: frozenset[str] = frozenset()
    # an all-to-all leaves the rank's own chunk out of the exchange where it can (False: every
    # chunk goes through the transport, as the cost model's probes price it)
    own_chunk_local: bool = False
    # joint graph, reshard_after_forward="auto": the parameters the backend chose to keep gathered
    keep_gathered: frozenset[str] | None = None
    # joint graph, default option: keep the tail of forward beyond its last unit (the backend
    # turns this off where that would raise the peak: reshard_policy.keeping_costs_peak_memory)
    keep_tail: bool = True

    def __post_init__(self):
        if self.graph_kind not in GRAPH_KINDS:
            raise ValueError(f"graph_kind must be one of {GRAPH_KINDS}, got {self.graph_kind!r}")
