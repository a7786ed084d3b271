"""The compilation pipeline: its stages run in their order, and a pipeline stopped after a stage
resumes where it stopped."""

from __future__ import annotations

import pytest
import torch

from graphshard.passes import meta_keys
from graphshard.compiler.options import GraphshardOptions
from graphshard.passes.context import PassContext
from tests.pass_graphs import gather_graph


def test_a_stage_run_out_of_order_fails_loudly(monkeypatch):
    from graphshard.compiler import pipeline
    from graphshard.compiler.cost_model import ClusterSpec

    stages = {stage.name: stage for stage in pipeline.PIPELINE}
    swapped = tuple(stages[name] for name in
                    ("merged", "tagged", "partitioned", "lowered", "scheduled", "bucketed", "transport"))
    monkeypatch.setattr(pipeline, "PIPELINE", swapped)
    graph = gather_graph(8, [("layers.0.w", (16, 4), torch.float32)])
    with pytest.raises(RuntimeError, match="stage 'scheduled' needs \\['bucketed'\\]"):
        pipeline.run_pipeline(graph, PassContext("forward", GraphshardOptions()))
    monkeypatch.undo()
    ran = pipeline.run_pipeline(gather_graph(8, [("layers.0.w", (16, 4), torch.float32)]),
                               PassContext("forward", GraphshardOptions(bucket_mb=0),
                                           cluster=ClusterSpec.default()))
    assert ran.meta[meta_keys.STAGES] == tuple(s for s in pipeline.STAGES
                                                    if s not in ("merged", "tagged"))


def test_a_pipeline_stopped_after_a_stage_resumes_where_it_stopped():
    """What the planner relies on to share the stages option sets have in common."""
    from graphshard.compiler import pipeline
    from graphshard.compiler.cost_model import ClusterSpec

    ctx = PassContext("forward", GraphshardOptions(), cluster=ClusterSpec.default())
    graph = gather_graph(8, [("layers.0.w", (16, 4), torch.float32)])
    lowered = pipeline.run_pipeline(graph, ctx, stop_after="lowered")
    assert lowered.meta[meta_keys.STAGES] == ("partitioned", "lowered")
    bucketed = pipeline.run_pipeline(lowered, ctx, stop_after="bucketed", resume=True)
    assert bucketed.meta[meta_keys.STAGES] == ("partitioned", "lowered", "bucketed")
    assert pipeline.run_pipeline(bucketed, ctx, stop_after="lowered", resume=True) is bucketed
    done = pipeline.run_pipeline(bucketed, ctx, resume=True)
    assert done.meta[meta_keys.STAGES] == tuple(s for s in pipeline.STAGES
                                                    if s not in ("merged", "tagged"))
    with pytest.raises(ValueError, match="'tagged' is not a stage of the forward graph"):
        pipeline.run_pipeline(graph, ctx, stop_after="tagged")
