"""Gradient accumulation: K micro-batches with sync off then one synced, equal to one K-times
larger batch; the no-sync backward graph reduces nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import graphshard
from graphshard.backend import GraphshardCompiler
from graphshard.launch import run_local
from graphshard.options import GraphshardOptions
from passes.graph_utils import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from tests.workers import ADAMW_DEFAULT_EPS, LR, reference_zoo
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
    graphs = []
    compiler = GraphshardCompiler(
        GraphshardOptions(compiler="eager"),
        observer=lambda kind, stage, gm: graphs.append((kind, copy.deepcopy(gm)))
        if stage == "lowered" else None)
    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    tokens = zoo_batch(4)

    def step():
        graphs.clear()
        zoo_loss(compiled(tokens), tokens).backward()
        return {kind: _counts(gm) for kind, gm in graphs}

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


def _accumulate(rank, world, modes):
    results = []
    for compiled, api in modes:
        torch.manual_seed(0)
        model = Zoo()
        graphshard.shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        fn = torch.compile(model, backend="graphshard", options={"compiler": "eager"},
                           fullgraph=True) if compiled else model
        per = BATCH // world
        micro = zoo_batch(BATCH)[rank * per:(rank + 1) * per].chunk(K)
        grads = []
        for _ in range(STEPS):
            if api == "setter":
                for i, batch in enumerate(micro):
                    graphshard.set_requires_gradient_sync(model, i == K - 1)
                    if i < K - 1:
                        (zoo_loss(fn(batch), batch) / K).backward()
                        # nothing reduced, nothing written to the sharded .grad yet
                        assert all(p.grad is None for p in model.parameters())
                    else:
                        (zoo_loss(fn(batch), batch) / K).backward()
            else:
                with graphshard.no_sync(model):
                    for batch in micro[:-1]:
                        (zoo_loss(fn(batch), batch) / K).backward()
                        assert all(p.grad is None for p in model.parameters())
                (zoo_loss(fn(micro[-1]), micro[-1]) / K).backward()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()
                          if p.grad is not None})
            opt.step()
            opt.zero_grad()
        results.append((grads, {n: p.full_tensor() for n, p in model.named_parameters()}))
        torch._dynamo.reset()
    return results


def test_accumulation_matches_large_batch():
    reference = reference_zoo(STEPS, BATCH, eps=ADAMW_DEFAULT_EPS, max_norm=None)
    ref_grads, ref_params = reference.grads, reference.params
    modes = [(False, "context"), (False, "setter"), (True, "context"), (True, "setter")]
    for rank_results in run_local(_accumulate, 2, modes):
        for mode, (grads, params) in zip(modes, rank_results):
            for step, ref in enumerate(ref_grads):
                assert set(grads[step]) == set(ref), mode
                for name, g in ref.items():
                    assert (grads[step][name] - g).abs().max().item() < 1e-5, (mode, step, name)
            for name, p in ref_params.items():
                assert (params[name] - p).abs().max().item() < 1e-5, (mode, name)


class _Attention(torch.nn.Module):
    """nn.MultiheadAttention reads in_proj_weight for its fast-path checks, then again to
    compute: a read that never reaches the loss must not swallow the accumulated gradient."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x)[0].mean(1))


def _attention_batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 5, 8, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(2)]


def _attention_grads(rank, world, compiled):
    torch.manual_seed(0)
    model = graphshard.shard(_Attention())
    fn = torch.compile(model, backend="graphshard", options={"compiler": "eager"}) if compiled else model
    per = 4 // world
    (x0, y0), (x1, y1) = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
                          for x, y in _attention_batches()]
    with graphshard.no_sync(model):
        (torch.nn.functional.mse_loss(fn(x0), y0) / 2).backward()
    (torch.nn.functional.mse_loss(fn(x1), y1) / 2).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_accumulation_is_exact_when_a_parameter_is_read_without_reaching_the_loss():
    torch.manual_seed(0)
    reference = _Attention()
    for x, y in _attention_batches():
        (torch.nn.functional.mse_loss(reference(x), y) / 2).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for compiled in (False, True):
        for grads in run_local(_attention_grads, 2, compiled):
            for name, g in expected.items():
                assert (grads[name] - g).abs().max().item() < 1e-5, (compiled, name)


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
