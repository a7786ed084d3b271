"""Multi-process gloo numerics: sharded training equals single-process training."""

from __future__ import annotations

import functools

import pytest
import torch

from graphshard.tools.launch import run_local
from tests.workers import EPS, LR, MAX_NORM, TrainResult, reference, train, zoo_training

STEPS = 5
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
PASSES_ON = {"compiler": "eager"}  # defaults: bucketing and reordering on
PASSES_OFF = {"compiler": "eager", "bucket_mb": 0, "reorder": False}
ADAMW = functools.partial(torch.optim.AdamW, lr=LR, eps=EPS)


def _check(result: TrainResult, ref: TrainResult, tol=1e-5):
    assert result.grad_problems == []  # every gradient a DTensor shard laid out like its parameter
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses)) < tol
    assert max(abs(a - b) for a, b in zip(result.norms, ref.norms)) < tol  # clip_grad_norm_ is global
    for name, expected in ref.params.items():
        assert (result.params[name] - expected).abs().max().item() < tol, name


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_matches_single_process_eager_and_compiled_without_inductor(world_size):
    # compile None: eager; PASSES_*: torch.compile with graphshard's passes on / off, the
    # resulting graphs run without Inductor. One spawn for all runs keeps the test cheap.
    runs = [zoo_training(STEPS, strategy=s, compile=o, optimizer=ADAMW, max_norm=MAX_NORM)
            for s in STRATEGIES for o in (None, PASSES_ON, PASSES_OFF)]
    ref = reference(runs[0])
    per_rank = run_local(train, world_size, runs)
    for rank_results in per_rank:
        for result in rank_results:
            _check(result, ref)


# Under Inductor (the default compiler), every strategy with every other feature: test_matrix.py.
