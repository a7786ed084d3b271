"""Module-level functions run on each rank by the multi-process (gloo) tests."""

from __future__ import annotations


import torch

import graphshard
from tests.zoo import Zoo, zoo_batch, zoo_loss

LR, EPS, MAX_NORM = 1e-2, 1e-4, 0.5  # eps large enough that float noise is not amplified


def _step(model_fn, params, opt, tokens):
    loss = zoo_loss(model_fn(tokens), tokens)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    opt.step()
    opt.zero_grad()
    return loss.detach(), norm


def reference_zoo(steps: int, batch: int = 12):
    """Single process, whole global batch."""
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    tokens = zoo_batch(batch)
    losses, norms = [], []
    for _ in range(steps):
        loss, norm = _step(model, list(model.parameters()), opt, tokens)
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_zoo(rank: int, world: int, configs, steps: int, batch: int = 12):
    """For each (strategy, options-or-None) config: shard a fresh Zoo, train on this rank's
    slice of the global batch, return the global losses, grad norms and full parameters."""
    results = []
    for strategy, options in configs:
        torch.manual_seed(0)
        model = Zoo()
        graphshard.shard(model, strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        fn = model if options is None else torch.compile(
            model, backend="graphshard", options=options, fullgraph=True)
        tokens = zoo_batch(batch)
        per = batch // world
        local = tokens[rank * per:(rank + 1) * per]
        losses, norms = [], []
        for _ in range(steps):
            loss, norm = _step(fn, list(model.parameters()), opt, local)
            torch.distributed.all_reduce(loss)
            losses.append(loss.item() / world)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        grads_sharded = all(p.grad is None for p in model.parameters())
        results.append((losses, norms, full, grads_sharded))
        torch._dynamo.reset()
    return results


class _GRUHead(torch.nn.Module):
    """A GRU (which Dynamo does not trace: it runs eagerly inside the compiled model) and a
    linear head (compiled); 21-row GRU weights shard unevenly at world size 2."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(5, 7, batch_first=True)
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


RNN_BATCHES = (6, 6, 10)  # global batch per step: the size changes, so the frame recompiles


def rnn_batches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(b, 4, 5, generator=gen) for b in RNN_BATCHES]


def reference_rnn():
    torch.manual_seed(0)
    model = _GRUHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in rnn_batches():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def train_rnn_compiled(rank: int, world: int):
    torch.manual_seed(0)
    model = graphshard.shard(_GRUHead())
    compiled = torch.compile(model, backend="graphshard", options={"compiler": "eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in rnn_batches():
        per = x.shape[0] // world
        compiled(x[rank * per:(rank + 1) * per]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}
