"""The dump's report: typed, and its JSON (`--json FILE`) is exactly these dataclasses, field by
field, in field order (`DumpReport.to_json`). So the field comments below are the JSON schema.

Schema version 1. Sizes are bytes, times seconds, everything rank 0's. Also the text output
(`format_report`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from graphshard.compiler.cost_model import ClusterSpec

SCHEMA_VERSION = 2  # 2: memory as forward/backward own peaks, gradients out of model state

KINDS = ("all_gather", "reduce_scatter", "all_reduce")  # collective ops, in report order


@dataclass
class ParamEntry:
    name: str
    shape: list[int]
    dtype: str  # e.g. "float32"
    bytes: int  # unsharded, in `dtype`
    requires_grad: bool
    sharded: bool  # False: 0-dim, replicated on every rank


@dataclass
class ParamsSummary:
    count: int  # distinct parameters (tied ones once)
    bytes: int  # their unsharded total in the parameter dtype
    trainable_bytes: int
    gather_bytes: int  # the same in the dtype they are gathered in (mixed precision): P
    reduce_bytes: int  # trainable ones in the dtype they are reduced in: T
    local_bytes: int  # rank 0's shards
    list: list[ParamEntry]


@dataclass
class CollectiveRecord:
    """One collective of the final graphs."""
    graph: str  # "forward" | "backward"
    name: str  # FX node name
    op: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    params: list[str]  # names of the parameters in its bucket (graphshard_params meta)
    # "fsdp": a parameter's gather or a gradient's reduction, inserted by graphshard;
    # "tensor_parallel": one the model's TP plan traced into the graph (activations).
    purpose: str
    group: str  # its process group's name
    # Unsharded size of the bucket: the parameters' (gradients') bytes in the collective's
    # dtype; for an all-reduce across hybrid replicas, the shard it reduces.
    bytes: int
    buffer_bytes: int  # size of the buffer it moves (bytes + padding of uneven shards)
    wire_bytes: float  # bytes this rank sends: (N-1)/N x buffer (all-reduce: 2(N-1)/N x)
    dtype: str | None  # e.g. "float32"
    group_size: int  # ranks in its process group
    start: int  # index of the collective node in the final graph (graph.nodes order)
    wait: int | None  # index of its wait_tensor node (start < wait)
    issued_after: str | None  # name of the last compute node before it
    needed_by: str | None  # name of the first node that uses the waited result
    overlaps: int  # compute nodes between start and wait
    # Simulated: when compute reaches it, when the communication lane starts it, how long it
    # takes; and of that duration, how much is overlapped with compute (hidden) or not.
    issue_s: float
    start_s: float
    duration_s: float
    hidden_s: float
    exposed_s: float


@dataclass
class CommKind:
    """Communication of one collective op (or of all: "total") per step, beside theory."""
    count: int
    bytes: int
    buffer_bytes: int
    wire_bytes: float
    theory_wire_bytes: float
    theory_formula: str  # sympy text in N, P, T, S (see CommSummary.symbols)
    difference: float  # wire_bytes - theory_wire_bytes


@dataclass
class CommSummary:
    all_gather: CommKind
    reduce_scatter: CommKind
    all_reduce: CommKind
    total: CommKind  # of the three above: graphshard's own collectives
    # Values of the formulas' symbols: P (params.gather_bytes), T (params.reduce_bytes),
    # N (data-parallel world size), S (shard group size; hybrid_shard only).
    symbols: dict[str, int]
    notes: list[str]  # why measured and theory differ
    # The TP plan's collectives of activations (any op), beside graphshard's; their theory is
    # what they move (the model's own communication, not sharding's).
    tensor_parallel: CommKind | None = None

    def kinds(self) -> dict[str, CommKind]:
        """The collective ops, "total", and the TP plan's where there are some, in report order."""
        kinds = {kind: getattr(self, kind) for kind in (*KINDS, "total")}
        if self.tensor_parallel is not None:
            kinds["tensor_parallel"] = self.tensor_parallel
        return kinds


@dataclass
class MemorySummary:
    """Per-rank memory. A graph's own peak is the most it holds at one time beyond the model
    state and the batch: the forward's includes the activations it saves; the backward's
    starts with those, frees each after its last use, and includes the gradients it produces."""
    param_bytes: int  # rank 0's parameter shards
    grad_bytes: int  # produced by the backward: part of its peak
    optimizer_bytes: int  # AdamW: 2 x trainable shards
    model_state_bytes: int  # params + optimizer
    input_bytes: int
    forward_peak_bytes: int  # the forward's own peak (as GraphSummary.peak_transient_bytes)
    backward_saved_bytes: int  # what the backward starts with: saved activations, incoming grad
    backward_peak_bytes: int  # the backward's own peak
    peak_graph: str  # "forward" | "backward": whose own peak is the larger
    peak_node: str | None  # where that graph peaks
    peak_bytes: int  # model state + inputs + the larger own peak


@dataclass
class GraphSummary:
    """The cost model's estimate of one graph."""
    total_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    peak_transient_bytes: int  # the graph's own peak
    peak_node: str | None


@dataclass
class Estimate:
    comm_bytes: float  # wire bytes per step (comm.total.wire_bytes)
    peak_memory_bytes: int  # memory.peak_bytes
    step_s: float  # forward + backward; the optimizer is not modelled
    exposed_comm_s: float
    compute_s: float
    comm_s: float
    memory: MemorySummary
    per_graph: dict[str, GraphSummary]  # "forward", "backward" (if any)
    cluster: ClusterSpec  # the one used (in JSON: its fields)


@dataclass
class FinalGraphs:
    """The final stage's code (print_readable); None for a graph that was not compiled."""
    forward: str | None
    backward: str | None


@dataclass
class Timing:
    """This dump's own wall time."""
    capture_s: float
    total_s: float
    stages_s: dict[str, float]  # {"graph/stage": seconds}; "partitioned": AOTAutograd + partition


@dataclass
class DumpReport:
    """The `--json` document."""
    schema_version: int = field(default=SCHEMA_VERSION, init=False)
    target: str  # the TARGET string
    world_size: int  # N
    rank: int = field(default=0, init=False)  # the dump is rank 0's view
    strategy: str  # "full_shard" | "shard_grad_op" | "no_shard" | "hybrid_shard"
    mesh: list[int]  # e.g. [64], or [8, 8] (replicate, shard) for hybrid_shard
    options: dict[str, Any]  # the GraphshardOptions as given (to_dict)
    stages: list[str]  # stage names in pipeline order ("merged" first)
    stages_disabled: list[str]  # stages the options turn off (their graph is unchanged)
    stage: str  # the final stage
    params: ParamsSummary
    collectives: list[CollectiveRecord]  # in graph order, forward first
    comm: CommSummary
    estimate: Estimate
    graphs: FinalGraphs
    timing: Timing
    # "once per host", or why each rank compiles its own graphs (compiler/host_compile.py)
    compile: str = "once per host"

    def to_json(self) -> dict:
        """The JSON document `--json` writes: every field, nested dataclasses as objects."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- text output


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _params_cell(names: Sequence[str]) -> str:
    if not names:
        return "-"
    if len(names) == 1:
        return names[0]
    prefix = os.path.commonprefix([n.split(".") for n in names])
    if prefix:
        return f"{'.'.join(prefix)}.* ({len(names)})"
    return f"{names[0]} +{len(names) - 1}"


def format_report(report: DumpReport, texts: dict[tuple[str, str], str],
                  stages: Sequence[str]) -> str:
    """The text output: the code of `stages` (from `texts`: (graph, stage) -> code), then the
    collectives, communication against theory and the estimate."""
    from tabulate import tabulate

    r, human = report, human_bytes
    est, comm, mem = r.estimate, r.comm, r.estimate.memory
    out = [
        f"graphshard dump {r.target}: world size {r.world_size} (fake process group; "
        f"everything below is rank 0's view), strategy {r.strategy}, mesh {r.mesh}",
        "options: " + ", ".join(f"{k}={v}" for k, v in r.options.items()),
        f"parameters: {r.params.count} ({human(r.params.bytes)} unsharded, "
        f"{human(r.params.trainable_bytes)} trainable; "
        f"{human(r.params.local_bytes)} on rank 0)",
        f"compile: {r.compile}",
        "",
    ]
    for stage in r.stages:
        if stage not in stages:
            continue
        for kind in ("dynamo", "joint", "forward", "backward"):
            text = texts.get((kind, stage))
            if text is not None:
                off = " (off in these options: unchanged)" if stage in r.stages_disabled else ""
                out += [f"==== {kind} graph after stage {stage!r}{off} ====", text.rstrip(), ""]

    rows = [(i, {"forward": "fwd", "backward": "bwd"}[c.graph], c.op,
             _params_cell(c.params) if c.purpose == "fsdp" else "(TP: activations)",
             human(c.bytes), c.dtype, f"{c.start}->{c.wait}", c.overlaps, c.needed_by,
             f"{c.hidden_s * 1e3:.3f}", f"{c.exposed_s * 1e3:.3f}")
            for i, c in enumerate(r.collectives)]
    out += [f"==== collectives ({len(rows)}; start->wait: node indices in the final graph, "
            "overlaps: compute nodes between them) ====",
            tabulate(rows, headers=["#", "graph", "op", "params", "bytes", "dtype", "start->wait",
                                    "overlaps", "needed by", "hidden ms", "exposed ms"]),
            ""]

    symbols = ", ".join(f"{k}={human(v) if k in 'PT' else v}" for k, v in comm.symbols.items())
    rows = [(kind, c.count, human(c.bytes), human(c.wire_bytes), c.theory_formula,
             human(c.theory_wire_bytes), human(c.difference))
            for kind, c in comm.kinds().items()
            if kind == "total" or c.count or c.theory_wire_bytes]
    out += [f"==== communication per step, per rank ({symbols}) ====",
            tabulate(rows, headers=["", "count", "unsharded", "on the wire", "theory (formula)",
                                    "theory", "difference"]),
            *[f"  - {note}" for note in comm.notes], ""]

    rows = [(kind, f"{g.total_s * 1e3:.2f}", f"{g.compute_s * 1e3:.2f}",
             f"{g.comm_s * 1e3:.2f}", f"{g.exposed_comm_s * 1e3:.2f}",
             human(g.peak_transient_bytes)) for kind, g in est.per_graph.items()]
    rows.append(("step", f"{est.step_s * 1e3:.2f}", f"{est.compute_s * 1e3:.2f}",
                 f"{est.comm_s * 1e3:.2f}", f"{est.exposed_comm_s * 1e3:.2f}", ""))
    cluster = est.cluster
    if mem.peak_graph == "backward":
        working_set = (f"backward: its own peak {human(mem.backward_peak_bytes)} (it starts "
                       f"with {human(mem.backward_saved_bytes)} of saved activations and "
                       f"produces {human(mem.grad_bytes)} of gradients)")
    else:
        working_set = f"forward: its own peak {human(mem.forward_peak_bytes)}"
    out += [f"==== estimate (cost model: alpha {cluster.latency_s * 1e6:.0f} us, "
            f"{human(cluster.bandwidth_Bps)}/s, {cluster.flops_per_s:.3g} FLOP/s) ====",
            tabulate(rows, headers=["", "time ms", "compute ms", "comm ms", "exposed comm ms",
                                    "own peak"]),
            "  own peak: the most a graph holds at one time beyond the model state and the batch "
            "(the forward's includes the activations it saves; the backward starts with those, "
            "frees each after its last use and produces the gradients)",
            f"peak memory per rank: {human(mem.peak_bytes)} = model state "
            f"{human(mem.model_state_bytes)} (params {human(mem.param_bytes)}, AdamW "
            f"{human(mem.optimizer_bytes)}) + inputs "
            f"{human(mem.input_bytes)} + {working_set} (at {mem.peak_node})",
            f"dump took {r.timing.total_s:.1f} s (capture {r.timing.capture_s:.1f} s)"]
    return "\n".join(out)
