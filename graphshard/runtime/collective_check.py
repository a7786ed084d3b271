"""Eager collectives checked across ranks: ranks that run different code without torch.compile
get an error naming the parameter, not a hang or a silent wrong answer.

Compiled graphs are checked once, at compile time (compiler/schedule_check.py). Eagerly, each
parameter read and each gradient reduction runs its collectives as the Python code reaches
them; a rank that takes another branch issues its next collective for another parameter, and
its peers pair it with their own: equal sizes give wrong numbers without an error, different
sizes a transport error or a hang. So each eager collective goes with a tag (8 bytes per rank)
naming what this rank runs it for, gathered over the same group just before it and checked
before the collective is waited on (their latencies overlap). A tag no peer answers within the
process group's timeout (set by init_process_group) is an error naming the parameter too.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphshard import _torch_compat as compat
from graphshard.passes.graph_utils import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT

_COLLECTIVES = {ALL_GATHER: "all-gather", REDUCE_SCATTER: "reduce-scatter", ALL_REDUCE: "all-reduce"}
_PREFIX = "graphshard/eager"
NAME_WAIT_S = 10.0  # for a peer that found the mismatch too to say what it ran


class EagerCollectiveMismatchError(RuntimeError):
    """Ranks ran different eager collectives at the same place of their sequence (or one rank
    ran one that no other rank ran)."""


def _tag(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


@dataclass
class _TagExchange:
    group: str
    text: str  # what this rank runs the collective for
    gathered: torch.Tensor
    work: object  # the tag all-gather's dist.Work

    def check(self) -> None:
        ranks = compat.process_group_ranks(self.group)
        rank = dist.get_rank()
        try:
            self.work.wait()
        except RuntimeError as exc:  # the process group's timeout
            others = ", ".join(str(r) for r in ranks if r != rank)
            raise EagerCollectiveMismatchError(
                f"graphshard: rank {rank} ran {self.text} eagerly, and rank(s) {others} of its "
                "group ran no collective there within the process group's timeout: ranks run "
                "different code (a rank-dependent branch in forward, data-dependent control "
                "flow, a module used on some ranks only, a rank that stopped). Every rank must "
                "read the same parameters in the same order.") from exc
        mine = _tag(self.text)
        differing = [r for r, tag in zip(ranks, self.gathered.tolist()) if tag != mine]
        if not differing:
            return
        store = compat.default_store()
        store.set(f"{_PREFIX}/{mine}", self.text)  # for the peers, who found it too
        names = [f"{_PREFIX}/{tag}" for tag in {self.gathered.tolist()[ranks.index(r)]
                                                for r in differing}]
        try:
            store.wait(names, datetime.timedelta(seconds=NAME_WAIT_S))
            theirs = "; ".join(sorted({store.get(name).decode() for name in names}))
        except dist.DistStoreError:  # a peer that stopped before saying: its tag is all there is
            theirs = "a collective this rank never runs"
        raise EagerCollectiveMismatchError(
            f"graphshard: ranks ran different eager collectives at the same place: rank {rank} "
            f"ran {self.text}, rank(s) {differing} ran {theirs}. Run on, they would hang, abort "
            "in the transport, or pair collectives of equal size and compute wrong numbers. "
            "Every rank must run the same code: look for a rank-dependent branch in forward "
            "(`if dist.get_rank() == ...`), data-dependent control flow, or a module used on "
            "some ranks only.")


def _start_exchange(group: str, text: str, like: torch.Tensor) -> _TagExchange | None:
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return None
    pg = compat.process_group(group)
    if pg.size() == 1:
        return None
    mine = torch.tensor([_tag(text)], dtype=torch.int64, device=like.device)
    gathered = torch.empty(pg.size(), dtype=torch.int64, device=like.device)
    work = dist.all_gather_single(gathered, mine, group=pg, async_op=True)
    return _TagExchange(group, text, gathered, work)


class CheckedEagerEmitter:
    """The marker ops' eager emitter (graph_utils.EagerEmitter's contract), each collective
    tagged with `what` this rank runs it for, and checked before its wait."""

    def __init__(self, what: str):
        self.what = what
        self.pending: list[tuple[torch.Tensor, _TagExchange]] = []

    def __call__(self, op, *args, **kwargs):
        if op in _COLLECTIVES:
            # the group is every collective's last argument (lowering.py emits them so)
            exchange = _start_exchange(args[-1], f"the {_COLLECTIVES[op]} {self.what}", args[0])
            out = op(*args, **kwargs)
            if exchange is not None:
                self.pending.append((out, exchange))
            return out
        if op is WAIT:
            checked = [exchange for out, exchange in self.pending if out is args[0]]
            self.pending = [(out, exchange) for out, exchange in self.pending
                            if out is not args[0]]
            for exchange in checked:
                exchange.check()
        return op(*args, **kwargs)

    def val(self, x: torch.Tensor) -> torch.Tensor:
        return x
