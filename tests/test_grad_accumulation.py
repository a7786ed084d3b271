"""Gradient accumulation: K micro-batches with sync off then one synced, equal to one K-times
larger batch; the no-sync backward graph reduces nothing."""

from __future__ import annotations

import functools

import pytest
import torch

import graphshard
from graphshard.tools.launch import run_local
from graphshard.passes.graph_utils import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from tests.capture import GraphCapture
from tests.workers import EAGER, Training, reference, train, zoo_training
from tests.zoo import Zoo, zoo_batch, zoo_loss

K, STEPS, BATCH = 3, 2, 12


def _counts(gm):
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return {name: targets.count(t) for name, t in
            (("all_gather", ALL_GATHER), ("reduce_scatter", REDUCE_SCATTER),
             ("all_reduce", ALL_REDUCE))}


def test_no_sync_graph_has_no_reduction(fake_pg):
    model = Zoo()
    graphshard.shard(model)
    capture = GraphCapture(stages=("lowered",))
    compiled = capture.compile(model)
    tokens = zoo_batch(4)

    def step():
        capture.graphs.clear()
        zoo_loss(compiled(tokens), tokens).backward()
        return {kind: _counts(gm) for (kind, _), gm in capture.graphs.items()}

    with graphshard.no_sync(model):
        no_sync = step()
        assert step() == {}  # the second no-sync micro-batch reuses the compiled graphs
    final = step()
    assert no_sync["backward"]["reduce_scatter"] == no_sync["backward"]["all_reduce"] == 0
    assert no_sync["forward"]["all_gather"] > 0  # the parameters are still gathered
    assert final["backward"]["reduce_scatter"] > 0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch._dynamo.reset()


def test_mode_switch_errors(fake_pg):
    model = Zoo()
    graphshard.shard(model)
    tokens = zoo_batch(2)
    graphshard.set_requires_gradient_sync(model, False)
    zoo_loss(model(tokens), tokens).backward()  # full gradients pending
    with pytest.raises(RuntimeError, match="finish that accumulation"):
        graphshard.set_requires_all_reduce(model, False)
    with pytest.raises(ValueError, match="not sharded"):
        graphshard.set_requires_gradient_sync(Zoo(), False)


# --------------------------------------------------------------------------- gloo numerics


def test_accumulation_matches_large_batch():
    # eager and compiled; micro-batches before the last under no_sync, or with the sync set off
    modes = [(compile, api) for compile in (None, EAGER)
             for api in ("no_sync", "set_requires_gradient_sync")]
    runs = [zoo_training(STEPS, compile=compile, micro_batches=K, accumulation=api, record_grads=True)
            for compile, api in modes]
    ref = reference(zoo_training(STEPS))  # one K-times larger batch
    for rank_results in run_local(train, 2, runs):
        for mode, result in zip(modes, rank_results):
            # nothing reduced, nothing written to the sharded .grad before the last micro-batch
            assert result.early_grads == [], mode
            for step, expected in enumerate(ref.grads):
                assert set(result.grads[step]) == set(expected), mode
                for name, g in expected.items():
                    assert (result.grads[step][name] - g).abs().max().item() < 1e-5, (mode, step, name)
            for name, p in ref.params.items():
                assert (result.params[name] - p).abs().max().item() < 1e-5, (mode, name)


class _Attention(torch.nn.Module):
    """nn.MultiheadAttention reads in_proj_weight for its fast-path checks, then again to
    compute: a read that never reaches the loss must not swallow the accumulated gradient."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x)[0].mean(1))


def _attention_data(step):
    """Two batches of 4 one after the other: each rank's two micro-batches come from one of them."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, 8, generator=gen), torch.randn(8, 3, generator=gen)


def _mse(out, x, y):
    return torch.nn.functional.mse_loss(out, y)


def test_accumulation_is_exact_when_a_parameter_is_read_without_reaching_the_loss():
    runs = [Training(model=_Attention, data=_attention_data, loss=_mse, steps=1, compile=compile,
                     fullgraph=False, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                     micro_batches=2, record_grads=True)
            for compile in (None, EAGER)]
    [expected] = reference(runs[0]).grads
    for rank_results in run_local(train, 2, runs):
        for compile, result in zip((None, EAGER), rank_results):
            [grads] = result.grads
            for name, g in expected.items():
                assert (grads[name] - g).abs().max().item() < 1e-5, (compile, name)


def test_a_no_sync_block_left_by_an_exception_drops_its_sums_without_communicating(fake_pg):
    model = graphshard.shard(Zoo())
    tokens = zoo_batch(2)
    with pytest.raises(KeyError, match="boom"):
        with graphshard.no_sync(model):
            zoo_loss(model(tokens), tokens).backward()
            raise KeyError("boom")
    # a normal exit would have reduced the sum into .grad; nothing was reduced, nothing is left
    assert all(p.grad is None for p in model.parameters())
    sync = graphshard.sharding.shard_state(model).grad_sync
    assert sync.requires_gradient_sync and not sync.accumulating(partial=False)
    with graphshard.no_sync(model):  # and accumulation works again afterwards
        zoo_loss(model(tokens), tokens).backward()
    assert any(p.grad is not None for p in model.parameters())
