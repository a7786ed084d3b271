"""Backend edge cases found in review, checked on a 1-rank gloo group in this process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import graphshard
from graphshard.backend import GraphshardCompiler
from graphshard.options import GraphshardOptions

EAGER_PASSES = {"compiler": "eager"}


@pytest.fixture
def gloo1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)  # in-place ops in the Dynamo graph must survive our graph surgery
        self.steps.add_(1)
        return y.sum()


def test_in_place_ops_and_buffer_updates_survive_the_backend(gloo1):
    torch.manual_seed(0)
    model = graphshard.shard(InPlace())
    x = torch.randn(3, 4)
    expected = model(x)
    compiled = torch.compile(model, backend="graphshard", options=EAGER_PASSES, fullgraph=True)
    assert torch.allclose(compiled(x), expected)
    assert model.steps.item() == 2


class NoGradRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = self.lin.weight.abs().mean()
        return (self.lin(x) * scale).sum()


def test_a_no_grad_read_does_not_stand_in_for_a_read_that_needs_a_gradient(gloo1):
    torch.manual_seed(0)
    model = graphshard.shard(NoGradRead())
    x = torch.randn(3, 4)
    model(x).backward()
    expected = model.lin._parameters["weight"].grad.full_tensor().clone()
    model.zero_grad()
    torch.compile(model, backend="graphshard", options=EAGER_PASSES, fullgraph=True)(x).backward()
    grad = model.lin._parameters["weight"].grad
    assert grad is not None and torch.allclose(grad.full_tensor(), expected)


class AllCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return checkpoint(self.lin, x, use_reentrant=False).sum()


def test_parameters_read_only_inside_a_checkpointed_region_still_go_through_the_pipeline(gloo1):
    model = graphshard.shard(AllCheckpointed())
    stages = []
    backend = GraphshardCompiler(GraphshardOptions(compiler="eager"),
                                 lambda kind, stage, gm: stages.append((kind, stage)))
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 4)).backward()
    assert ("forward", "lowered") in stages and ("backward", "lowered") in stages


def test_a_parameter_added_after_shard_is_refused(gloo1):
    model = graphshard.shard(nn.Sequential(nn.Linear(4, 4)))
    model.add_module("adapter", nn.Linear(4, 4))
    compiled = torch.compile(model, backend="graphshard", options=EAGER_PASSES)
    with pytest.raises(Exception, match="not sharded.*added or replaced after graphshard.shard"):
        compiled(torch.randn(2, 4))


def test_rnn_modules_use_the_sharded_parameters(gloo1):
    torch.manual_seed(0)
    reference = nn.LSTM(4, 6, batch_first=True)
    model = graphshard.shard(copy.deepcopy(reference))
    with torch.no_grad():  # change the sharded weights: the RNN must see the change
        for p in model.parameters():
            p.mul_(0.5)
        for p in reference.parameters():
            p.mul_(0.5)
    x = torch.randn(2, 3, 4)
    out, _ = model(x)
    expected, _ = reference(x)
    assert torch.allclose(out, expected, atol=1e-6)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_an_rnn_inside_a_compiled_model_trains_like_the_reference_across_batch_sizes():
    # Dynamo runs the GRU eagerly; its parameter reads must run the eager markers (not be
    # compiled as frames of their own, which recompiled with dynamic shard sizes and failed).
    from graphshard.launch import run_local
    from tests.workers import reference_rnn, train_rnn_compiled

    expected = reference_rnn()
    for params in run_local(train_rnn_compiled, 2):
        assert params.keys() == expected.keys()
        for name, value in params.items():
            assert torch.allclose(value, expected[name], atol=1e-5), name
