"""The combination matrix's per-rank worker and its single-process references.

One configuration = strategy x precision x activation checkpointing x accumulation x transport,
trained for STEPS steps of SGD on TinyGPT with the default compiler (Inductor). Every rank
returns the global losses, the full gradients of each step and the full final parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from tests.zoo import TinyGPT, gpt_batch, zoo_loss

STEPS, GLOBAL_BATCH, LR = 2, 24, 0.05
TRANSPORTS = {
    "native": {"all_gather": "native", "reduce_scatter": "native"},  # the path NCCL users run
    "all_to_all": {"all_gather": "all_to_all", "reduce_scatter": "all_to_all"},
    "auto": {},
}


@dataclass(frozen=True)
class Config:
    strategy: str  # full_shard, shard_grad_op, no_shard, hybrid_shard (2 x world/2 mesh)
    bf16: bool  # bf16 parameters for compute, fp32 reduction
    ac: str  # none, full, selective
    accumulate: bool  # two micro-batches per step, the first under no_sync
    transport: str  # a key of TRANSPORTS

    def __str__(self):
        return (f"{self.strategy}/{'bf16' if self.bf16 else 'fp32'}/ac={self.ac}/"
                f"{'accum' if self.accumulate else 'noaccum'}/{self.transport}")


@dataclass
class Run:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # per step: full gradients (after all micro-batches)
    params: dict[str, torch.Tensor]  # after the last step


def _micro_batches(tokens: torch.Tensor, accumulate: bool) -> list[torch.Tensor]:
    return list(tokens.chunk(2)) if accumulate else [tokens]


def train_rank(rank: int, world: int, configs: list[Config]) -> list[Run]:
    runs = []
    tokens = gpt_batch(GLOBAL_BATCH)
    per = GLOBAL_BATCH // world
    local = tokens[rank * per:(rank + 1) * per]
    for config in configs:
        torch.manual_seed(0)
        model = TinyGPT(config.ac)
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
                if config.strategy == "hybrid_shard" else None)
        low = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if config.bf16 else {}
        graphshard.shard(model, mesh, strategy=config.strategy, **low)
        compiled = torch.compile(model, backend="graphshard", options=TRANSPORTS[config.transport],
                                 fullgraph=True)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        run = Run([], [], {})
        for _ in range(STEPS):
            micro = _micro_batches(local, config.accumulate)
            total = torch.zeros(())
            for index, batch in enumerate(micro):
                last = index == len(micro) - 1
                with (graphshard.no_sync(model) if not last else _nullcontext()):
                    loss = zoo_loss(compiled(batch), batch).float() / len(micro)
                    loss.backward()
                total += loss.detach()
            torch.distributed.all_reduce(total)
            run.losses.append(total.item() / world)
            run.grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()
                              if p.requires_grad})
            opt.step()
            opt.zero_grad()
        run.params = {n: p.full_tensor() for n, p in model.named_parameters()}
        runs.append(run)
        torch._dynamo.reset()
    return runs


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def reference(ac: str, bf16: bool, parts: int = 1) -> Run:
    """Single process, whole global batch, plain SGD. bf16: fp32 master weights; each of `parts`
    equal slices of the batch (one per rank and micro-batch) is computed with a bf16 copy of them
    and the slices' gradients are averaged in fp32: exactly what param_dtype=bf16 with
    reduce_dtype=fp32 promises, computed without any sharding (the slices only fix which sums
    are rounded to bf16)."""
    torch.manual_seed(0)
    master = TinyGPT(ac)
    opt = torch.optim.SGD(master.parameters(), lr=LR)
    tokens = gpt_batch(GLOBAL_BATCH)
    run = Run([], [], {})
    for _ in range(STEPS):
        if not bf16:
            loss = zoo_loss(master(tokens), tokens)
            loss.backward()
            run.losses.append(loss.item())
        else:
            losses = []
            for part in tokens.chunk(parts):
                low = copy.deepcopy(master).to(torch.bfloat16)
                loss = zoo_loss(low(part), part).float()
                loss.backward()
                losses.append(loss.item())
                for p, q in zip(master.parameters(), low.parameters()):
                    if q.grad is not None:
                        g = q.grad.float() / parts
                        p.grad = g if p.grad is None else p.grad + g
            run.losses.append(sum(losses) / parts)
        run.grads.append({n: p.grad.clone() for n, p in master.named_parameters() if p.requires_grad})
        opt.step()
        opt.zero_grad()
    run.params = {n: p.detach().clone() for n, p in master.named_parameters()}
    return run


def max_differences(run: Run, ref: Run) -> tuple[float, float, float]:
    """(loss, gradient, parameter) largest absolute differences, over steps and elements."""
    loss = max(abs(a - b) for a, b in zip(run.losses, ref.losses))
    grad = max((g[n] - r[n]).abs().max().item() for g, r in zip(run.grads, ref.grads) for n in r)
    param = max((run.params[n] - ref.params[n]).abs().max().item() for n in ref.params)
    return loss, grad, param
