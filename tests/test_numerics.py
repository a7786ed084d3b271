"""Multi-process gloo numerics: sharded training equals single-process training."""

from __future__ import annotations

import pytest

from graphshard.launch import run_local
from tests.workers import reference_zoo, train_zoo

STEPS = 5
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
PASSES_ON = {"compiler": "eager"}  # defaults: bucketing and reordering on
PASSES_OFF = {"compiler": "eager", "bucket_mb": 0, "reorder": False}


def _check(results, reference, tol=1e-5):
    ref_losses, ref_norms, ref_params = reference.losses, reference.norms, reference.params
    losses, norms, params, grad_problems = results
    assert grad_problems == []  # every gradient a DTensor shard laid out like its parameter
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < tol
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) < tol  # clip_grad_norm_ is global
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() < tol, name


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process_eager_and_compiled_without_inductor(world_size):
    # options None: eager; PASSES_*: torch.compile with graphshard's passes on / off, the
    # resulting graphs run without Inductor. One spawn for all configs keeps the test cheap.
    configs = [(s, o) for s in STRATEGIES for o in (None, PASSES_ON, PASSES_OFF)]
    reference = reference_zoo(STEPS)
    per_rank = run_local(train_zoo, world_size, configs, STEPS)
    for rank_results in per_rank:
        for results in rank_results:
            _check(results, reference)


# Under Inductor (the default compiler), every strategy with every other feature: test_matrix.py.
