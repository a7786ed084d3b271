"""Decide, explicitly, what the forward keeps for backward: the gathered weights or not.

Runs on the joint graph before partitioning. full_shard tags each unshard MUST_RECOMPUTE, so the
partitioner saves the (small) shard and the backward gathers again; shard_grad_op tags it
MUST_SAVE. Left untagged, the min-cut partitioner would save full gathered weights whenever that
looks cheaper, which is exactly the memory FSDP exists to avoid.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import is_unshard
from graphshard.passes.markers import UnshardSpec


def tag_reshard_policy(gm: fx.GraphModule, ctx: PassContext | None = None) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if is_unshard(node):
            reshard = UnshardSpec.from_node(node).reshard_after_forward
            node.meta["recompute"] = (
                CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
            )
    return gm
