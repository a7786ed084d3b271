"""A machine's parameters for the cost model (ClusterSpec): its links, compute rates and memory,
measured by `graphshard calibrate` or taken from a datasheet (graphshard/compiler/clusters.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from graphshard.compiler.elementwise_cost import ARITH, FAMILIES

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class ClusterSpec:
    """Parameters of one machine class; times in seconds, sizes in bytes.

    latency_s and bandwidth_Bps describe a collective among devices of one node; a collective
    whose group spans nodes pays the inter-node ones (`link`). Optional fields describe what
    the planner needs beyond one node: None means "as within a node" / unknown.
    """

    latency_s: float  # alpha: fixed cost of one collective call
    bandwidth_Bps: float  # 1/beta: link bandwidth each rank sends at
    flops_per_s: float  # compute peak (fp32)
    memory_bandwidth_Bps: float  # for memory-bound ops
    kernel_overhead_s: float = 2e-6  # fixed cost of every compute node (dispatch, launch)
    low_precision_flops_per_s: float | None = None  # bf16/fp16 matmul peak (None: flops_per_s)
    float8_flops_per_s: float | None = None  # float8 matmul peak (None: the bf16/fp16 one)
    devices_per_node: int | None = None  # None: every device in one node
    inter_node_latency_s: float | None = None
    inter_node_bandwidth_Bps: float | None = None  # per device, between nodes
    device_memory_bytes: float | None = None  # what one device holds (the planner's limit)
    # Host time of one forward+backward beyond its kernels (Dynamo guards, autograd, hooks,
    # runtime wrappers): hidden behind a GPU's queue, paid in full where the host computes.
    step_overhead_s: float = 0.0
    # Whether a collective runs beside compute. False where the ranks' compute already fills
    # every core, so the collective library's threads take turns with it (gloo on this CPU).
    comm_overlaps_compute: bool = True
    # The process group backend: on "gloo" graphshard runs all-gather and reduce-scatter as
    # all-to-all (GraphshardOptions.via_all_to_all), whose buffers the planner then counts.
    collective_backend: str = "nccl"
    # How many ranks of one node compute at full speed at once: None where each rank has a device
    # of its own (GPUs); on a CPU, its cores / the threads each rank uses. More ranks than that
    # share the compute (`shared_by`).
    compute_slots_per_node: int | None = None
    # all-reduce's alpha and bandwidth where they differ from the all-gather's (gloo runs its
    # own algorithm for it); None: the all-gather's, on all-reduce's twice the wire bytes.
    all_reduce_latency_s: float | None = None
    all_reduce_bandwidth_Bps: float | None = None
    # Ranks drift apart while they compute (OS jitter, cores shared with the collective
    # library), so a collective starts when the slowest rank reaches it: the expected wait
    # after 1 ms of compute since the ranks last met in a collective. It grows as the square
    # root of that compute (a random walk; `calibrate` fits it on three compute lengths).
    skew_after_1ms_s: float = 0.0
    # The same where the ranks outnumber the node's compute slots and take turns on its cores
    # (a rank off its core holds up every other at the next collective); None: as above.
    shared_core_skew_after_1ms_s: float | None = None
    # Attention kernels' FLOP rates where they are not the matmuls' (a CPU's fused attention
    # runs below its matmul peak, the more so the less work per head and in bf16): rows of
    # (sequence x head_dim, fp32 FLOP/s, bf16/fp16 FLOP/s), interpolated in between; empty:
    # the matmul peak of the precision.
    attention_flops: tuple[tuple[float, float, float], ...] = ()
    # Seconds one evaluation of an elementwise op takes in a fused kernel, by op family
    # (elementwise_cost.FAMILIES, and "arith" for the rest): rows of (family, seconds). Where a
    # family has a row, an elementwise node costs at least its evaluations at that rate
    # (elementwise_cost.kernel_evaluations); empty: the roofline alone.
    elementwise_s: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        known = (*FAMILIES, ARITH)
        try:
            rows = tuple(sorted((name, float(seconds)) for name, seconds in self.elementwise_s
                                if not isinstance(seconds, bool)))
        except (TypeError, ValueError):
            rows = ()
        names = [name for name, _ in rows]
        if (len(rows) != len(self.elementwise_s) or len(set(names)) != len(names)
                or any(name not in known or not (math.isfinite(s) and s > 0) for name, s in rows)):
            raise ValueError(f"ClusterSpec.elementwise_s must be rows of (family, seconds > 0), "
                             f"one per family, of {known}; got {self.elementwise_s!r}")
        object.__setattr__(self, "elementwise_s", rows)
        rows = tuple(tuple(float(v) for v in row) for row in self.attention_flops)
        if any(len(row) != 3 or min(row) <= 0 or not all(map(math.isfinite, row)) for row in rows):
            raise ValueError("ClusterSpec.attention_flops must be rows of (sequence x head_dim, "
                             f"fp32 FLOP/s, bf16 FLOP/s), all > 0, got {self.attention_flops!r}")
        object.__setattr__(self, "attention_flops", tuple(sorted(rows)))
        if not isinstance(self.comm_overlaps_compute, bool):
            raise ValueError(f"ClusterSpec.comm_overlaps_compute must be a bool, got "
                             f"{self.comm_overlaps_compute!r}")
        if self.collective_backend not in ("nccl", "gloo"):
            raise ValueError(f"ClusterSpec.collective_backend must be 'nccl' or 'gloo', got "
                             f"{self.collective_backend!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (f.name in ("comm_overlaps_compute", "collective_backend", "attention_flops",
                           "elementwise_s")
                    or (value is None and f.default is None)):
                continue
            # 0 is a meaningful idealisation for the fixed costs, never for a rate we divide by.
            may_be_zero = f.name in ("latency_s", "kernel_overhead_s", "inter_node_latency_s",
                                     "step_overhead_s", "all_reduce_latency_s", "skew_after_1ms_s",
                                     "shared_core_skew_after_1ms_s")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0 or (value == 0 and not may_be_zero)):
                need = "a finite number >= 0" if may_be_zero else "a finite number > 0"
                raise ValueError(f"ClusterSpec.{f.name} must be {need}, got {value!r}")

    def link(self, spans_nodes: bool) -> "ClusterSpec":
        """This spec as a collective sees it: between nodes, the inter-node latency/bandwidth."""
        if not spans_nodes or self.inter_node_bandwidth_Bps is None:
            return self
        latency = self.latency_s if self.inter_node_latency_s is None else self.inter_node_latency_s
        return dataclasses.replace(self, latency_s=latency, bandwidth_Bps=self.inter_node_bandwidth_Bps,
                                   all_reduce_latency_s=None, all_reduce_bandwidth_Bps=None)

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency_s, bandwidth_Bps) of a collective of `kind`."""
        if kind == "all_reduce" and self.all_reduce_bandwidth_Bps is not None:
            latency = self.latency_s if self.all_reduce_latency_s is None else self.all_reduce_latency_s
            return latency, self.all_reduce_bandwidth_Bps
        return self.latency_s, self.bandwidth_Bps

    def skew_wait_s(self, compute_s: float) -> float:
        """The expected wait for the slowest rank at a collective after `compute_s` seconds of
        compute since the ranks last met."""
        return self.skew_after_1ms_s * math.sqrt(max(compute_s, 0.0) / 1e-3)

    def shared_by(self, ranks_per_node: int) -> "ClusterSpec":
        """This spec as each of `ranks_per_node` ranks on one node sees it: where they outnumber
        the node's compute slots (CPU cores), they take turns on them, so everything a rank
        does there runs proportionally slower (3 ranks on 2 cores: 1.5x): compute, memory
        traffic, host overhead, and the collectives within the node, which on a CPU are copies
        the same cores make; and the ranks drift apart by the shared cores' skew."""
        slots = self.compute_slots_per_node
        if slots is None or ranks_per_node <= slots:
            return self
        share = ranks_per_node / slots
        low, float8 = self.low_precision_flops_per_s, self.float8_flops_per_s
        ar_latency, ar_bandwidth = self.all_reduce_latency_s, self.all_reduce_bandwidth_Bps
        return dataclasses.replace(
            self, flops_per_s=self.flops_per_s / share,
            low_precision_flops_per_s=None if low is None else low / share,
            float8_flops_per_s=None if float8 is None else float8 / share,
            attention_flops=tuple((size, fp32 / share, low / share)
                                  for size, fp32, low in self.attention_flops),
            all_reduce_latency_s=None if ar_latency is None else ar_latency * share,
            all_reduce_bandwidth_Bps=None if ar_bandwidth is None else ar_bandwidth / share,
            skew_after_1ms_s=(self.skew_after_1ms_s if self.shared_core_skew_after_1ms_s is None
                              else self.shared_core_skew_after_1ms_s),
            memory_bandwidth_Bps=self.memory_bandwidth_Bps / share,
            elementwise_s=tuple((name, seconds * share) for name, seconds in self.elementwise_s),
            latency_s=self.latency_s * share, bandwidth_Bps=self.bandwidth_Bps / share,
            kernel_overhead_s=self.kernel_overhead_s * share,
            step_overhead_s=self.step_overhead_s * share)

    def peak_flops(self, dtype: torch.dtype | None, attention_size: float | None = None) -> float:
        """The matmul peak for operands of `dtype` (float8: the float8 peak where the
        machine has one, else the bf16 one); for an attention kernel of `attention_size`
        (sequence x head_dim), the attention rate where the machine has one."""
        low_precision = dtype in (torch.bfloat16, torch.float16, *FLOAT8_DTYPES)
        if attention_size is not None and self.attention_flops:
            return self._attention_rate(attention_size, 2 if low_precision else 1)
        if dtype in FLOAT8_DTYPES and self.float8_flops_per_s:
            return self.float8_flops_per_s
        low = low_precision and self.low_precision_flops_per_s
        return self.low_precision_flops_per_s if low else self.flops_per_s

    def _attention_rate(self, size: float, column: int) -> float:
        """attention_flops' rate at `size`, linear in log(size) between rows, the end rows'
        beyond them."""
        rows = self.attention_flops
        if size <= rows[0][0]:
            return rows[0][column]
        for low, high in zip(rows, rows[1:]):
            if size <= high[0]:
                t = math.log(size / low[0]) / math.log(high[0] / low[0])
                return low[column] + t * (high[column] - low[column])
        return rows[-1][column]

    @classmethod
    def default(cls) -> "ClusterSpec":
        """This machine class: gloo on 2 CPU cores, world size 2.

        alpha/beta are fitted exactly through two measured all-gathers (1 KiB: 0.36 ms,
        4 MiB: 3 ms); compute is a 1024x1024 fp32 matmul (1.3e11-3e11 FLOP/s measured, rounded
        down because the model's smaller matmuls run slower) and a 64 MiB copy (~2.7e10 B/s).
        """
        from graphshard.compiler.cost_model import fit_alpha_beta  # fitted by the cost model's formulas

        alpha, bandwidth = fit_alpha_beta([(1024, 0.36e-3), (4 << 20, 3e-3)], world_size=2)
        return cls(latency_s=alpha, bandwidth_Bps=bandwidth, flops_per_s=1e11,
                   memory_bandwidth_Bps=2e10, kernel_overhead_s=2e-6)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(dataclasses.asdict(self), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ClusterSpec":
        """From a dict, a JSON file path, or JSON text (a string starting with '{')."""
        if isinstance(source, Mapping):
            data = dict(source)
        elif isinstance(source, str) and source.lstrip().startswith("{"):
            data = json.loads(source)
        else:
            with open(source) as f:
                data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"ClusterSpec JSON must be an object, got {type(data).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"unknown ClusterSpec key(s) {unknown}; valid keys: {valid}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"ClusterSpec JSON is missing {missing}; valid keys: {valid}")
        return cls(**data)
