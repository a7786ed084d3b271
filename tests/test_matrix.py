"""The combination matrix: every feature under the default compiler (Inductor), in pairs.

Factors: strategy {full_shard, shard_grad_op, no_shard, hybrid_shard 2x2} x precision {fp32,
bf16 params + fp32 reduce} x activation checkpointing {none, full, selective} x accumulation
{none, no_sync over 2 micro-batches} x transport {native, all_to_all, auto}. The 12 rows below
cover every pair of factor values at least once (checked by a test), on TinyGPT: tied
embedding/head, a frozen and a 0-dim parameter, SDPA attention, uneven shards.

Tolerances. fp32: 1e-5 against a single process on the global batch (sharding changes only the
order of fp32 sums). bf16: the reference computes each rank's micro-batch with a bf16 copy of fp32
master weights and averages the gradients in fp32 (what the policy promises), but Inductor's bf16
kernels round differently from eager bf16 (they compute pointwise chains in fp32), so the two bf16
runs differ by bf16 rounding, not by sharding. What must hold: graphshard's bf16 run is no further
from the fp32 reference than the eager bf16 reference is (within 2x, measured 1.0-1.1x on gradients),
and it is a bf16 run at all (its loss differs from fp32's by more than fp32 noise).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import pytest
import torch

from graphshard.tools.launch import run_local
from tests.workers import TrainResult, Training, gpt_data, reference, train
from tests.zoo import TinyGPT, zoo_loss

STEPS, GLOBAL_BATCH, LR = 2, 24, 0.05
TRANSPORTS = {
    "native": {"all_gather": "native", "reduce_scatter": "native"},  # the path NCCL users run
    # all-to-all, scheduled to overlap only below the peak (what reorders collectives most)
    "all_to_all": {"all_gather": "all_to_all", "reduce_scatter": "all_to_all",
                   "overlap_within_peak": True},
    "auto": {},
}


@dataclass(frozen=True)
class Config:
    strategy: str  # full_shard, shard_grad_op, no_shard, hybrid_shard (2 x world/2 mesh)
    bf16: bool  # bf16 parameters for compute, fp32 reduction
    ac: str  # none, full, selective
    accumulate: bool  # two micro-batches per step, the first under no_sync
    transport: str  # a key of TRANSPORTS
    bucket_mb: float | None = None  # a cap other than the default (no_shard: several buckets)

    def __str__(self):
        return (f"{self.strategy}/{'bf16' if self.bf16 else 'fp32'}/ac={self.ac}/"
                f"{'accum' if self.accumulate else 'noaccum'}/{self.transport}"
                + (f"/bucket_mb={self.bucket_mb}" if self.bucket_mb is not None else ""))

    def training(self, world: int) -> Training:
        """SGD on TinyGPT under the default compiler (Inductor), full gradients each step."""
        low = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else {}
        return Training(
            model=functools.partial(TinyGPT, self.ac), data=functools.partial(gpt_data, batch=GLOBAL_BATCH),
            loss=zoo_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR), steps=STEPS,
            strategy=self.strategy, record_grads=True,
            compile=TRANSPORTS[self.transport] | (
                {} if self.bucket_mb is None else {"bucket_mb": self.bucket_mb}),
            mesh_shape=(2, world // 2) if self.strategy == "hybrid_shard" else None,
            micro_batches=2 if self.accumulate else 1, **low)


def max_differences(run: TrainResult, ref: TrainResult) -> tuple[float, float, float]:
    """(loss, gradient, parameter) largest absolute differences, over steps and elements."""
    loss = max(abs(a - b) for a, b in zip(run.losses, ref.losses))
    grad = max((g[n] - r[n]).abs().max().item() for g, r in zip(run.grads, ref.grads) for n in r)
    param = max((run.params[n] - ref.params[n]).abs().max().item() for n in ref.params)
    return loss, grad, param


F, G, N, H = "full_shard", "shard_grad_op", "no_shard", "hybrid_shard"
FP32, BF16 = False, True
# (world size, Config(strategy, bf16, ac, accumulate, transport)): a pairwise covering array.
MATRIX = [
    (2, Config(F, BF16, "none", False, "all_to_all")),
    (2, Config(F, BF16, "selective", False, "native")),
    (2, Config(G, BF16, "full", False, "native")),
    (2, Config(G, FP32, "selective", True, "all_to_all")),
    (2, Config(N, BF16, "selective", False, "all_to_all")),
    # gradients of 7.3 KiB in 2 KiB buckets that span blocks: four all-reduces a step
    (2, Config(N, FP32, "full", True, "native", bucket_mb=2 / 1024)),
    (2, Config(N, BF16, "none", False, "auto")),
    (3, Config(F, FP32, "full", True, "auto")),  # world 3: other uneven shards
    (3, Config(G, FP32, "none", False, "auto")),
    (4, Config(H, BF16, "none", True, "native")),  # 2 replica groups x 2-way shards
    (4, Config(H, FP32, "selective", False, "auto")),
    (4, Config(H, FP32, "full", False, "all_to_all")),
]
FACTORS = {
    "strategy": (F, G, N, H), "bf16": (FP32, BF16), "ac": ("none", "full", "selective"),
    "accumulate": (False, True), "transport": ("native", "all_to_all", "auto"),
}
FP32_TOL = 1e-5
BF16_ERROR_RATIO = 2.0


def test_matrix_covers_every_pair_of_feature_values():
    rows = [config for _, config in MATRIX]
    for a, b in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            assert any(getattr(c, a) == x and getattr(c, b) == y for c in rows), (a, x, b, y)


def _check(config: Config, world: int, run) -> str:
    if not config.accumulate:  # a bucket's reduced gradients are views of it, not copies
        assert all(storages < grads for storages, grads in run.grad_storages), run.grad_storages
    parts = world * (2 if config.accumulate else 1)
    training = config.training(world)
    fp32_ref = reference(dataclasses.replace(training, param_dtype=None, reduce_dtype=None))
    if not config.bf16:
        loss, grad, param = max_differences(run, fp32_ref)
        assert max(loss, grad, param) < FP32_TOL, (str(config), loss, grad, param)
        return f"{config} world {world}: loss {loss:.1e} grad {grad:.1e} param {param:.1e}"
    bf16_ref = reference(training, parts=parts)
    ours = max_differences(run, fp32_ref)
    eager_bf16 = max_differences(bf16_ref, fp32_ref)
    for what, mine, theirs in zip(("loss", "grad", "param"), ours, eager_bf16):
        assert mine <= BF16_ERROR_RATIO * theirs, (str(config), what, mine, theirs)
    assert ours[0] > 1e-4, (str(config), "loss equals fp32's: was bf16 applied?", ours)
    return f"{config} world {world}: vs fp32 {ours}, eager bf16 vs fp32 {eager_bf16}"


def _groups():
    """The rows of each world size, all in one spawned process group (one Inductor compile per
    row and rank; a spawn's ranks start their compile workers once)."""
    for world in sorted({w for w, _ in MATRIX}):
        yield pytest.param(world, [config for w, config in MATRIX if w == world], id=f"world{world}")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # world size 2: seven rows compiled in one spawn
@pytest.mark.parametrize("world, configs", _groups())
def test_matrix_matches_single_process_under_inductor(world, configs):
    per_rank = run_local(train, world, [config.training(world) for config in configs])
    for rank_runs in per_rank[1:]:  # every rank saw the same global numbers
        for run, first in zip(rank_runs, per_rank[0]):
            assert run.losses == first.losses
    for config, run in zip(configs, per_rank[0]):
        print(_check(config, world, run))
