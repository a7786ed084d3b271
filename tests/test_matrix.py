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

import itertools

import pytest
import torch

from graphshard.launch import run_local
from tests.matrix_workers import Config, max_differences, reference, train_rank

F, G, N, H = "full_shard", "shard_grad_op", "no_shard", "hybrid_shard"
FP32, BF16 = False, True
# (world size, Config(strategy, bf16, ac, accumulate, transport)): a pairwise covering array.
MATRIX = [
    (2, Config(F, BF16, "none", False, "all_to_all")),
    (2, Config(F, BF16, "selective", False, "native")),
    (2, Config(G, BF16, "full", False, "native")),
    (2, Config(G, FP32, "selective", True, "all_to_all")),
    (2, Config(N, BF16, "selective", False, "all_to_all")),
    (2, Config(N, FP32, "full", True, "native")),
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
    parts = world * (2 if config.accumulate else 1)
    fp32_ref = reference(config.ac, bf16=False)
    if not config.bf16:
        loss, grad, param = max_differences(run, fp32_ref)
        assert max(loss, grad, param) < FP32_TOL, (str(config), loss, grad, param)
        return f"{config} world {world}: loss {loss:.1e} grad {grad:.1e} param {param:.1e}"
    bf16_ref = reference(config.ac, bf16=True, parts=parts)
    ours = max_differences(run, fp32_ref)
    eager_bf16 = max_differences(bf16_ref, fp32_ref)
    for what, mine, theirs in zip(("loss", "grad", "param"), ours, eager_bf16):
        assert mine <= BF16_ERROR_RATIO * theirs, (str(config), what, mine, theirs)
    assert ours[0] > 1e-4, (str(config), "loss equals fp32's: was bf16 applied?", ours)
    return f"{config} world {world}: vs fp32 {ours}, eager bf16 vs fp32 {eager_bf16}"


def _groups(per_spawn: int = 4):
    """Rows of one world size, a few per spawned process group (one Inductor compile each)."""
    for world in sorted({w for w, _ in MATRIX}):
        rows = [config for w, config in MATRIX if w == world]
        for start in range(0, len(rows), per_spawn):
            yield pytest.param(world, rows[start:start + per_spawn], id=f"world{world}-{start}")


@pytest.mark.parametrize("world, configs", _groups())
def test_matrix_matches_single_process_under_inductor(world, configs):
    per_rank = run_local(train_rank, world, configs)
    for rank_runs in per_rank[1:]:  # every rank saw the same global numbers
        for run, first in zip(rank_runs, per_rank[0]):
            assert run.losses == first.losses
    for config, run in zip(configs, per_rank[0]):
        print(_check(config, world, run))
