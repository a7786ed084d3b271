"""Ranks check, at compile time, that they compiled one collective schedule.

Each compiled graph's collective sequence (passes/schedule_digest.py) is digested and compared
with the other ranks' through the default process group's store, not by a collective: a rank
that recompiles alone (its batch changed shape) finds the digest the others published when they
compiled the same schedule and goes on at once. Where the schedules differ, every rank that
compiles sees the other's digest, one it never compiled itself, and raises within a poll
interval, naming the first collective that differs and what each rank runs it for; a rank
whose schedule no other rank publishes within `WAIT_S` raises too.

A rank that loads a compile instead (compiled by another rank of its host, or found in the
compile caches) publishes which Dynamo graph it loads; its peers take the schedule of the rank
that compiled that graph as its own. Ranks of one host at different places of a mesh (two
tensor-parallel ranks) compile different graphs with one schedule, so a rank never waits for a
loading peer's own digest: that peer waits for its graph's compiler, which may be waiting here.
"""

from __future__ import annotations

import inspect
import json
import time

import torch.distributed as dist
import torch.fx as fx

from graphshard import _torch_compat as compat
from graphshard.passes.graph_utils import collective_group, is_collective
from graphshard.passes.schedule_digest import CollectiveRecord, collective_sequence, schedule_digest

WAIT_S = 300.0  # for another rank to compile the same graph (its compile may start later)
_PREFIX = "graphshard/schedule"


class ScheduleMismatchError(compat.short_traceback_error()):  # a RuntimeError
    """Ranks compiled different collective sequences for one graph: run, they would hang,
    abort in the transport, or pair collectives of equal size and train on wrong numbers.
    (Dynamo re-raises it as is, so its message is the first line the user reads.)"""

    def __init__(self, message: str, first_useful_frame):
        RuntimeError.__init__(self, message)
        self.first_useful_frame = first_useful_frame


def _encode(records: list[CollectiveRecord]) -> str:
    return json.dumps([[r.op, r.kind, r.group, r.group_size, r.dtype, r.size, list(r.params)]
                       for r in records])


def _decode(text: bytes) -> list[CollectiveRecord]:
    return [CollectiveRecord(op, kind, group, size, dtype, numel, tuple(params))
            for op, kind, group, size, dtype, numel, params in json.loads(text)]


def _first_difference(mine: list[CollectiveRecord], theirs: list[CollectiveRecord]) -> int:
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a.key() != b.key()),
                min(len(mine), len(theirs)))


def _mismatch_message(graph_kind: str, rank: int, mine: list[CollectiveRecord], other: int,
                      theirs: list[CollectiveRecord]) -> str:
    at = _first_difference(mine, theirs)
    side = lambda records: records[at].describe() if at < len(records) else "nothing (its sequence ends)"  # noqa: E731
    return (
        f"graphshard: ranks compiled different collective schedules for the {graph_kind} graph "
        f"(rank {rank}: {len(mine)} collectives, rank {other}: {len(theirs)}); collective "
        f"#{at} is {side(mine)} on rank {rank}, but {side(theirs)} on rank {other}. Run, they "
        "would hang, abort, or compute wrong numbers. Every rank must trace the same code: look "
        "for a rank-dependent branch in forward (`if dist.get_rank() == ...`), data-dependent "
        "control flow, or a module used on some ranks only. To skip this check, pass "
        "options={'check_schedule': False}.")


_mismatches_raised: dict[str, int] = {}  # per pair of schedules: how often this rank raised


def _wait_until_every_rank_saw_it(store, pair: str, rank: int, peers: list[int],
                                  wait_s: float = 30.0) -> None:
    """The store lives in the lowest rank's process (rank 0's, where init_process_group hosts
    it): that rank must not raise, and perhaps exit, while another still reads the schedules.
    Every rank says it saw the mismatch, as its last use of the store; the lowest rank then
    waits (briefly) for the others' word. The keys count the mismatches of this pair of
    schedules, so that the same mismatch compiled again (a second model, another transport)
    never finds the keys of the first."""
    occurrence = _mismatches_raised.get(pair, 0)
    _mismatches_raised[pair] = occurrence + 1
    key = f"{pair}/{occurrence}"
    store.set(f"{key}/{rank}", "1")
    if peers and rank > min(peers):
        return
    names = [f"{key}/{r}" for r in peers]
    deadline = time.monotonic() + wait_s
    while not store.check(names) and time.monotonic() < deadline:
        time.sleep(0.05)


def _loads(rank: int) -> str:  # the Dynamo graph the rank loads now ("": none)
    return f"{_PREFIX}/loads/{rank}"


def _loaded(rank: int, dynamo_key: str) -> str:  # it loaded that graph, ever
    return f"{_PREFIX}/loaded/{rank}/{dynamo_key}"


def _graph_schedule(dynamo_key: str, graph_kind: str) -> str:
    return f"{_PREFIX}/graph/{dynamo_key}/{graph_kind}"


_loaded_here: set[str] = set()  # the Dynamo graphs this process loaded instead of compiling


def record_served_from_cache(dynamo_key: str) -> None:
    """This rank loads the compile of the Dynamo graph `dynamo_key` (compiled by another rank of
    its host, or found in the compile caches) instead of compiling it, so it publishes no
    schedule of its own: peers accept the schedule of whichever rank compiled that graph, or
    the same graph's compile."""
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        store, rank = compat.default_store(), dist.get_rank()
        store.set(_loaded(rank, dynamo_key), "1")
        store.set(_loads(rank), dynamo_key)
        _loaded_here.add(dynamo_key)


def _peers(gm: fx.GraphModule, rank: int) -> list[int]:
    """The other ranks of the groups this graph's collectives run on (a mesh may span only
    part of the world: a pipeline stage, one of two models)."""
    groups = {collective_group(node)[0] for node in gm.graph.nodes if is_collective(node)}
    ranks = {r for group in groups for r in compat.process_group_ranks(group)}
    return sorted(ranks - {rank})


def check_schedule(gm: fx.GraphModule, graph_kind: str, *, dynamo_key: str | None = None,
                   wait_s: float = WAIT_S) -> None:
    """Raise ScheduleMismatchError unless every rank this graph exchanges with compiled (or
    compiles) a `graph_kind` graph with this graph's collective sequence, or loads the compile
    of this Dynamo graph (`dynamo_key`) or of one with this schedule."""
    # a fake process group (graphshard dump, the planner) is one process: no other rank to ask
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    records = collective_sequence(gm)
    digest, rank = schedule_digest(records), dist.get_rank()
    peers = _peers(gm, rank)
    store = compat.default_store()
    has = lambda r, d: f"{_PREFIX}/has/{graph_kind}/{r}/{d}"  # noqa: E731
    latest = lambda r: f"{_PREFIX}/latest/{graph_kind}/{r}"  # noqa: E731
    store.set(f"{_PREFIX}/sequence/{digest}", _encode(records))
    store.set(has(rank, digest), "1")
    store.set(latest(rank), digest)
    store.set(_loads(rank), "")  # this rank compiles this graph itself
    if dynamo_key is not None:  # for the ranks that load this compile instead
        store.set(_graph_schedule(dynamo_key, graph_kind), digest)

    def schedule_of(dynamo_key_loaded: str) -> str | None:
        key = _graph_schedule(dynamo_key_loaded, graph_kind)
        return store.get(key).decode() if store.check([key]) else None

    def ran_here(other_digest: str) -> bool:
        """This rank compiled or loaded a graph with that schedule: a peer still on it is
        behind this rank in the same sequence of compiles."""
        return store.check([has(rank, other_digest)]) or any(
            schedule_of(loaded) == other_digest for loaded in _loaded_here)

    def current_schedule(other: int) -> tuple[bool, str | None]:
        """(accepted, the other rank's newest schedule): it compiled this schedule, or loads a
        compile of this graph or of one with this schedule."""
        if store.check([has(other, digest)]) or (
                dynamo_key is not None and store.check([_loaded(other, dynamo_key)])):
            return True, digest
        loads = store.get(_loads(other)).decode() if store.check([_loads(other)]) else ""
        if loads:  # another graph than this one (its load is `_loaded`, accepted above)
            theirs = schedule_of(loads)  # None until the rank that compiles it gets here
            return theirs == digest, theirs
        return False, store.get(latest(other)).decode() if store.check([latest(other)]) else None

    waiting = list(peers)
    deadline, pause = time.monotonic() + wait_s, 0.01
    while waiting:
        for other in list(waiting):
            accepted, theirs = current_schedule(other)
            if accepted:
                waiting.remove(other)
                continue
            # the other rank's newest schedule, one this rank never ran: not a rank behind or
            # ahead of this one in the same sequence of compiles, but a different graph
            if theirs is not None and not ran_here(theirs):
                other_records = _decode(store.get(f"{_PREFIX}/sequence/{theirs}"))
                # keyed by the two schedules: an earlier mismatch's keys must not count
                pair = "/".join(sorted((digest, theirs)))
                _wait_until_every_rank_saw_it(store, f"{_PREFIX}/raised/{graph_kind}/{pair}",
                                              rank, peers)
                raise ScheduleMismatchError(
                    _mismatch_message(graph_kind, rank, records, other, other_records),
                    inspect.currentframe())
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise ScheduleMismatchError(
                f"graphshard: rank(s) {waiting} compiled no {graph_kind} graph with rank {rank}'s "
                f"collective schedule ({len(records)} collectives, the first "
                f"{records[0].describe() if records else 'none'}) within {wait_s:.0f} s: rank "
                f"{rank} compiled a graph the others do not run (a rank-dependent branch, or a "
                "graph only this rank calls). Every rank must run the same compiled code. If the "
                "other ranks loaded this graph from a compile cache this rank lacks (a warm cache "
                "on some hosts only), give every rank the same cache or none; to skip this check, "
                "pass options={'check_schedule': False}.", inspect.currentframe())
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
