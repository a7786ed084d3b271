"""The one per-rank training worker of the multi-process (gloo) tests, and its single-process
reference.

A test describes a run as a `Training` (model, data, loss, how it is sharded, compiled, optimised
and accumulated), hands a list of them to `run_local(train, world, runs)` (one spawn for all),
and compares each rank's `TrainResult` with `reference(run)`. Everything in a `Training` is
pickled to the spawned ranks: factories are module-level functions or functools.partial.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import graphshard
from tests.zoo import Zoo, gpt_batch, zoo_batch, zoo_loss

LR, EPS, MAX_NORM = 1e-2, 1e-4, 0.5  # eps large enough that float noise is not amplified
EAGER = {"compiler": "eager"}  # graphshard's graphs, run without Inductor
ACCUMULATION = ("no_sync", "set_requires_gradient_sync", "replica_only")

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Training:
    """One run, as every rank trains it; a step's global batch is split over the ranks along
    dim 0, then each rank's slice into `micro_batches` equal micro-batches."""

    model: Callable[[], torch.nn.Module]  # called after torch.manual_seed(0)
    data: Callable[[int], Batch]  # data(step): the step's global batch; the model reads batch[0]
    loss: Callable[..., torch.Tensor]  # loss(output, *batch)
    optimizer: Callable[[Any], torch.optim.Optimizer]  # e.g. partial(torch.optim.SGD, lr=0.1)
    steps: int
    strategy: str = "full_shard"
    mesh_shape: tuple[int, int] | None = None  # (replicate, shard) 2-D mesh; None: 1-D, all ranks
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    compile: dict | None = None  # graphshard backend options (Inductor unless "compiler"); None: eager
    fullgraph: bool = True
    dynamic: bool | None = None  # torch.compile's dynamic=
    max_norm: float | None = None  # clip_grad_norm_ each step; None: no clipping
    micro_batches: int = 1
    accumulation: str = "no_sync"  # how micro-batches before the last skip the sync: ACCUMULATION
    record_grads: bool = False  # full gradients of each step (a gather per parameter and step)

    def __post_init__(self):
        if self.accumulation not in ACCUMULATION:
            raise ValueError(f"accumulation must be one of {ACCUMULATION}, got {self.accumulation!r}")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # global mean loss per step
    norms: list[float] = field(default_factory=list)  # global gradient norm per step (clipping)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step, before clipping
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full, after the last step
    grad_problems: list[str] = field(default_factory=list)  # see grad_layout_problems, any step
    early_grads: list[str] = field(default_factory=list)  # .grad set by a micro-batch not synced
    # per step: (distinct storages under the local gradients, gradients): buckets' gradients
    # that are views of the reduced bucket share its storage
    grad_storages: list[tuple[int, int]] = field(default_factory=list)


def grad_layout_problems(model: torch.nn.Module) -> list[str]:
    """Trainable parameters whose gradient is not a DTensor laid out like the parameter (same
    placements, this rank's local shape, same dtype): one line each, empty when all are."""
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
        elif grad.dtype != p.dtype or grad.to_local().dtype != p.to_local().dtype:
            problems.append(f"{name}: gradient {grad.dtype}, parameter {p.dtype}")
    return problems


def _rank_slice(batch: Batch, rank: int, world: int) -> Batch:
    return tuple(t[rank * (t.shape[0] // world):(rank + 1) * (t.shape[0] // world)] for t in batch)


def _micro_batches(model, run: Training, micro: list[Batch]):
    """Yields the micro-batches, each in its sync mode: all but the last accumulate without
    reducing (the caller runs each one's backward before asking for the next)."""
    *first, last = micro
    if run.accumulation == "set_requires_gradient_sync":
        for batch in first:
            graphshard.set_requires_gradient_sync(model, False)
            yield batch
        graphshard.set_requires_gradient_sync(model, True)
    elif first:
        # One block around them all: leaving it reduces the sum (once, for all of them).
        with graphshard.no_sync(model, replica_only=run.accumulation == "replica_only"):
            yield from first
    yield last


def train(rank: int, world: int, runs: list[Training]) -> list[TrainResult]:
    """Each run on a freshly built, sharded model; this rank trains on its slice of each global
    batch. Losses and norms are global (the same on every rank)."""
    results, meshes = [], {}
    for run in runs:
        torch.manual_seed(0)
        model = run.model()
        mesh = None
        if run.mesh_shape is not None:
            if run.mesh_shape not in meshes:
                meshes[run.mesh_shape] = init_device_mesh(
                    "cpu", run.mesh_shape, mesh_dim_names=("replicate", "shard"))
            mesh = meshes[run.mesh_shape]
        dtypes = {k: v for k, v in (("param_dtype", run.param_dtype),
                                    ("reduce_dtype", run.reduce_dtype)) if v is not None}
        graphshard.shard(model, mesh, strategy=run.strategy, **dtypes)
        opt = run.optimizer(model.parameters())
        fn = model if run.compile is None else torch.compile(
            model, backend="graphshard", options=run.compile, fullgraph=run.fullgraph,
            dynamic=run.dynamic)
        result = TrainResult()
        for step in range(run.steps):
            local = _rank_slice(run.data(step), rank, world)
            micro = list(zip(*(t.chunk(run.micro_batches) for t in local)))
            total = torch.zeros(())
            for index, batch in enumerate(_micro_batches(model, run, micro)):
                loss = run.loss(fn(batch[0]), *batch).float() / len(micro)
                loss.backward()
                if index < len(micro) - 1:
                    result.early_grads += [n for n, p in model.named_parameters() if p.grad is not None]
                total += loss.detach()
            if run.record_grads:
                result.grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()
                                     if p.grad is not None})
            result.grad_problems += grad_layout_problems(model)
            local_grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
            result.grad_storages.append(
                (len({g.untyped_storage().data_ptr() for g in local_grads}), len(local_grads)))
            if run.max_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), run.max_norm)
                result.norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
            opt.step()
            opt.zero_grad()
            torch.distributed.all_reduce(total)
            result.losses.append(total.item() / world)
        result.params = {n: p.full_tensor() for n, p in model.named_parameters()}
        result.grad_problems = sorted(set(result.grad_problems))
        result.early_grads = sorted(set(result.early_grads))
        results.append(result)
        torch._dynamo.reset()
    return results


def reference(run: Training, parts: int = 1) -> TrainResult:
    """`run` in one process, unsharded, eager, on each step's whole global batch (the same
    optimizer and clipping). With a param_dtype: fp32 master weights; each of `parts` equal
    slices of the batch (one per rank and micro-batch) is computed with a param_dtype copy of
    them and the slices' gradients are averaged in fp32: exactly what param_dtype with an fp32
    reduce_dtype promises, computed without any sharding (the slices only fix which sums are
    rounded to param_dtype)."""
    torch.manual_seed(0)
    master = run.model()
    opt = run.optimizer(master.parameters())
    result = TrainResult()
    for step in range(run.steps):
        batch = run.data(step)
        if run.param_dtype is None:
            loss = run.loss(master(batch[0]), *batch)
            loss.backward()
            result.losses.append(loss.item())
        else:
            losses = []
            for part in zip(*(t.chunk(parts) for t in batch)):
                low = copy.deepcopy(master).to(run.param_dtype)
                loss = run.loss(low(part[0]), *part).float()
                loss.backward()
                losses.append(loss.item())
                for p, q in zip(master.parameters(), low.parameters()):
                    if q.grad is not None:
                        g = q.grad.float() / parts
                        p.grad = g if p.grad is None else p.grad + g
            result.losses.append(sum(losses) / parts)
        result.grads.append({n: p.grad.clone() for n, p in master.named_parameters()
                             if p.grad is not None})
        if run.max_norm is not None:
            result.norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), run.max_norm)))
        opt.step()
        opt.zero_grad()
    result.params = {n: p.detach().clone() for n, p in master.named_parameters()}
    return result


# ------------------------------------------------------------------------ data of the test models


def zoo_data(step: int, batch: int = 12) -> Batch:
    return (zoo_batch(batch),)


def gpt_data(step: int, batch: int = 24) -> Batch:
    return (gpt_batch(batch),)


def zoo_training(steps: int, **kwargs) -> Training:
    """The Zoo on the same 12 sequences each step; AdamW(lr=LR) unless told otherwise."""
    kwargs.setdefault("optimizer", functools.partial(torch.optim.AdamW, lr=LR))
    return Training(model=Zoo, data=zoo_data, loss=zoo_loss, steps=steps, **kwargs)
