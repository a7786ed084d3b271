"""Module-level functions run on each rank by the multi-process (gloo) tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

import graphshard
from tests.zoo import Zoo, zoo_batch, zoo_loss

LR, EPS, MAX_NORM = 1e-2, 1e-4, 0.5  # eps large enough that float noise is not amplified
ADAMW_DEFAULT_EPS = 1e-8  # for runs whose sharded side uses AdamW's default


def _step(model_fn, params, opt, tokens, before_zero_grad=lambda: None):
    loss = zoo_loss(model_fn(tokens), tokens)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    opt.step()
    before_zero_grad()
    opt.zero_grad()
    return loss.detach(), norm


def grad_layout_problems(model: torch.nn.Module) -> list[str]:
    """Trainable parameters whose gradient is not a DTensor laid out like the parameter (same
    placements, this rank's local shape): one line each, empty when all are."""
    problems = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        grad = p.grad
        if not isinstance(grad, DTensor):
            problems.append(f"{name}: gradient is {type(grad).__name__}, not a DTensor")
        elif grad.placements != p.placements or grad.to_local().shape != p.to_local().shape:
            problems.append(f"{name}: gradient {grad.placements} local {tuple(grad.to_local().shape)}"
                            f", parameter {p.placements} local {tuple(p.to_local().shape)}")
    return problems


@dataclass
class ZooRun:
    losses: list[float]
    norms: list[float]  # global gradient norms (empty without clipping)
    grads: list[dict[str, torch.Tensor]]  # per step, before clipping
    params: dict[str, torch.Tensor]  # after the last step


def reference_zoo(steps: int, batch: int = 12, *, eps: float = EPS,
                  max_norm: float | None = MAX_NORM) -> ZooRun:
    """Single process, whole global batch: AdamW(lr=LR, eps), clip_grad_norm_ to max_norm
    (None: no clipping)."""
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    tokens = zoo_batch(batch)
    run = ZooRun([], [], [], {})
    for _ in range(steps):
        loss = zoo_loss(model(tokens), tokens)
        loss.backward()
        run.losses.append(loss.item())
        run.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if max_norm is not None:
            run.norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def train_zoo(rank: int, world: int, configs, steps: int, batch: int = 12):
    """For each (strategy, options-or-None) config: shard a fresh Zoo, train on this rank's
    slice of the global batch, return the global losses, grad norms, full parameters and the
    gradients' layout problems (see grad_layout_problems; checked each step before zero_grad)."""
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
        losses, norms, grad_problems = [], [], []
        for _ in range(steps):
            loss, norm = _step(fn, list(model.parameters()), opt, local,
                               lambda: grad_problems.extend(grad_layout_problems(model)))
            torch.distributed.all_reduce(loss)
            losses.append(loss.item() / world)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        results.append((losses, norms, full, sorted(set(grad_problems))))
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
