"""Analysis: shard and capture a workload on a fake process group, then describe its final
graphs: every collective, communication against theory, and the cost model's estimates."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from graphshard.compiler.host_compile import compile_sharing
from graphshard.passes import meta_keys
from graphshard.tools.dump.capture import capture
from graphshard.tools.dump.loading import DumpError, Workload, sharded_on_fake_cluster
from graphshard.tools.dump.report import (KINDS, CollectiveRecord, CommKind, CommSummary,
                                          DumpReport, Estimate, FinalGraphs, GraphSummary,
                                          MemorySummary, ParamEntry, ParamsSummary, Timing,
                                          human_bytes)


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: Any
    numel: int
    local_numel: int
    requires_grad: bool
    sharded: bool
    gather_dtype: Any
    reduce_dtype: Any
    shard_group: str  # the group its gradient is first reduced over

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype.itemsize


def param_infos(model) -> dict[str, ParamInfo]:
    """Every distinct sharded parameter of `model`, by the name graphshard's ops carry."""
    from graphshard.state import sharded_params

    infos: dict[str, ParamInfo] = {}
    for param, spec in sharded_params(model):
        compute = spec.compute_dtype or param.dtype
        # What graphshard gathers: the whole parameter, or this rank's TP piece of it.
        local = param.to_local()
        shape = (spec.full_dim0, *local.shape[1:]) if local.dim() else ()
        infos[spec.name] = ParamInfo(
            spec.name, shape, param.dtype, math.prod(shape),
            param.to_local().numel(), param.requires_grad, bool(spec.gather_group),
            spec.float8_dtype or compute, spec.reduce_dtype or compute, spec.reduce_groups[0])
    return infos


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _first_consumer(wait, index: dict, cluster):
    """The earliest node that does work with a collective's result, looking through free ops
    (views, getitem: e.g. a bucket unpacked into its parameters); the output node if none."""
    from graphshard.compiler.cost_model import node_cost

    best, frontier, seen = None, list(wait.users), set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node_cost(node, cluster).seconds == 0:
            frontier.extend(node.users)
        elif best is None or index[node] < index[best]:
            best = node
    return best


def collective_records(kind: str, gm, estimate, infos: dict[str, ParamInfo],
                       cluster) -> list[CollectiveRecord]:
    """One record per collective of `gm` (`kind`: forward/backward), in graph order;
    `estimate` is the cost model's GraphEstimate of `gm`."""
    from graphshard.compiler.cost_model import wire_bytes
    from graphshard.passes.graph_utils import (collective_group, collective_kind, full_buffer,
                                               is_collective, is_wait, tensor_val,
                                               unsharded_bytes)

    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    simulated = {c.name: c for c in estimate.collectives}
    # Running tallies, so each collective's neighbourhood is O(1) to describe.
    last_compute: list[str | None] = []  # name of the last compute node before index i
    computes_before: list[int] = []  # compute nodes before index i
    last, count = None, 0
    for node in nodes:
        last_compute.append(last)
        computes_before.append(count)
        if node.op == "call_function" and not is_collective(node) and not is_wait(node):
            last, count = node.name, count + 1

    records = []
    for node in nodes:
        if not is_collective(node):
            continue
        op = collective_kind(node)
        buffer = tensor_val(full_buffer(node))
        buffer_bytes = unsharded_bytes(node)
        dtype = node.meta.get(meta_keys.PAYLOAD_DTYPE, buffer.dtype if buffer is not None else None)
        names = list(node.meta.get(meta_keys.PARAMS, ()))
        group_name, _ = collective_group(node)
        known = [infos[n] for n in names if n in infos]
        replica_reduce = op == "all_reduce" and known and group_name != known[0].shard_group
        scale = node.meta.get(meta_keys.ROLE) == "float8_scale"  # one number per weight
        if known and dtype is not None and not replica_reduce and not scale:
            nbytes = sum(p.numel for p in known) * dtype.itemsize
        else:
            nbytes = buffer_bytes
        waits = sorted((u for u in node.users if is_wait(u)), key=index.__getitem__)
        wait = waits[0] if waits else None
        consumer = _first_consumer(wait, index, cluster) if wait is not None else None
        sim = simulated.get(node.name)
        group_size = sim.group_size if sim else 0
        records.append(CollectiveRecord(
            graph=kind,
            name=node.name,
            op=op,
            params=names,
            purpose="fsdp" if meta_keys.ROLE in node.meta else "tensor_parallel",
            group=group_name,
            bytes=int(nbytes),
            buffer_bytes=buffer_bytes,
            wire_bytes=float(wire_bytes(op, buffer_bytes, group_size)) if group_size else 0.0,
            dtype=dtype_name(dtype) if dtype is not None else None,
            group_size=group_size,
            start=index[node],
            wait=index[wait] if wait is not None else None,
            issued_after=last_compute[index[node]],
            needed_by=consumer.name if consumer is not None else None,
            overlaps=computes_before[index[wait]] - computes_before[index[node]]
            if wait is not None else 0,
            issue_s=sim.issue_s if sim else 0.0,
            start_s=sim.start_s if sim else 0.0,
            duration_s=sim.dur_s if sim else 0.0,
            hidden_s=sim.hidden_s if sim else 0.0,
            exposed_s=sim.exposed_s if sim else 0.0,
        ))
    return records


def comm_summary(records: list[CollectiveRecord], infos: dict[str, ParamInfo], strategy: str,
                 world_size: int, shard_size: int, has_backward: bool = True,
                 kept_from_forward: frozenset[str] = frozenset()) -> CommSummary:
    """Measured bytes per kind beside theoretical_comm_bytes, with reasons for differences
    (`kept_from_forward`: the parameters whose gathered weights forward saves for backward)."""
    import sympy

    from graphshard.tools.theory import theoretical_comm_bytes

    gather_bytes = sum(p.numel * p.gather_dtype.itemsize for p in infos.values())
    trainable_bytes = sum(p.numel * p.reduce_dtype.itemsize for p in infos.values()
                          if p.requires_grad)
    extra = {"shard_size": shard_size} if strategy == "hybrid_shard" else {}
    theory = theoretical_comm_bytes(strategy, gather_bytes, world_size,
                                    trainable_bytes=trainable_bytes, **extra)
    P, T, N, S = sympy.symbols("P T N S", positive=True)
    formulas = theoretical_comm_bytes(strategy, P, N, trainable_bytes=T,
                                      **({"shard_size": S} if extra else {}))
    def kind_summary(chosen: list[CollectiveRecord], theory_bytes: float, formula: str):
        wire = sum(r.wire_bytes for r in chosen)
        return CommKind(count=len(chosen), bytes=sum(r.bytes for r in chosen),
                        buffer_bytes=sum(r.buffer_bytes for r in chosen), wire_bytes=wire,
                        theory_wire_bytes=theory_bytes, theory_formula=formula,
                        difference=wire - theory_bytes)

    ours = [r for r in records if r.purpose == "fsdp"]
    by_kind = {kind: kind_summary([r for r in ours if kind == "total" or r.op == kind],
                                  float(theory[kind]), str(formulas[kind]))
               for kind in (*KINDS, "total")}
    tp_records = [r for r in records if r.purpose == "tensor_parallel"]
    if tp_records:
        moved = float(sum(r.wire_bytes for r in tp_records))
        by_kind["tensor_parallel"] = kind_summary(tp_records, moved, "TP plan's")
    symbols = {"P": gather_bytes, "T": trainable_bytes, "N": world_size,
               **({"S": shard_size} if extra else {})}
    return CommSummary(**by_kind, symbols=symbols,
                       notes=difference_notes(records, infos, strategy, shard_size, has_backward,
                                             kept_from_forward))


def difference_notes(records: list[CollectiveRecord], infos: dict[str, ParamInfo],
                     strategy: str, shard_size: int, has_backward: bool,
                     kept_from_forward: frozenset[str] = frozenset()) -> list[str]:
    """Why the measured bytes differ from theory, named parameter by parameter."""
    if shard_size == 1 and strategy != "no_shard" or not records:
        return ["nothing to communicate (one rank per shard group)"] if not records else []
    notes = []
    if not has_backward:
        notes.append("no backward graph (nothing requires grad): the theory is a training step's")

    def gathered(graph: str) -> set[str]:
        return {n for r in records if r.graph == graph and r.op == "all_gather" for n in r.params}

    def listing(names: Sequence[str]) -> str:
        shown = ", ".join(sorted(names)[:4])
        if len(names) > 4:
            shown += f" and {len(names) - 4} more"
        size = sum(infos[n].numel * infos[n].gather_dtype.itemsize for n in names)
        return f"{shown} ({human_bytes(size)})"

    if strategy != "no_shard":
        replicated = [n for n, p in infos.items() if not p.sharded]
        if replicated:
            notes.append("not sharded (0-dim, replicated; gradient all-reduced): "
                         f"{listing(replicated)}")
        sharded = {n for n, p in infos.items() if p.sharded}
        unused = sharded - gathered("forward")
        if unused:
            notes.append(f"never gathered in forward (not used by the forward): {listing(unused)}")
        if strategy in ("full_shard", "hybrid_shard") and has_backward:
            not_regathered = (sharded - unused) - gathered("backward")
            kept = not_regathered & kept_from_forward
            if kept:
                notes.append("not re-gathered in backward (kept gathered from forward for "
                             f"backward, by reshard_after_forward): {listing(kept)}")
            if not_regathered - kept:
                notes.append("not re-gathered in backward (their values are not needed to "
                             f"compute any gradient): {listing(not_regathered - kept)}")
    scales = [r for r in records if r.op == "all_reduce" and r.params
              and all(infos[n].gather_dtype in FLOAT8_DTYPES for n in r.params if n in infos)]
    if scales:
        notes.append(f"float8 scales: {len(scales)} all-reduce(s) MAX of one number per float8 "
                     f"weight ({human_bytes(sum(r.bytes for r in scales))})")
    padding = sum(r.buffer_bytes - r.bytes for r in records if r.op != "all_reduce")
    if padding:
        notes.append(f"padding of uneven shards adds {human_bytes(padding)} of buffers "
                     "(dim 0 rounded up to a multiple of the group size)")
    return notes


def memory_summary(fw, bw, fw_graph, bw_graph, infos: dict[str, ParamInfo],
                   input_bytes: int) -> MemorySummary:
    """Per-rank peak: model state (shards, AdamW state) plus the larger of the forward's and
    the backward's peak from the cost model's liveness walk (the backward's includes the
    gradients it produces).
    fw, bw: simulator.GraphEstimate (bw None without a backward); fw_graph, bw_graph: theirs."""
    from graphshard.passes.liveness import step_memory

    param_bytes = sum(p.local_numel * p.dtype.itemsize for p in infos.values())
    grad_bytes = sum(p.local_numel * p.dtype.itemsize for p in infos.values() if p.requires_grad)
    optimizer_bytes = 2 * grad_bytes
    state = param_bytes + optimizer_bytes  # gradients: produced by backward, in its peak
    # The same step model the backend's reshard_after_forward="auto" keeps within its budget.
    step = step_memory(fw_graph, bw_graph if bw is not None else None, fw.memory,
                       bw.memory if bw is not None else None)
    return MemorySummary(
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        model_state_bytes=state,
        input_bytes=input_bytes,
        forward_peak_bytes=step.forward_peak_bytes,
        backward_saved_bytes=step.backward_saved_bytes,
        backward_peak_bytes=step.backward_peak_bytes,
        peak_graph=step.peak_graph,
        peak_node=step.peak_node,
        peak_bytes=state + input_bytes + step.transient_bytes,
    )


def estimate_summary(estimates: dict, comm: CommSummary, memory: MemorySummary,
                     cluster) -> Estimate:
    """The step's estimate from the per-graph ones (simulator.GraphEstimate by graph)."""
    graphs = estimates.values()
    return Estimate(
        comm_bytes=comm.total.wire_bytes,
        peak_memory_bytes=memory.peak_bytes,
        step_s=sum(e.total_s for e in graphs),
        exposed_comm_s=sum(e.exposed_comm_s for e in graphs),
        compute_s=sum(e.compute_s for e in graphs),
        comm_s=sum(e.comm_s for e in graphs),
        memory=memory,
        per_graph={kind: GraphSummary(e.total_s, e.compute_s, e.comm_s, e.exposed_comm_s,
                                      e.memory.peak_transient_bytes, e.memory.peak_node)
                   for kind, e in estimates.items()},
        cluster=cluster,
    )


def params_summary(infos: dict[str, ParamInfo], comm: CommSummary,
                   memory: MemorySummary) -> ParamsSummary:
    return ParamsSummary(
        count=len(infos),
        bytes=sum(p.bytes for p in infos.values()),
        trainable_bytes=sum(p.bytes for p in infos.values() if p.requires_grad),
        gather_bytes=comm.symbols["P"],
        reduce_bytes=comm.symbols["T"],
        local_bytes=memory.param_bytes,
        list=[ParamEntry(p.name, list(p.shape), dtype_name(p.dtype), p.bytes, p.requires_grad,
                         p.sharded) for p in infos.values()],
    )


# --------------------------------------------------------------------------- the dump


@dataclass
class DumpResult:
    report: DumpReport
    texts: dict[tuple[str, str], str]  # (graph, stage) -> code, for the stages asked for
    trace: dict  # Chrome trace of the simulated step


def dump(workload: Workload, *, world_size: int, strategy: str = "full_shard", options=None,
         stages: Sequence[str] = (), shard_size: int | None = None, param_dtype=None,
         reduce_dtype=None, cluster=None, tp: int = 1,
         progress: Callable[[str], None] = lambda message: None) -> DumpResult:
    """Shard and compile `workload` at `world_size` on a fake process group (one must not be
    initialised already) and describe the result. `stages`: stage names whose code to keep;
    `progress`: told what the long phases are doing (the CLI prints it to stderr)."""
    import torch.distributed as dist

    from graphshard._torch_compat import tree_leaves
    from graphshard.compiler.pipeline import PIPELINE, STAGES
    from graphshard.compiler.cost_model import ClusterSpec, value_bytes
    from graphshard.compiler.options import GraphshardOptions
    from graphshard.compiler.simulator import chrome_trace, graph_estimate
    from graphshard.policy import ShardingStrategy

    started = time.perf_counter()
    options = GraphshardOptions.from_dict(options)
    strategy = ShardingStrategy.parse(strategy).value
    cluster = cluster or ClusterSpec.default()
    if world_size < 1:
        raise DumpError(f"--world-size must be at least 1, got {world_size}")
    if strategy == "hybrid_shard":
        if shard_size is None:
            raise DumpError("strategy 'hybrid_shard' needs --shard-size S (ranks per shard group)")
        if shard_size < 1 or world_size % shard_size:
            raise DumpError(f"--shard-size {shard_size} must be >= 1 and divide "
                            f"--world-size {world_size}")
    if dist.is_initialized():
        raise DumpError("a torch.distributed process group is already initialised; "
                        "graphshard dump makes its own fake one")

    with sharded_on_fake_cluster(workload, world_size, strategy, shard_size, param_dtype,
                                 reduce_dtype, tp) as mesh:
        infos = param_infos(workload.model)
        progress(f"capturing the training step of {workload.description} at world size "
                 f"{world_size} (Dynamo, AOTAutograd, partitioning: most of the dump's time)")
        cap = capture(workload, options, stages, progress)
        captured = time.perf_counter()
        progress("estimating time and memory with the cost model")
        estimates = {kind: graph_estimate(gm, cluster, graph_kind=kind)
                     for kind, gm in cap.final.items()}
        records = [r for kind in ("forward", "backward") if kind in estimates
                   for r in collective_records(kind, cap.final[kind], estimates[kind], infos,
                                               cluster)]

    input_bytes = int(value_bytes(tree_leaves(workload.inputs)))
    fw, bw = estimates["forward"], estimates.get("backward")
    data_parallel = world_size // tp
    comm = comm_summary(records, infos, strategy, data_parallel, shard_size or data_parallel,
                        has_backward=bw is not None, kept_from_forward=cap.kept_from_forward)
    memory = memory_summary(fw, bw, cap.final["forward"], cap.final.get("backward"), infos,
                            input_bytes)
    report = DumpReport(
        target=workload.description,
        world_size=world_size,
        strategy=strategy,
        mesh=list(mesh.shape) + ([tp] if tp > 1 else []),
        options=options.to_dict(),
        stages=list(STAGES),
        stages_disabled=[st.name for st in PIPELINE if not st.enabled(options)],
        stage=STAGES[-1],
        params=params_summary(infos, comm, memory),
        collectives=records,
        comm=comm,
        estimate=estimate_summary(estimates, comm, memory, cluster),
        graphs=FinalGraphs(*(cap.texts.get((kind, STAGES[-1]))
                             for kind in ("forward", "backward"))),
        timing=Timing(capture_s=captured - started, total_s=time.perf_counter() - started,
                      stages_s=cap.seconds),
        compile=compile_sharing(options, cap.cache_bypass,
                                takes_device_mesh=cap.takes_device_mesh),
    )
    texts = {key: text for key, text in cap.texts.items() if key[1] in stages}
    # The trace's graph order is the step's: backward starts where forward ends.
    ordered = {kind: estimates[kind] for kind in ("forward", "backward") if kind in estimates}
    trace = chrome_trace(
        ordered,
        process_name=f"graphshard dump {workload.description} (rank 0 of {world_size}, simulated)",
        event_args={(r.graph, r.name): {"bytes": r.bytes, "params": r.params[:8],
                                        "hidden_us": r.hidden_s * 1e6,
                                        "exposed_us": r.exposed_s * 1e6} for r in records})
    return DumpResult(report, texts, trace)
