"""graphshard's collectives alone: the step's all-gathers, reductions and all-to-alls, no compute.

A floor for the breakdown of graphshard's time above compute-only. The method compiles the
model with graphshard and runs one real forward and backward (its first, warm-up step), keeping
the collectives of the forward and backward graphs handed to Inductor, in graph order, with
their waits where the graph waits. Every later step replays them on buffers of the same shapes
and dtypes, allocated once: the same collectives, groups and bytes on the wire, without the
compute, the copies into and out of buckets, or the optimizer over the model's shards. The
loss and the optimizer step the harness times run on a logits-shaped zero tensor and one
scalar parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from graphshard.passes.graph_utils import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, WAIT

# with the transports' exchange that leaves the own chunk out (compiler/ops.py)
_ISSUED = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL,
           torch.ops.graphshard.exchange_with_peers.default)
GRAPH_KINDS = ("forward", "backward")


@dataclass(frozen=True)
class _BufferSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(value) -> object:
    if isinstance(value, fx.Node):
        meta = value.meta["val"]
        return _BufferSpec(tuple(meta.shape), meta.dtype)
    return value


def _buffer(value) -> object:
    # Made at the first replay, not while the graph compiles (under the compile's fake mode).
    return torch.zeros(value.shape, dtype=value.dtype) if isinstance(value, _BufferSpec) else value


@dataclass
class CollectiveSchedule:
    """One graph's collectives as ("issue", index, op, args) and ("wait", index) steps."""

    steps: list[tuple] = field(default_factory=list)
    allocated: bool = False

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "CollectiveSchedule":
        schedule, issued = cls(), {}
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in _ISSUED:
                issued[node] = len(issued)
                args = tuple(_spec(arg) for arg in node.args)
                schedule.steps.append(("issue", issued[node], node.target, args))
            elif node.target is WAIT and node.args[0] in issued:
                schedule.steps.append(("wait", issued[node.args[0]]))
        return schedule

    @property
    def collectives(self) -> int:
        return sum(step[0] == "issue" for step in self.steps)

    def _allocate(self) -> None:
        steps = []
        for step in self.steps:
            if step[0] == "issue":
                kind, index, op, args = step
                step = (kind, index, op, tuple(_buffer(arg) for arg in args))
            steps.append(step)
        self.steps, self.allocated = steps, True

    def run(self) -> None:
        if not self.allocated:
            self._allocate()
        pending: dict[int, torch.Tensor] = {}
        for step in self.steps:
            if step[0] == "issue":
                _, index, op, args = step
                pending[index] = op(*args)
            else:
                WAIT(pending.pop(step[1]))
        for result in pending.values():  # a collective the graph leaves to a later graph
            WAIT(result)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, replay, shape):
        replay.schedules["forward"].run()
        ctx.replay = replay
        return anchor.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        ctx.replay.schedules["backward"].run()
        return grad.new_zeros(1), None, None


class CollectivesOnly(nn.Module):
    """First call: graphshard's real forward and backward (compiled, schedules recorded).
    Later calls: the recorded collectives alone, returning zeros of the model output's shape."""

    def __init__(self, model: nn.Module, mesh, options: dict | None = None):
        super().__init__()
        import graphshard
        from graphshard.compiler.backend import GraphshardCompiler
        from graphshard.compiler.options import GraphshardOptions

        self.anchor = nn.Parameter(torch.zeros(1))  # what the harness's optimizer steps
        self.schedules: dict[str, CollectiveSchedule] = {}
        # Not a submodule: its shards are not this method's parameters.
        compiler = GraphshardCompiler(GraphshardOptions.from_dict(options), self._observe,
                                      aot_cache=False)  # the pipeline must run to be observed
        self.__dict__["compiler"] = compiler
        self.__dict__["compiled"] = torch.compile(graphshard.shard(model, mesh), backend=compiler)

    def _observe(self, graph_kind: str, stage: str, gm: fx.GraphModule) -> None:
        if graph_kind in GRAPH_KINDS:  # the last stage's graph is what Inductor compiles
            self.schedules[graph_kind] = CollectiveSchedule.of(gm)

    def forward(self, *inputs):
        if not self.schedules:
            out = self.compiled(*inputs)
            out.float().sum().backward()
            if self.compiler.training_graphs != 1 or set(self.schedules) != set(GRAPH_KINDS):
                raise RuntimeError(
                    "collectives_only replays one forward and one backward graph; this model "
                    f"compiled to {self.compiler.training_graphs} training graphs")
            self.output_shape = out.shape
        return _Replay.apply(self.anchor, self, self.output_shape)
