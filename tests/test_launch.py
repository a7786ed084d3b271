"""A dead or stuck rank ends the run with a clear error within a bounded time; ranks start from a
fork server and see the launcher's environment as it is at launch."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from graphshard.tools import launch
from graphshard.tools.launch import DistributedRunError, RankKilledError, run_local


def _dies_at_step_two(rank: int, world: int):
    for step in range(100):
        if rank == 1 and step == 2:
            os._exit(3)
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
    return "finished"


def _aborts_in_a_named_function(rank: int, world: int):
    if rank == 1:
        os.abort()  # as a transport's C++ assertion does
    time.sleep(60)


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


def test_a_rank_killed_by_a_signal_is_reported_with_its_python_stack(monkeypatch):
    monkeypatch.setattr(launch, "RELAUNCHES_AFTER_A_SIGNAL", 0)
    with pytest.raises(RankKilledError) as error:
        run_local(_aborts_in_a_named_function, 2, timeout_s=60)
    message = str(error.value)
    assert "rank 1 exited with code -6" in message, message
    assert "_aborts_in_a_named_function" in message, message


def _aborts_on_the_first_launch(rank: int, world: int, marker: str):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    dist.all_reduce(torch.ones(1))
    return rank


def test_a_run_is_relaunched_after_a_signal_with_a_warning_and_not_after_an_error(monkeypatch,
                                                                                   tmp_path):
    monkeypatch.setattr(launch, "RELAUNCHES_AFTER_A_SIGNAL", 1)
    with pytest.warns(UserWarning, match=r"(?s)rank 1 exited with code -6.*relaunching the run \(1 of 1\)"):
        assert run_local(_aborts_on_the_first_launch, 2, str(tmp_path / "aborted"), timeout_s=60) == [0, 1]
    with pytest.raises(RankKilledError), pytest.warns(UserWarning, match="relaunching"):
        run_local(_aborts_in_a_named_function, 2, timeout_s=60)  # every launch: the error stands
    with pytest.raises(DistributedRunError, match="rank 1 exited with code 3"):
        run_local(_dies_at_step_two, 2, timeout_s=60)  # a Python error is not relaunched


def test_a_stuck_rank_fails_the_others_at_the_collective_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank0 failed"):
        run_local(_stalls, 2, timeout_s=5)
    assert time.monotonic() - start < 45


def _environment_seen(rank: int, world: int, name: str):
    return os.environ.get(name), os.getppid()


def test_ranks_see_the_environment_of_the_launch_and_start_afresh_when_torch_would_read_it_otherwise(
        monkeypatch):
    run_local(_environment_seen, 1, "PATH")  # the fork server runs from here on
    monkeypatch.setenv("GRAPHSHARD_TEST_SETTING", "set after the server started")
    [(value, parent)] = run_local(_environment_seen, 1, "GRAPHSHARD_TEST_SETTING")
    assert value == "set after the server started"
    assert parent != os.getpid()  # forked by the server, which had imported torch already
    # torch reads TORCH* variables when imported: a changed one is only honoured by a fresh import
    monkeypatch.setenv("TORCHINDUCTOR_GRAPHSHARD_TEST_SETTING", "1")
    [(value, parent)] = run_local(_environment_seen, 1, "TORCHINDUCTOR_GRAPHSHARD_TEST_SETTING")
    assert (value, parent) == ("1", os.getpid())  # spawned by this process
    monkeypatch.delenv("TORCHINDUCTOR_GRAPHSHARD_TEST_SETTING")
    [(value, parent)] = run_local(_environment_seen, 1, "TORCHINDUCTOR_GRAPHSHARD_TEST_SETTING")
    assert value is None and parent != os.getpid()  # back to the server's environment


def _numpy_draw(rank: int, world: int) -> float:
    import numpy as np

    return float(np.random.rand())


def test_ranks_forked_from_the_server_draw_their_own_numpy_numbers():
    # numpy is not reseeded at fork: unreseeded, every rank of every launch would augment and
    # sample alike (spawned ranks seed from the OS)
    first, second = run_local(_numpy_draw, 2), run_local(_numpy_draw, 2)
    assert len(set(first + second)) == 4, (first, second)


def _vector_isa_probed(rank: int, world: int) -> bool:
    from graphshard._torch_compat import inductor_vector_isa_probed

    return inductor_vector_isa_probed()


def test_ranks_forked_from_the_server_inherit_inductors_host_probes():
    # Inductor probes the vector ISAs once a process (a g++ build and a dlopen subprocess for
    # each): the fork server probes them, so a rank's first compile or cache load does not
    assert run_local(_vector_isa_probed, 2) == [True, True]
