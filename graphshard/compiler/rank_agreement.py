"""Compile-time decisions that read rank-local sizes, made alike on every rank.

Some choices that shape the collective schedule are best judged on the memory a graph holds,
which depends on the local batch (the default's tail of forward: `keeping_costs_peak_memory`;
the scheduler's prefetch and reduction order: pipeline.py's `_agreed_order`).
Ranks given different batches (a short last batch) would judge differently and compile
different collective sequences. So the first rank to take such a decision publishes it in the
default process group's store, and every rank adopts the published one, at once, without a
collective: a rank that recompiles alone, later, with another batch, reads it too, and keeps
running the schedule the other ranks run.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Callable, Collection

import torch.distributed as dist
import torch.fx as fx

from graphshard import _torch_compat as compat
from graphshard.passes.graph_utils import is_unshard
from graphshard.passes.markers import UnshardSpec

_PREFIX = "graphshard/decision"


def decision_key(joint: fx.GraphModule, params: Collection[str], option) -> str:
    """What identifies one decision on every rank: the graph's parameters as every rank sees
    them (their model, names, full shapes, dtypes: not the batch), the parameters decided on,
    the option. Two models of one architecture decide each on its own batch."""
    gathered = sorted({(UnshardSpec.from_node(node).model, UnshardSpec.from_node(node).name,
                        tuple(node.meta["val"].shape), str(node.meta["val"].dtype))
                       for node in joint.graph.nodes if is_unshard(node) and "val" in node.meta})
    text = repr((gathered, sorted(params), repr(option)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def agreement_store():
    """The store ranks agree through: the default process group's; None in a single process
    (one rank, or a fake process group: `graphshard dump`, the planner), which decides alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    return compat.default_store()


def first_published(key: str, value: Callable[[], str]) -> str:
    """The value the first rank to reach `key` published (`value()` here, if this is that
    rank)."""
    store, name = agreement_store(), f"{_PREFIX}/{key}"
    if store is None:
        return value()
    if store.check([name]):
        return store.get(name).decode()
    # atomic: set only where no rank has published yet; returns the value that won
    return store.compare_set(name, "", value()).decode()


def first_decision(key: str, decide: Callable[[], bool]) -> bool:
    """The decision the first rank to reach `key` took (`decide()` here, if this is that rank)."""
    return first_published(key, lambda: "1" if decide() else "0") == "1"


# Set while this rank compiles a graph that other ranks of its host will load
# (host_compile.py): called before each agreement collective, so that they join it.
before_agreement_collective: Callable[[], None] | None = None
# What a rank that joins an agreement collective for another's compile contributes to the
# minimum: above any measure, so the ranks that measured decide.
NEUTRAL_MINIMUM = 2**62


def agreed_minimum(key: str, measure: Callable[[], int],
                   all_reduce_min: Callable[[int], int]) -> int:
    """The minimum over ranks of `measure()`, taken by `all_reduce_min` (a collective) at the
    first compile, where every rank compiles or joins for the compile it will load, and
    published under `key`: a rank that later recompiles alone reads it instead of joining a
    collective no other rank joins. No rank can publish before every rank has joined the
    first collective, so none reads too early."""
    store, name = agreement_store(), f"{_PREFIX}/minimum/{key}"
    if store is None:
        return measure()
    if store.check([name]):
        return int(store.get(name))
    value = measure()
    if before_agreement_collective is not None:
        before_agreement_collective()
    agreed = all_reduce_min(value)
    store.set(name, str(agreed))
    return agreed


def job_nonce() -> str | None:
    """One random value per job (the first rank's), None in a single process: what keeps a
    compile whose choice the ranks agree on by a collective ("auto") from being served by
    another job's cache entry, made without this job's collective."""
    if agreement_store() is None:
        return None
    return first_published("job", lambda: uuid.uuid4().hex)
