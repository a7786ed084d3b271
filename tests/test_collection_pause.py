"""Full garbage collections are paused while graphshard compiles (the backend's graphs, and the
whole capture of `graphshard dump`), and come back after: graph tests, one process."""

from __future__ import annotations

import contextlib
import gc

import torch

import graphshard
from graphshard.compiler.backend import GraphshardCompiler
from graphshard.compiler.options import GraphshardOptions
from graphshard.tools.dump import dump
from graphshard.tools.dump.loading import load_workload
from tests.zoo import Zoo, zoo_batch, zoo_loss


@contextlib.contextmanager
def eager_full_collections():
    """Thresholds under which CPython runs a full collection at almost every chance: the
    process's objects frozen out of the count (a full collection waits until the survivors
    grow by a quarter of what the last one kept), and one middle collection between full ones.
    Yields the generations collected, in order, each with the observer events seen so far."""
    before = gc.get_threshold()
    collected: list[tuple[int, int]] = []
    events = [0]

    def record(phase, info):
        if phase == "start":
            collected.append((info["generation"], events[0]))

    gc.collect()
    gc.freeze()
    gc.collect()
    gc.set_threshold(50, 1, 1)
    gc.callbacks.append(record)
    try:
        yield collected, events
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*before)
        gc.unfreeze()


def test_no_full_collection_runs_while_the_backend_compiles(fake_pg):
    model = graphshard.shard(Zoo())
    spans: dict[str, list[int]] = {}  # graph kind -> [first observer event, last]
    with eager_full_collections() as (collected, events):
        def observe(kind: str, stage: str, gm) -> None:
            events[0] += 1
            spans.setdefault(kind, [events[0], events[0]])[1] = events[0]

        backend = GraphshardCompiler(GraphshardOptions(compiler="eager"), observe)
        tokens = zoo_batch(8)
        zoo_loss(torch.compile(model, backend=backend, fullgraph=True)(tokens), tokens).backward()
        torch.compiler.reset()
        threshold_after = gc.get_threshold()
    assert set(spans) == {"dynamo", "joint", "forward", "backward"}
    # From the Dynamo graph's first stage to the forward graph's last (AOTAutograd, the
    # partition and the passes, in one call), and through the backward's stages (compiled at
    # its first run): young and middle collections ran, no full one.
    windows = [(spans["dynamo"][0], spans["forward"][1]), tuple(spans["backward"])]
    inside = [generation for generation, at in collected
              if any(first <= at < last for first, last in windows)]
    assert inside and max(inside) < 2, inside
    assert threshold_after == (50, 1, 1)  # full collections come back after the compile


def test_a_dump_captures_without_a_full_collection_dynamos_trace_included():
    messages: list[str] = []
    with eager_full_collections() as (collected, events):
        def progress(message: str) -> None:
            messages.append(message)
            events[0] = len(messages)

        result = dump(load_workload("tests.dump_targets.tiny:make_with_loss"), world_size=2,
                      progress=progress)
        threshold_after = gc.get_threshold()
    assert result.report.collectives
    # from "capturing the training step" (before Dynamo's trace) to "estimating": the capture
    first = 1 + next(i for i, m in enumerate(messages) if m.startswith("capturing"))
    last = 1 + next(i for i, m in enumerate(messages) if m.startswith("estimating"))
    inside = [generation for generation, at in collected if first <= at < last]
    assert inside and max(inside) < 2, (inside, messages)
    assert threshold_after == (50, 1, 1)
