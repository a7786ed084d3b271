"""A dead or stuck rank ends the run with a clear error within a bounded time."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from graphshard.tools.launch import DistributedRunError, run_local


def _dies_at_step_two(rank: int, world: int):
    for step in range(100):
        if rank == 1 and step == 2:
            os._exit(3)
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
    return "finished"


def _stalls(rank: int, world: int):
    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(4))
    return "finished"


def test_a_rank_that_dies_stops_the_others_quickly():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank 1 exited with code 3"):
        run_local(_dies_at_step_two, 2, timeout_s=60)
    assert time.monotonic() - start < 45


def test_a_stuck_rank_fails_the_others_at_the_collective_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank0 failed"):
        run_local(_stalls, 2, timeout_s=5)
    assert time.monotonic() - start < 45
