"""Run a function on N local processes with a gloo process group (127.0.0.1).

Used by `graphshard train`, the benchmarks and the multi-process tests. Two guards against
hangs: every collective has the process group's timeout, and the parent watches its children,
so one rank dying ends the others at once with an error naming the rank.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
# Ranks start from a fork server that has imported these once: every launch after a process's
# first starts its ranks in milliseconds instead of each rank importing torch again (about 3 s a
# launch here), and Dynamo and Inductor too (0.6 s a rank, in every launch that compiles), and
# Inductor's host probes (its vector-ISA checks, 1-2 s a rank: rank_preload.py).
# Importing them starts no thread (OpenBLAS's pool handles fork itself).
_PRELOAD = ["torch", "graphshard", "torch._dynamo", "torch._inductor.compile_fx",
            "graphshard.tools.rank_preload"]
# Variables read once, when the interpreter starts or torch is imported (TORCH_LOGS,
# TORCHINDUCTOR_*, OMP_NUM_THREADS, PYTHONHASHSEED, LD_PRELOAD, ...): the fork server's ranks
# see them as they were when it started, so a change to one means a fresh (spawned) start.
_READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "PYTHON", "LD_")
_server_started_with: dict[str, str] | None = None


class DistributedRunError(RuntimeError):
    """A rank of a local multi-process run failed."""


class RankKilledError(DistributedRunError):
    """A rank of a local multi-process run was killed by a signal (a native crash, the OOM
    killer), not by an error its Python code raised."""


# Relaunches of a run one of whose ranks a signal killed, each with a warning carrying the
# crash report (0: none; the test suite relaunches once: a gloo rank aborts in native code, with
# no Python frame to show, about once in several suite runs).
RELAUNCHES_AFTER_A_SIGNAL = 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo") -> None:
    """init_process_group from torchrun-style environment variables, with a bounded timeout."""
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _worker(rank: int, world_size: int, port: int, timeout_s: float, result_dir: str,
            call: bytes, threads: int | None, environ: dict[str, str]) -> None:
    # The launcher's environment of now, not the fork server's at its start, before `fn` and
    # its arguments are unpickled (their modules may read it when imported).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if "numpy" in sys.modules:  # forked: reseed from the OS, as a spawned rank's numpy is
        sys.modules["numpy"].random.seed()
    if threads:
        torch.set_num_threads(threads)
    # a rank killed by a signal (an abort in the transport, a segfault) leaves its Python stack
    fault_file = open(os.path.join(result_dir, f"rank{rank}.fault"), "w")
    faulthandler.enable(fault_file, all_threads=True)
    init_from_env(timeout_s)
    try:
        fn, args = pickle.loads(call)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S,
              threads: int | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` local processes; return each rank's result.

    fn must be importable (a module-level function). A failing or dying rank raises
    DistributedRunError with that rank's traceback; the others are terminated. Ranks fork from
    a server started at the first launch (see `_PRELOAD`): `fn` sees this process's environment
    of now, but the launching script's module-level code, which each rank runs again as it
    starts, sees the environment of the first launch.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    for relaunch in range(RELAUNCHES_AFTER_A_SIGNAL + 1):
        try:
            return _run_once(fn, world_size, args, timeout_s, threads)
        except RankKilledError as exc:
            if relaunch == RELAUNCHES_AFTER_A_SIGNAL:
                raise
            warnings.warn(f"graphshard.run_local: {exc}\nrelaunching the run "
                          f"({relaunch + 1} of {RELAUNCHES_AFTER_A_SIGNAL})", stacklevel=2)
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float,
              threads: int) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="graphshard-run-") as result_dir:
        try:
            mp.start_processes(
                _worker, args=(world_size, free_port(), timeout_s, result_dir,
                               pickle.dumps((fn, args)), threads, dict(os.environ)),
                nprocs=world_size, join=True, start_method=_start_method(),
            )
        except mp.ProcessRaisedException as exc:
            raise DistributedRunError(_first_error(result_dir) or str(exc)) from None
        except mp.ProcessExitedException as exc:
            error = RankKilledError if exc.exit_code < 0 else DistributedRunError
            raise error(
                f"rank {exc.error_index} exited with code {exc.exit_code} (killed or crashed); "
                "the other ranks were stopped" + _fault_report(result_dir, exc.error_index)
            ) from None
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _start_method() -> str:
    """"forkserver" while the variables torch reads at import are what the fork server started
    with; "spawn" (every rank imports afresh) once they differ."""
    global _server_started_with
    now = {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_IMPORT)}
    if _server_started_with is None:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        _server_started_with = now
    return "forkserver" if now == _server_started_with else "spawn"


def _fault_report(result_dir: str, rank: int) -> str:
    """Where the rank was when a signal killed it (faulthandler's dump), if it left one."""
    path = os.path.join(result_dir, f"rank{rank}.fault")
    text = open(path).read().strip() if os.path.exists(path) else ""
    returned = os.path.exists(os.path.join(result_dir, f"rank{rank}.pt"))
    when = " (after it had returned its result, in its teardown)" if returned else ""
    return f"; its Python stacks at the signal{when}:\n{text}" if text else when


def _first_error(result_dir: str) -> str | None:
    # The first rank to fail is the root cause; later ones often just lost their peer.
    errors = [n for n in os.listdir(result_dir) if n.endswith(".err")]
    if not errors:
        return None
    first = min(errors, key=lambda n: os.path.getmtime(os.path.join(result_dir, n)))
    with open(os.path.join(result_dir, first)) as f:
        return f"{first[:-4]} failed:\n{f.read()}"
