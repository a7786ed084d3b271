"""The planner's search space: the layouts (each needs its own capture) and the option sets
(only the passes and the estimate run again)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence


class PlanError(Exception):
    """Bad input: one line for the user."""


@dataclass(frozen=True)
class Layout:
    """What needs its own capture."""

    strategy: str  # "full_shard", "hybrid_shard" or "no_shard" (DDP's layout)
    # ranks per shard group: all data-parallel ranks for full_shard, 1 for no_shard
    shard_size: int
    ac: str  # activation checkpointing: "none", "full", "selective"
    # "bfloat16" (fp32 reduction), "float32", or "float8": torchao's float8 training of the
    # Linears it can convert, their weights gathered in float8, the rest bfloat16
    param_dtype: str
    micro_batch: int  # per data-parallel rank (its TP ranks share it)
    tp: int = 1  # tensor-parallel degree, within a node; shard_size counts data-parallel ranks

    @property
    def replicated(self) -> bool:
        """no_shard: every parameter (its TP piece) whole on each device, nothing gathered."""
        return self.strategy == "no_shard"


@dataclass(frozen=True)
class Knobs:
    """What only re-runs the passes and the estimate."""

    keep: str  # units kept gathered for backward: "last" (the default's tail), "all", "auto"
    prefetch: int
    bucket_mb: float


KNOBS = tuple(Knobs(keep, prefetch, bucket) for keep in ("last", "all")
              for prefetch, bucket in ((1, 64.0), (2, 64.0), (1, 25.0)))


def knobs_for(layout: Layout, knobs: Sequence[Knobs]) -> tuple[Knobs, ...]:
    """The option sets that differ on `layout`: no_shard gathers nothing, so which units stay
    gathered and how far ahead they are gathered change nothing there; only the size of its
    gradient buckets does (one option set per bucket size: the first that names it)."""
    if not layout.replicated:
        return tuple(knobs)
    by_bucket: dict[float, Knobs] = {}
    for knob in knobs:
        by_bucket.setdefault(knob.bucket_mb, Knobs("last", knob.prefetch, knob.bucket_mb))
    return tuple(by_bucket.values())


def shard_group_sizes(devices: int, devices_per_node: int | None) -> list[int]:
    """Hybrid shard-group sizes: divisors of the device count made of whole nodes (one node or
    several), short of all devices (that is full_shard)."""
    node = devices_per_node or devices
    return [s for s in range(node, devices, node) if devices % s == 0]


def micro_batches(local_batch: int) -> list[int]:
    """The local batch, its half and 1 (those that divide it): fewer, larger micro-batches run
    faster; smaller ones hold fewer activations."""
    return sorted({m for m in (local_batch, local_batch // 2, 1) if m >= 1 and local_batch % m == 0},
                  reverse=True)


TP_DEGREES = (1, 2, 4, 8)
STRATEGIES = ("full_shard", "hybrid_shard", "no_shard")


def tp_degrees(devices: int, devices_per_node: int | None, global_batch: int,
               wanted: Sequence[int] = TP_DEGREES) -> list[int]:
    """The TP degrees that fit: within a node, dividing the devices, and leaving a
    data-parallel size (devices / tp) that divides the global batch."""
    node = devices_per_node or devices
    return [tp for tp in wanted if tp <= node and node % tp == 0 and devices % tp == 0
            and global_batch % (devices // tp) == 0]


def rank_batch(global_batch: int, devices: int, tp: int) -> int:
    """What one data-parallel rank (a TP group of tp devices) trains per step."""
    return global_batch // (devices // tp)


def layouts(devices: int, devices_per_node: int | None, global_batch: int,
            ac_modes: Sequence[str], dtypes: Sequence[str],
            tp_sizes: Sequence[int] = (1,), strategies: Sequence[str] = STRATEGIES) -> list[Layout]:
    node = devices_per_node or devices
    found = []
    for tp in tp_sizes:
        data_parallel = devices // tp
        shard_groups = [("full_shard", data_parallel)] + [
            ("hybrid_shard", s) for s in shard_group_sizes(data_parallel, node // tp)]
        if data_parallel > 1:  # one data-parallel rank: no_shard is full_shard
            shard_groups.append(("no_shard", 1))
        found += [Layout(strategy, size, ac, dtype, micro, tp)
                  for (strategy, size), ac, dtype, micro in itertools.product(
                      shard_groups, ac_modes, dtypes,
                      micro_batches(rank_batch(global_batch, devices, tp)))
                  if strategy in strategies]
    return found
