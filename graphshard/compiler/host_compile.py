"""One compile per host: ranks on one host that would compile the same graphs let one of them
compile, and load its result from the host's compile caches.

Every rank of a job traces the same model, and where every shard has one shape and no rank's
index is baked into the lowered graphs, they all compile identical graphs: on a host of 8 GPUs,
8 identical compiles competing for the host's CPUs. Here the first rank to reach a Dynamo graph
(keyed by everything AOTAutograd's cache key covers that can differ between ranks: the graph's
code, our cache salt, the inputs' shapes, strides and dtypes, the objects among them as the
cache key pickles them, grad mode, the cache directory, the host) claims it in the default
process group's store and compiles it; the others on that host wait until it is done, then
compile too, which AOTAutograd and Inductor serve from their caches.

Correctness never rests on this key: what a waiting rank loads is whatever AOTAutograd's own
cache key (salted with ours, compile_cache.py) finds; where the entry is not there (another
key after all, a cache turned off) it compiles as it would have, only later. No collective is
involved, so a rank that waits cannot leave a peer blocked in one: the compile itself runs
none (the schedule check accepts the waiting ranks through `announce`), and the claimant
marks the key done whether its compile succeeded or failed.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from graphshard import _torch_compat as compat
from graphshard.compiler.compile_cache import reuses_cache
from graphshard.compiler import rank_agreement
from graphshard.compiler.rank_agreement import agreement_store

log = logging.getLogger("graphshard")

WAIT_S = 3600.0  # for the claimant's compile; past it the waiting rank compiles by itself
_PREFIX = "graphshard/host_compile"


def host_compile_key(code: str, salt: str, example_inputs: Sequence[Any],
                     object_key: Callable[[Any], str] = lambda x: type(x).__name__) -> str:
    """What must be equal for two ranks to compile one graph (see the module docstring).
    `object_key`: what the cache key makes of an input that is neither a tensor nor a number
    (a graph that takes a DeviceMesh never gets here: `takes_device_mesh`)."""
    def input_key(x):
        if isinstance(x, torch.Tensor):
            return tuple(x.shape), tuple(x.stride()), str(x.dtype), x.requires_grad
        if isinstance(x, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return type(x).__name__
        return object_key(x)

    inputs = [input_key(x) for x in example_inputs]
    text = repr((socket.gethostname(), compat.compile_cache_dir(), code, salt, inputs,
                 torch.is_grad_enabled()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def compile_once_per_host(key: str, compile_graphs: Callable[[], Any], *,
                          announce: Callable[[], None] = lambda: None,
                          join: Callable[[], None] = lambda: None,
                          wait_s: float = WAIT_S) -> Any:
    """`compile_graphs()` on the first rank to reach `key`; on the others, once it is done.
    `announce()` runs on a waiting rank before it waits (it tells peers it will load the
    claimant's compile); `join()` runs on it for each agreement collective the claimant's
    compile runs ("auto"'s minimum over ranks), which every rank must join."""
    store = agreement_store()
    if store is None:
        return compile_graphs()
    rank = str(dist.get_rank())
    claimant = store.compare_set(f"{_PREFIX}/{key}/claim", "", rank).decode()
    collectives = f"{_PREFIX}/{key}/collectives"
    if claimant == rank:
        log.info("graphshard: rank %s compiles graph %s for the ranks of host %s", rank,
                 key[:8], socket.gethostname())
        rank_agreement.before_agreement_collective = lambda: store.add(collectives, 1)
        try:
            return compile_graphs()
        finally:
            rank_agreement.before_agreement_collective = None
            store.set(f"{_PREFIX}/{key}/done", "1")
    announce()
    done, deadline, pause, joined = [f"{_PREFIX}/{key}/done"], time.monotonic() + wait_s, 0.01, 0
    while True:
        finished = store.check(done)  # read before the count: a last collective is not missed
        while joined < store.add(collectives, 0):
            join()
            joined += 1
        if finished:
            log.info("graphshard: rank %s loads graph %s compiled by rank %s", rank, key[:8],
                     claimant)
            break
        if time.monotonic() > deadline:
            log.warning("graphshard: rank %s waited %.0f s for rank %s's compile of graph %s; "
                        "compiling it itself", rank, wait_s, claimant, key[:8])
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
    return compile_graphs()


TENSOR_PARALLEL = ("tensor parallelism: the graphs take a DeviceMesh and hold the rank's place "
                   "in it (docs/architecture.md, one compile per host)")


def per_rank_compile_reason(options, *, cached: bool, bypass: str | None = None,
                            takes_device_mesh: bool = False) -> str | None:
    """Why each rank compiles its own graphs, or None where one compile per host applies.
    `cached`: AOTAutograd may serve this compile from its cache (compile_cache.reuses_cache);
    `bypass`: why its cache would not store this graph (compat.aot_cache_bypass_reason): a
    rank that waited for the claimant would then compile after it, not instead;
    `takes_device_mesh`: the graph takes a DeviceMesh (a tensor-parallel plan's: see the
    function of that name)."""
    if takes_device_mesh:
        return TENSOR_PARALLEL
    if not options.compile_once_per_host:
        return "compile_once_per_host=False"
    if options.compiler != "inductor":
        return f"compiler={options.compiler!r} produces nothing the compile caches store"
    if not (cached and compat.compile_caches_enabled()):
        return "the compile caches (AOTAutograd's and Inductor's FX graph cache) are off"
    if bypass is not None:
        return f"AOTAutograd's cache cannot store this graph ({bypass})"
    return None


def takes_device_mesh(example_inputs: Sequence[Any]) -> bool:
    """Whether a Dynamo graph takes a DeviceMesh, whose rank's place AOTAutograd's cache key
    holds: no other rank's key matches it. graphshard's own graphs take none (they read plain
    leaves and name groups by rank-invariant aliases); a tensor-parallel plan's DTensors bring
    theirs."""
    from torch.distributed.device_mesh import DeviceMesh

    return any(isinstance(x, DeviceMesh) for x in example_inputs)


def log_per_rank_compile(reason: str) -> None:
    """Say why this rank compiles by itself (in a job of several ranks; once per compile)."""
    if agreement_store() is not None:
        log.info("graphshard: each rank compiles its own graphs: %s", reason)


def compile_sharing(options, bypass: str | None = None, takes_device_mesh: bool = False) -> str:
    """What `graphshard dump` says of a job's compiles: "once per host", or "per rank: <why>"
    (`bypass`, `takes_device_mesh`: the captured graph's, see per_rank_compile_reason)."""
    reason = per_rank_compile_reason(
        options, cached=reuses_cache(options, aot_cache=True, observed=False), bypass=bypass,
        takes_device_mesh=takes_device_mesh)
    return "once per host" if reason is None else f"per rank: {reason}"
