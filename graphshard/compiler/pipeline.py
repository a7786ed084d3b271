"""The compilation as one list of stages, each a pass over a GraphModule.

    Dynamo graph    -- merged -->                  (merge_duplicate_unshards)
    AOTAutograd joint graph -- tagged -->          (tag_reshard_policy), then the min-cut partition
    forward / backward graphs -- partitioned --> lowered --> bucketed --> scheduled --> transport
    --> packed --> freed --> Inductor (compile_fx_inner)

`PIPELINE` below is that list; `graphshard dump --stage` takes its stage names from it, and an
observer sees every stage's graph. Each stage runs on one family of graphs and names the stages
that must have run on the same graph before it: running one out of order fails loudly.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from graphshard.compiler.cost_model import ClusterSpec, collective_node_cost, compute_seconds
from graphshard.compiler.options import GraphshardOptions
from graphshard.compiler.rank_agreement import first_published
from graphshard.passes import meta_keys
from graphshard.passes.all_gather_via_all_to_all import all_gather_via_all_to_all
from graphshard.passes.bucket_collectives import bucket_collectives
from graphshard.passes.collective_order import follow_collective_order, issue_order
from graphshard.passes.context import PassContext
from graphshard.passes.free_collective_buffers import free_collective_buffers
from graphshard.passes.insert_collectives import insert_collectives
from graphshard.passes.liveness import saved_activations
from graphshard.passes.merge_duplicate_unshards import merge_duplicate_unshards
from graphshard.passes.pack_graph_inputs import pack_graph_inputs
from graphshard.passes.reduce_scatter_via_all_to_all import reduce_scatter_via_all_to_all
from graphshard.passes.reorder_collectives import ReorderPolicy, reorder_collectives
from graphshard.passes.reshard_policy import tag_reshard_policy


@dataclass(frozen=True)
class Stage:
    name: str
    graphs: str  # "dynamo", "joint", or "split": the forward, backward and inference graphs
    run: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    requires: tuple[str, ...] = ()  # stages that must already have run on this graph
    enabled: Callable[[GraphshardOptions], bool] = lambda options: True


def _schedule(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    budget = ctx.options.max_inflight_mb
    cluster = ctx.cluster or ClusterSpec.default()  # PassContext's cluster None: the default
    policy = ReorderPolicy(
        prefetch=ctx.options.prefetch,
        max_inflight_bytes=math.inf if budget is None else budget * 2**20,
        within_peak=ctx.options.overlap_within_peak,
        freed_inputs=frozenset(saved_activations(gm)) if ctx.graph_kind == "backward" else frozenset(),
        via_all_to_all=ctx.via_all_to_all,
        compute_seconds=compute_seconds(cluster, gm),
        collective_seconds=lambda node: collective_node_cost(node, cluster).seconds,
    )
    return _agreed_order(reorder_collectives(gm, policy), ctx)


def _agreed_order(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The scheduler weighs compute and memory on the local batch: the first rank to schedule
    a graph with these collectives publishes their issue order, and every rank issues them in
    that order (a rank recompiling alone, later, too)."""
    mine = issue_order(gm)
    key = hashlib.sha256(repr((ctx.graph_kind, sorted(mine), ctx.options, ctx.cluster))
                         .encode()).hexdigest()[:32]
    agreed = json.loads(first_published(f"order/{key}", lambda: json.dumps(mine)))
    if agreed == mine:
        return gm
    # None: not the graph the order was planned on; the schedule check names the difference
    return follow_collective_order(gm, agreed) or gm


def _transport(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Adapt collectives to the process group's transport (after all analysis)."""
    if "reduce_scatter" in ctx.via_all_to_all:
        gm = reduce_scatter_via_all_to_all(gm, ctx)
    if "all_gather" in ctx.via_all_to_all:
        gm = all_gather_via_all_to_all(gm, ctx)
    return gm


def _partitioned(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Not a pass: marks a graph as the partitioner's output (what the later stages expect)."""
    return gm


PIPELINE: tuple[Stage, ...] = (
    Stage("merged", "dynamo", merge_duplicate_unshards),
    Stage("tagged", "joint", tag_reshard_policy),
    Stage("partitioned", "split", _partitioned),
    Stage("lowered", "split", insert_collectives, requires=("partitioned",)),
    Stage("bucketed", "split", bucket_collectives, requires=("lowered",),
          enabled=lambda options: options.bucket_mb > 0),
    Stage("scheduled", "split", _schedule, requires=("bucketed",),
          enabled=lambda options: options.reorder),
    # After all analysis: the analysis reads collectives, the transport rewrites them.
    Stage("transport", "split", _transport, requires=("scheduled",),
          enabled=lambda options: bool(options.via_all_to_all(on_gloo=True))),
    Stage("packed", "split", pack_graph_inputs, requires=("lowered",)),
    # Last: frees what the collectives that run actually hold.
    Stage("freed", "split", free_collective_buffers, requires=("lowered",)),
)
STAGES: tuple[str, ...] = tuple(stage.name for stage in PIPELINE)
_FAMILY = {"dynamo": "dynamo", "joint": "joint", "forward": "split", "backward": "split",
           "inference": "split"}

# Observer of each stage's graph: (graph_kind, stage_name, graph_module) -> None
StageObserver = Callable[[str, str, fx.GraphModule], None]


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, observer: StageObserver | None = None,
                 *, stop_after: str | None = None, resume: bool = False) -> fx.GraphModule:
    """Run the stages of `ctx.graph_kind`'s family, in order, up to `stop_after` (default: to
    the end); with `resume`, only those not yet run on `gm` (a graph stopped earlier: option
    sets that differ only in later stages share the earlier ones, as in the planner). A
    disabled stage leaves the graph unchanged but still counts as run (its successors'
    requirements hold)."""
    family = [stage for stage in PIPELINE if stage.graphs == _FAMILY[ctx.graph_kind]]
    if stop_after is not None and stop_after not in {stage.name for stage in family}:
        raise ValueError(f"stop_after={stop_after!r} is not a stage of the {ctx.graph_kind} graph: "
                         f"{[stage.name for stage in family]}")
    for stage in family:
        done = gm.meta.get(meta_keys.STAGES, ())
        if resume and stage.name in done:
            if stage.name == stop_after:
                break
            continue
        missing = [name for name in stage.requires if name not in done]
        if missing:
            raise RuntimeError(f"graphshard stage {stage.name!r} needs {missing} to have run on "
                               f"this {ctx.graph_kind} graph first; it has run {list(done)}")
        if stage.enabled(ctx.options):
            gm = stage.run(gm, ctx)
        gm.meta[meta_keys.STAGES] = (*done, stage.name)
        if observer:
            observer(ctx.graph_kind, stage.name, gm)
        if stage.name == stop_after:
            break
    return gm
