"""Capture graphshard's graphs for a training step, in one process, at any world size."""

from __future__ import annotations

import copy
from typing import Any, Callable, Collection

import torch
import torch.fx as fx

import graphshard
from graphshard.compiler.backend import GraphshardCompiler
from graphshard.compiler.options import GraphshardOptions


class GraphCapture:
    """A graphshard backend (graphs run without Inductor) that keeps, for each graph it compiles,
    `keep(gm)` (a snapshot by default) of every pipeline stage in `stages` (None: all):
    graphs[(graph_kind, stage)], the latest compile's. Clear `graphs` to see what the next step
    compiles (nothing, when the compiled graphs are reused)."""

    def __init__(self, options: dict | None = None, stages: Collection[str] | None = None,
                 keep: Callable[[fx.GraphModule], Any] = copy.deepcopy):
        self.graphs: dict[tuple[str, str], Any] = {}
        self._stages, self._keep = stages, keep
        self.backend = GraphshardCompiler(
            GraphshardOptions.from_dict({**(options or {}), "compiler": "eager"}), self._observe)

    def _observe(self, kind: str, stage: str, gm: fx.GraphModule) -> None:
        if self._stages is None or stage in self._stages:
            self.graphs[(kind, stage)] = self._keep(gm)

    def compile(self, model: torch.nn.Module, fullgraph: bool = True):
        return torch.compile(model, backend=self.backend, fullgraph=fullgraph)


def capture_step(model, inputs, loss_fn, *, strategy="full_shard", options=None, shard_kwargs=None):
    """Shard `model` (unless it already is), run one compiled forward+backward (no Inductor),
    return {(graph_kind, stage): GraphModule snapshot}."""
    if not graphshard.is_sharded(model):
        graphshard.shard(model, strategy=strategy, **(shard_kwargs or {}))
    capture = GraphCapture(options)
    loss = loss_fn(capture.compile(model)(*inputs), *inputs)
    loss.backward()
    torch.compiler.reset()
    return capture.graphs


def call_nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
