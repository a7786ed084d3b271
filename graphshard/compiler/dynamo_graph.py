"""What the backend reads of a Dynamo graph's markers for the graphs partitioned from it."""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch.fx as fx

from graphshard.compiler.options import GraphshardOptions
from graphshard.passes.graph_utils import all_nodes, is_reduce_grad, is_unshard, unshard_specs


class SplitContext(NamedTuple):
    """What the split stages (forward, backward) know of the Dynamo graph they come from."""

    param_order: Mapping[str, int] = {}  # parameter name -> registration index
    via_all_to_all: frozenset[str] = frozenset()  # collective kinds exchanged by all-to-all
    own_chunk_local: bool = False  # exchanges leave the rank's own chunk out (PassContext)


def has_markers(gm: fx.GraphModule) -> bool:
    return any(is_unshard(node) or is_reduce_grad(node) for node in all_nodes(gm))


def split_context(gm: fx.GraphModule, options: GraphshardOptions) -> SplitContext:
    """The split stages' context for the graphs partitioned from the Dynamo graph `gm`."""
    via_all_to_all = options.via_all_to_all(on_gloo=_uses_gloo(gm))
    return SplitContext(_param_order(gm), via_all_to_all, own_chunk_local=bool(via_all_to_all))


def _uses_gloo(gm: fx.GraphModule) -> bool:
    """Whether the markers' process groups are gloo's (their backend travels in each marker)."""
    return {spec.backend for spec in unshard_specs(gm, subgraphs=True).values()} == {"gloo"}


def _param_order(gm: fx.GraphModule) -> dict[str, int]:
    """Parameter name -> registration index, from the markers (bucketing packs in this order)."""
    return {spec.name: spec.order for spec in unshard_specs(gm, subgraphs=True).values()}
