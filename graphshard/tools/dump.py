"""`graphshard dump`: what the compiler does to a model, at any world size, on one laptop.

    graphshard dump TARGET [--world-size N] [--strategy S] [--shard-size S] [--stage STAGE]
                           [--option KEY=VALUE ...] [--param-dtype D] [--reduce-dtype D]
                           [--batch B] [--seq L] [--model-args K=V,...] [--no-meta]
                           [--cluster FILE] [--json FILE] [--trace FILE] [--quiet]

    graphshard dump llama3-8b --world-size 64 --param-dtype bf16 --trace step.json
    graphshard dump my_pkg.models:make_model -n 16 --option bucket_mb=25 --json dump.json

TARGET is a built-in model name (`graphshard.tools.models.BUILTIN_MODELS`: transformer,
transformer-large, llama, llama3-8b), or `package.module:factory`, or `path/to/file.py:factory`.
A factory returns `(model, example_inputs)` or `(model, example_inputs, loss_fn)`; `--batch`,
`--seq` and `--model-args` become its keyword arguments (built-ins: batch=1, seq_len=128 unless
given). `--stage` prints the FX graphs of a stage of `backend.STAGES` (merged: the Dynamo graph;
tagged: the joint graph; partitioned, lowered, bucketed, scheduled, transport: the forward and
backward graphs), or of `all`; default `none`: the summary only. Dtypes are
spelled either way (bf16 or bfloat16, fp16 or float16, fp32 or float32). Progress of the long
phases (capture, passes, estimate) goes to stderr, unless `--quiet`. Bad input exits with status
2 and one line on stderr; a model that fails to compile, with status 1.

How it works. One process, a fake process group of world size N, and rank 0's view of it. The
factory runs under `torch.device("meta")` (unless `--no-meta`), so nothing is allocated; every
parameter, buffer and input then becomes a FakeTensor on the CPU, the model is sharded with
`graphshard.shard`, and the step is compiled by the very backend `torch.compile(model,
backend="graphshard")` uses (`GraphshardCompiler`, options as given) with an observer that
records every stage of `backend.PIPELINE`. Inductor itself is not run: it consumes the final
stage's graph unchanged. The backward graph is compiled eagerly together with the forward, and
the capture stops once it has been recorded, so no graph is ever executed: a Llama-3-8B-shaped
model dumps at world size 64 without its 32 GB of weights. (The loss runs outside the compiled
region under torch.compile, and the backward graph takes the gradient of every differentiable
output as an input, so the loss changes neither graph: a factory's loss_fn is only checked to be
callable, and a factory without one, whose loss would be a plain reduction of the output, gets
the very same graphs.)

Cost: almost all of it is Dynamo + AOTAutograd + partitioning (JSON `timing.stages_s`). The
Llama-3-8B shape (32 blocks, dim 4096; batch 1, seq 128) at world size 64 takes 51 s of CPU
time (user + sys) and 0.6 GB of memory on the 2-core development machine: its wall time when
the machine is otherwise idle; measured 68 s wall at load average 5.

Output: the graphs of the stage(s) asked for with `--stage`, as code; a table of every
collective, communication bytes per step beside the theory for the strategy (as formulas in N
and as numbers), and the cost model's estimates (`graphshard.compiler.cost_model`: alpha-beta
collectives, roofline compute, a two-lane simulation of each graph in node order) of per-rank
memory, step time and exposed communication. Memory: a graph's "own peak" is the most it
allocates at one time beyond its inputs (for the forward, including the activations it saves);
the backward also holds those saved activations, as inputs: its working set is saved activations
+ its own peak. The per-rank peak is model state + inputs + the larger working set.

JSON schema (`--json FILE`; version 1). Sizes are bytes, times seconds, everything rank 0's.

    schema_version   1
    target           the TARGET string
    world_size       N
    rank             0
    strategy         "full_shard" | "shard_grad_op" | "no_shard" | "hybrid_shard"
    mesh             mesh shape, e.g. [64] or [8, 8] (replicate, shard) for hybrid_shard
    options          the GraphshardOptions as given (to_dict)
    stages           stage names in pipeline order ("merged" first); `stage`: the final one;
                     stages_disabled: those the options turn off (their graph is unchanged)
    params           count: distinct parameters (tied ones once); bytes: their unsharded total
                     in the parameter dtype; trainable_bytes; gather_bytes / reduce_bytes: the
                     same in the dtypes they are gathered / reduced in (mixed precision);
                     local_bytes: rank 0's shards; list: [{name, shape, dtype, bytes,
                     requires_grad, sharded}]
    collectives      one object per collective in the final graphs, in graph order:
        graph        "forward" | "backward"
        name         FX node name
        op           "all_gather" | "reduce_scatter" | "all_reduce"
        params       names of the parameters in its bucket (graphshard_params meta)
        bytes        unsharded size of the bucket: the parameters' (gradients') bytes in the
                     collective's dtype; for an all-reduce across hybrid replicas, the shard it
                     reduces
        buffer_bytes size of the buffer the collective moves (bytes + padding of uneven shards)
        wire_bytes   bytes this rank sends for it: (N-1)/N x buffer (all-reduce: 2(N-1)/N x)
        dtype        e.g. "float32"
        group_size   ranks in its process group
        start        index of the collective node in the final graph (graph.nodes order)
        wait         index of its wait_tensor node (start < wait)
        issued_after name of the last compute node before it (null if none)
        needed_by    name of the first node that uses the waited result (null if none)
        overlaps     compute nodes between start and wait
        issue_s, start_s, duration_s   simulated: when compute reaches it, when the
                     communication lane starts it, how long it takes
        hidden_s, exposed_s            of duration_s: overlapped with compute / not
    comm             per kind ("all_gather", "reduce_scatter", "all_reduce", "total"):
                     {count, bytes, buffer_bytes, wire_bytes, theory_wire_bytes,
                     theory_formula (sympy text in N, P, T, S), difference}; symbols: values of
                     P (gather_bytes), T (reduce bytes of trainable parameters), S (shard group
                     size); notes: why measured and theory differ
    estimate         comm_bytes: wire bytes per step (total above); peak_memory_bytes; step_s
                     (forward + backward; optimizer not modelled); exposed_comm_s; compute_s;
                     comm_s; memory: {param_bytes, grad_bytes, optimizer_bytes (AdamW: 2 x
                     trainable shards), model_state_bytes, input_bytes, forward_transient_bytes,
                     backward_saved_bytes, backward_transient_bytes, peak_graph, peak_node}
                     (forward_transient_bytes and backward_transient_bytes are each graph's own
                     peak, as per_graph below; the backward's working set adds
                     backward_saved_bytes); per_graph: {forward|backward: {total_s, compute_s,
                     comm_s, exposed_comm_s, peak_transient_bytes (the graph's own peak),
                     peak_node}}; cluster: the ClusterSpec used
    graphs           forward, backward: the final stage's code (print_readable)
    timing           capture_s, total_s: this dump's own wall time; stages_s:
                     {"graph/stage": seconds}, "partitioned" being AOTAutograd + partition

`--trace FILE` writes a Chrome trace (chrome://tracing, https://ui.perfetto.dev) of the simulated
step: thread 0 is compute (one event per node, and "wait" events where compute is blocked on a
collective), thread 1 is communication (one event per collective); backward follows forward.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

USAGE_ERROR = 2  # bad input: one line on stderr
COMPILE_ERROR = 1  # the model itself failed to compile


class DumpError(Exception):
    """Bad input: reported as one line, exit status 2."""


# --------------------------------------------------------------------------- target loading


@dataclass
class Workload:
    model: Any
    inputs: tuple
    loss_fn: Callable | None
    description: str


def _import_factory(target: str) -> Callable:
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise DumpError(f"target {target!r} must be module:factory or path/to/file.py:factory")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise DumpError(f"cannot import {target!r}: no such file {module_name!r}")
        name = f"_graphshard_dump_target_{abs(hash(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up here
        sys.path.insert(0, os.path.dirname(path))  # so the file can import its neighbours
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise DumpError(f"cannot import {module_name!r}: {_one_line(e)}") from e
        finally:
            sys.path.remove(os.path.dirname(path))
    else:
        added = os.getcwd() not in sys.path  # as `python -m` does, so local packages resolve
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise DumpError(f"cannot import {module_name!r}: {_one_line(e)}") from e
        finally:
            if added:
                sys.path.remove(os.getcwd())
    if not hasattr(module, attr):
        raise DumpError(f"cannot import {target!r}: module {module_name!r} has no attribute "
                        f"{attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise DumpError(f"target {target!r} is not callable (it is a {type(factory).__name__})")
    return factory


def load_workload(target: str, *, meta: bool = True, batch: int | None = None,
                  seq_len: int | None = None, model_args: dict | None = None) -> Workload:
    """Build (model, inputs, loss_fn) from a built-in name or a factory, under the meta device."""
    import torch
    import torch.nn as nn

    from graphshard.tools.models import BUILTIN_MODELS

    kwargs = dict(model_args or {})
    if target in BUILTIN_MODELS:
        factory = BUILTIN_MODELS[target]
        kwargs = {"batch": batch or 1, "seq_len": seq_len or 128, **kwargs}
        meta = True  # built-ins need no real weights to be dumped
    elif ":" in target:
        factory = _import_factory(target)
        kwargs.update({k: v for k, v in (("batch", batch), ("seq_len", seq_len)) if v is not None})
    else:
        raise DumpError(f"unknown target {target!r}: expected a built-in model "
                        f"({', '.join(BUILTIN_MODELS)}), module:factory or file.py:factory")
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            result = factory(**kwargs)
    except Exception as e:
        hint = ("; it ran under torch.device('meta'): try --no-meta"
                if meta and "meta" in str(e) and target not in BUILTIN_MODELS else "")
        raise DumpError(f"factory {target!r} raised {_one_line(e)}{hint}") from e
    shape = "(model, example_inputs) or (model, example_inputs, loss_fn)"
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise DumpError(f"factory {target!r} must return {shape}; got {got}")
    model, inputs, loss_fn = (*result, None) if len(result) == 2 else result
    if not isinstance(model, nn.Module):
        raise DumpError(f"factory {target!r} must return {shape}; its model is a "
                        f"{type(model).__name__}, not an nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise DumpError(f"factory {target!r} must return {shape}; example_inputs is a "
                        f"{type(inputs).__name__}, not a tuple of inputs (or one tensor)")
    if loss_fn is not None and not callable(loss_fn):
        raise DumpError(f"factory {target!r} must return {shape}; loss_fn is a "
                        f"{type(loss_fn).__name__}, not callable")
    if not any(True for _ in model.parameters()):
        raise DumpError(f"factory {target!r} returned a model without parameters: nothing to shard")
    return Workload(model, tuple(inputs), loss_fn, target)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _to_fake(workload: Workload, fake_mode, device: str = "cpu") -> None:
    """Parameters, buffers and inputs -> FakeTensors on `device`: shapes and dtypes, no memory.

    Meta tensors would do for tracing, but Inductor's joint-graph passes replace every meta
    value the graph returns with empty_strided, which would hollow out the graphs we show.
    """
    import torch

    # to_empty gives each module a new Parameter: tied weights would come back untied (two
    # gathers, two reductions, counted twice). Re-tie them afterwards.
    owners: dict[int, list[tuple[object, str]]] = {}
    for module in workload.model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    with fake_mode:
        workload.model.to_empty(device=device)
    for tied in owners.values():
        first_module, first_name = tied[0]
        for module, name in tied[1:]:
            module._parameters[name] = first_module._parameters[first_name]
    with fake_mode:

        def fake(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.is_meta:
                return torch.empty_like(t, device=device).requires_grad_(t.requires_grad)
            return fake_mode.from_tensor(t)

        workload.inputs = torch.utils._pytree.tree_map(fake, workload.inputs)


# --------------------------------------------------------------------------- capture


class _CaptureComplete(Exception):
    """Raised by the observer once the last graph has been recorded: nothing needs to run."""


@dataclass
class Capture:
    texts: dict[tuple[str, str], str] = field(default_factory=dict)  # (graph, stage) -> code
    final: dict[str, Any] = field(default_factory=dict)  # graph -> final-stage GraphModule
    seconds: dict[str, float] = field(default_factory=dict)  # "graph/stage" -> time it took


def _readable(gm) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def capture(model, inputs: tuple, options, stages: Sequence[str],
            progress: Callable[[str], None] = lambda message: None) -> Capture:
    """Compile `model` with the graphshard backend; record the code of `stages` and the final
    graphs. The backward is compiled eagerly with the forward (as AOT compile does), and the
    observer stops the compilation once the final backward graph is recorded. `progress` is
    told when each graph has been captured and when its passes are done."""
    import torch

    from graphshard._torch_compat import backward_compiled_with_forward
    from graphshard.compiler.backend import STAGES, GraphshardCompiler

    result = Capture()
    final = STAGES[-1]
    needs_backward = _needs_backward(model, inputs)  # here: the backend runs under no_grad

    clock = [time.perf_counter()]

    def observe(kind: str, stage: str, gm) -> None:
        kind = "forward" if kind == "inference" else kind
        # "partitioned": AOTAutograd + partitioning since the previous event; else the pass
        result.seconds[f"{kind}/{stage}"] = time.perf_counter() - clock[0]
        if stage == final:
            captured = result.seconds[f"{kind}/partitioned"]
            passes = sum(v for k, v in result.seconds.items()
                         if k.startswith(f"{kind}/")) - captured
            progress(f"{kind} graph captured in {captured:.1f} s, passes run in {passes:.1f} s")
        # Later stages mutate the graph in place: take the text now.
        if stage in stages or stage == final:
            result.texts[(kind, stage)] = _readable(gm)
        if stage == final:
            result.final[kind] = gm  # nothing runs after the final stage with compiler="eager"
            if kind == "backward" or not needs_backward:
                raise _CaptureComplete()
        clock[0] = time.perf_counter()  # the text above is the dump's time, not the backend's

    # Inductor would only consume the final graphs: skip it, run exactly the backend's passes.
    compiler = GraphshardCompiler(dataclasses.replace(options, compiler="eager"), observe)
    torch.compiler.reset()
    try:
        compiled = torch.compile(model, backend=compiler, fullgraph=True)
        with backward_compiled_with_forward():
            compiled(*inputs)
    except Exception as e:
        if not _caused_by(e, _CaptureComplete):
            raise
    finally:
        torch.compiler.reset()
    if "forward" not in result.final:
        raise RuntimeError("the graphshard backend never saw a sharded graph "
                           "(no parameter read reached torch.compile)")
    return result


def _needs_backward(model, inputs) -> bool:
    import torch
    return torch.is_grad_enabled() and (
        any(p.requires_grad for p in model.parameters())
        or any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in torch.utils._pytree.tree_leaves(inputs)))


def _caused_by(e: BaseException | None, kind: type) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return False


# --------------------------------------------------------------------------- analysis


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
        gather = spec.compute_dtype or param.dtype
        infos[spec.name] = ParamInfo(
            spec.name, tuple(param.shape), param.dtype, param.numel(),
            param.to_local().numel(), param.requires_grad, bool(spec.gather_group),
            gather, spec.reduce_dtype or gather, spec.reduce_groups[0])
    return infos


def _dtype_name(dtype) -> str:
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
                       cluster) -> list[dict]:
    """One JSON record per collective of `gm` (`kind`: forward/backward), in graph order;
    `estimate` is the cost model's GraphEstimate of `gm`."""
    from graphshard.compiler.cost_model import wire_bytes
    from graphshard.passes.graph_utils import (collective_group, collective_kind, is_collective, is_wait,
                                    tensor_val)

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
        buffer = tensor_val(node if op == "all_gather" else node.args[0])
        buffer_bytes = int(buffer.numel()) * buffer.element_size() if buffer is not None else 0
        dtype = buffer.dtype if buffer is not None else None
        names = list(node.meta.get("graphshard_params", ()))
        group_name, _ = collective_group(node)
        known = [infos[n] for n in names if n in infos]
        replica_reduce = op == "all_reduce" and known and group_name != known[0].shard_group
        if known and dtype is not None and not replica_reduce:
            nbytes = sum(p.numel for p in known) * dtype.itemsize
        else:
            nbytes = buffer_bytes
        waits = sorted((u for u in node.users if is_wait(u)), key=index.__getitem__)
        wait = waits[0] if waits else None
        consumer = _first_consumer(wait, index, cluster) if wait is not None else None
        sim = simulated.get(node.name)
        group_size = sim.group_size if sim else 0
        records.append({
            "graph": kind,
            "name": node.name,
            "op": op,
            "params": names,
            "bytes": int(nbytes),
            "buffer_bytes": buffer_bytes,
            "wire_bytes": float(wire_bytes(op, buffer_bytes, group_size)) if group_size else 0.0,
            "dtype": _dtype_name(dtype) if dtype is not None else None,
            "group_size": group_size,
            "start": index[node],
            "wait": index[wait] if wait is not None else None,
            "issued_after": last_compute[index[node]],
            "needed_by": consumer.name if consumer is not None else None,
            "overlaps": computes_before[index[wait]] - computes_before[index[node]]
            if wait is not None else 0,
            "issue_s": sim.issue_s if sim else 0.0,
            "start_s": sim.start_s if sim else 0.0,
            "duration_s": sim.dur_s if sim else 0.0,
            "hidden_s": sim.hidden_s if sim else 0.0,
            "exposed_s": sim.exposed_s if sim else 0.0,
        })
    return records


KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def comm_summary(records: list[dict], infos: dict[str, ParamInfo], strategy: str,
                 world_size: int, shard_size: int, has_backward: bool = True) -> dict:
    """Measured bytes per kind beside theoretical_comm_bytes, with reasons for differences."""
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
    by_kind: dict[str, dict] = {}
    for kind in (*KINDS, "total"):
        chosen = [r for r in records if kind == "total" or r["op"] == kind]
        wire = sum(r["wire_bytes"] for r in chosen)
        by_kind[kind] = {
            "count": len(chosen),
            "bytes": sum(r["bytes"] for r in chosen),
            "buffer_bytes": sum(r["buffer_bytes"] for r in chosen),
            "wire_bytes": wire,
            "theory_wire_bytes": float(theory[kind]),
            "theory_formula": str(formulas[kind]),
            "difference": wire - float(theory[kind]),
        }
    return {**by_kind, "symbols": {"P": gather_bytes, "T": trainable_bytes, "N": world_size,
                                   **({"S": shard_size} if extra else {})},
            "notes": _difference_notes(records, infos, strategy, shard_size, has_backward)}


def _difference_notes(records: list[dict], infos: dict[str, ParamInfo], strategy: str,
                      shard_size: int, has_backward: bool) -> list[str]:
    """Why the measured bytes differ from theory, named parameter by parameter."""
    if shard_size == 1 and strategy != "no_shard" or not records:
        return ["nothing to communicate (one rank per shard group)"] if not records else []
    notes = []
    if not has_backward:
        notes.append("no backward graph (nothing requires grad): the theory is a training step's")

    def gathered(graph: str) -> set[str]:
        return {n for r in records if r["graph"] == graph and r["op"] == "all_gather"
                for n in r["params"]}

    def listing(names: Sequence[str]) -> str:
        shown = ", ".join(sorted(names)[:4])
        if len(names) > 4:
            shown += f" and {len(names) - 4} more"
        size = sum(infos[n].numel * infos[n].gather_dtype.itemsize for n in names)
        return f"{shown} ({_human(size)})"

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
            if not_regathered:
                notes.append("not re-gathered in backward (their values are not needed to "
                             f"compute any gradient): {listing(not_regathered)}")
    padding = sum(r["buffer_bytes"] - r["bytes"] for r in records if r["op"] != "all_reduce")
    if padding:
        notes.append(f"padding of uneven shards adds {_human(padding)} of buffers "
                     "(dim 0 rounded up to a multiple of the group size)")
    return notes


def memory_summary(fw, bw, bw_graph, infos: dict[str, ParamInfo], input_bytes: int) -> dict:
    """Per-rank peak: model state (shards, gradients, AdamW state) plus the larger of the
    forward's and the backward's transient memory from the cost model's liveness walk.
    fw, bw: simulator.GraphEstimate (bw None without a backward); bw_graph: its GraphModule."""
    from graphshard.compiler.cost_model import value_bytes

    param_bytes = sum(p.local_numel * p.dtype.itemsize for p in infos.values())
    grad_bytes = sum(p.local_numel * p.dtype.itemsize for p in infos.values() if p.requires_grad)
    optimizer_bytes = 2 * grad_bytes
    state = param_bytes + grad_bytes + optimizer_bytes
    fw_peak = fw.memory.peak_transient_bytes  # includes what forward saves (its outputs)
    saved = bw_peak = bw_transient = 0
    if bw is not None:
        # Backward inputs other than forward inputs (primals_*, i.e. shards and the batch,
        # counted above): the saved activations and the output's gradient.
        saved = sum(int(value_bytes(n.meta.get("val"))) for n in bw_graph.graph.nodes
                    if n.op == "placeholder" and not n.name.startswith("primals"))
        bw_transient = bw.memory.peak_transient_bytes
        bw_peak = saved + bw_transient
    peak_graph = "backward" if bw_peak > fw_peak else "forward"
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": optimizer_bytes,
        "model_state_bytes": state,
        "input_bytes": input_bytes,
        "forward_transient_bytes": fw_peak,
        "backward_saved_bytes": saved,
        "backward_transient_bytes": bw_transient,
        "peak_graph": peak_graph,
        "peak_node": (bw if peak_graph == "backward" else fw).memory.peak_node,
        "peak_bytes": state + input_bytes + max(fw_peak, bw_peak),
    }


# --------------------------------------------------------------------------- the dump


@dataclass
class DumpResult:
    report: dict  # the JSON document
    texts: dict[tuple[str, str], str]  # (graph, stage) -> code, for the stages asked for
    trace: dict  # Chrome trace


def dump(workload: Workload, *, world_size: int, strategy: str = "full_shard", options=None,
         stages: Sequence[str] = (), shard_size: int | None = None, param_dtype=None,
         reduce_dtype=None, cluster=None,
         progress: Callable[[str], None] = lambda message: None) -> DumpResult:
    """Shard and compile `workload` at `world_size` on a fake process group (one must not be
    initialised already) and describe the result. `stages`: stage names whose code to keep;
    `progress`: told what the long phases are doing (the CLI prints it to stderr)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard
    from graphshard._torch_compat import fake_tensor_mode, init_fake_process_group
    from graphshard.compiler.backend import PIPELINE, STAGES
    from graphshard.compiler.cost_model import ClusterSpec, value_bytes
    from graphshard.compiler.simulator import graph_estimate
    from graphshard.compiler.options import GraphshardOptions
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

    init_fake_process_group(world_size)
    try:
        _to_fake(workload, fake_tensor_mode())
        mesh = (init_device_mesh("cpu", (world_size // shard_size, shard_size),
                                 mesh_dim_names=("replicate", "shard"))
                if strategy == "hybrid_shard" else init_device_mesh("cpu", (world_size,)))
        graphshard.shard(workload.model, mesh, strategy=strategy, param_dtype=param_dtype,
                         reduce_dtype=reduce_dtype)
        infos = param_infos(workload.model)
        progress(f"capturing the training step of {workload.description} at world size "
                 f"{world_size} (Dynamo, AOTAutograd, partitioning: most of the dump's time)")
        cap = capture(workload.model, workload.inputs, options, stages, progress)
        captured = time.perf_counter()
        progress("estimating time and memory with the cost model")
        estimates = {kind: graph_estimate(gm, cluster) for kind, gm in cap.final.items()}
        records = [r for kind in ("forward", "backward") if kind in estimates
                   for r in collective_records(kind, cap.final[kind], estimates[kind], infos,
                                               cluster)]
    finally:
        dist.destroy_process_group()

    input_bytes = int(value_bytes(list(torch.utils._pytree.tree_leaves(workload.inputs))))
    fw, bw = estimates["forward"], estimates.get("backward")
    comm = comm_summary(records, infos, strategy, world_size, shard_size or world_size,
                        has_backward=bw is not None)
    memory = memory_summary(fw, bw, cap.final.get("backward"), infos, input_bytes)
    report = {
        "schema_version": 1,
        "target": workload.description,
        "world_size": world_size,
        "rank": 0,
        "strategy": strategy,
        "mesh": list(mesh.shape),
        "options": options.to_dict(),
        "stages": list(STAGES),
        "stages_disabled": [st.name for st in PIPELINE if not st.enabled(options)],
        "stage": STAGES[-1],
        "params": {
            "count": len(infos),
            "bytes": sum(p.bytes for p in infos.values()),
            "trainable_bytes": sum(p.bytes for p in infos.values() if p.requires_grad),
            "gather_bytes": comm["symbols"]["P"],
            "reduce_bytes": comm["symbols"]["T"],
            "local_bytes": memory["param_bytes"],
            "list": [{"name": p.name, "shape": list(p.shape), "dtype": _dtype_name(p.dtype),
                      "bytes": p.bytes, "requires_grad": p.requires_grad, "sharded": p.sharded}
                     for p in infos.values()],
        },
        "collectives": records,
        "comm": comm,
        "estimate": {
            "comm_bytes": comm["total"]["wire_bytes"],
            "peak_memory_bytes": memory["peak_bytes"],
            "step_s": sum(e.total_s for e in estimates.values()),
            "exposed_comm_s": sum(e.exposed_comm_s for e in estimates.values()),
            "compute_s": sum(e.compute_s for e in estimates.values()),
            "comm_s": sum(e.comm_s for e in estimates.values()),
            "memory": memory,
            "per_graph": {k: {"total_s": e.total_s, "compute_s": e.compute_s,
                              "comm_s": e.comm_s, "exposed_comm_s": e.exposed_comm_s,
                              "peak_transient_bytes": e.memory.peak_transient_bytes,
                              "peak_node": e.memory.peak_node}
                          for k, e in estimates.items()},
            "cluster": dataclasses.asdict(cluster),
        },
        "graphs": {kind: cap.texts.get((kind, STAGES[-1])) for kind in ("forward", "backward")},
        "timing": {"capture_s": captured - started, "total_s": time.perf_counter() - started,
                   "stages_s": cap.seconds},
    }
    texts = {key: text for key, text in cap.texts.items() if key[1] in stages}
    trace = chrome_trace(estimates, records, workload.description, world_size)
    return DumpResult(report, texts, trace)


def chrome_trace(estimates: dict, records: list[dict], title: str, world_size: int) -> dict:
    """Both graphs on one timeline: compute lane (tid 0), communication lane (tid 1)."""
    by_name = {(r["graph"], r["name"]): r for r in records}
    events: list[dict] = [
        {"ph": "M", "pid": 0, "name": "process_name",
         "args": {"name": f"graphshard dump {title} (rank 0 of {world_size}, simulated)"}},
        {"ph": "M", "pid": 0, "tid": 0, "name": "thread_name", "args": {"name": "compute"}},
        {"ph": "M", "pid": 0, "tid": 1, "name": "thread_name", "args": {"name": "communication"}},
    ]
    offset = 0.0
    for kind in ("forward", "backward"):
        est = estimates.get(kind)
        if est is None:
            continue
        for e in est.events:
            if e.dur_s <= 0:
                continue
            args: dict[str, Any] = {"graph": kind}
            record = by_name.get((kind, e.name)) if e.lane == "comm" else None
            if record:
                args.update(bytes=record["bytes"], params=record["params"][:8],
                            hidden_us=record["hidden_s"] * 1e6,
                            exposed_us=record["exposed_s"] * 1e6)
            events.append({"name": e.name, "cat": f"{kind},{e.kind}", "ph": "X", "pid": 0,
                           "tid": 0 if e.lane == "compute" else 1,
                           "ts": (offset + e.start_s) * 1e6, "dur": e.dur_s * 1e6, "args": args})
        offset += est.total_s
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# --------------------------------------------------------------------------- text output


def _human(n: float) -> str:
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


def format_report(result: DumpResult, stages: Sequence[str]) -> str:
    from tabulate import tabulate

    r = result.report
    est, comm, mem = r["estimate"], r["comm"], r["estimate"]["memory"]
    out = [
        f"graphshard dump {r['target']}: world size {r['world_size']} (fake process group; "
        f"everything below is rank 0's view), strategy {r['strategy']}, mesh {r['mesh']}",
        "options: " + ", ".join(f"{k}={v}" for k, v in r["options"].items()),
        f"parameters: {r['params']['count']} ({_human(r['params']['bytes'])} unsharded, "
        f"{_human(r['params']['trainable_bytes'])} trainable; "
        f"{_human(r['params']['local_bytes'])} on rank 0)",
        "",
    ]
    for stage in r["stages"]:
        if stage not in stages:
            continue
        for kind in ("dynamo", "joint", "forward", "backward"):
            text = result.texts.get((kind, stage))
            if text is not None:
                off = " (off in these options: unchanged)" if stage in r["stages_disabled"] else ""
                out += [f"==== {kind} graph after stage {stage!r}{off} ====", text.rstrip(), ""]

    rows = [(i, {"forward": "fwd", "backward": "bwd"}[c["graph"]], c["op"],
             _params_cell(c["params"]), _human(c["bytes"]), c["dtype"],
             f"{c['start']}->{c['wait']}", c["overlaps"], c["needed_by"],
             f"{c['hidden_s'] * 1e3:.3f}", f"{c['exposed_s'] * 1e3:.3f}")
            for i, c in enumerate(r["collectives"])]
    out += [f"==== collectives ({len(rows)}; start->wait: node indices in the final graph, "
            "overlaps: compute nodes between them) ====",
            tabulate(rows, headers=["#", "graph", "op", "params", "bytes", "dtype", "start->wait",
                                    "overlaps", "needed by", "hidden ms", "exposed ms"]),
            ""]

    symbols = ", ".join(f"{k}={_human(v) if k in 'PT' else v}" for k, v in comm["symbols"].items())
    rows = [(kind, comm[kind]["count"], _human(comm[kind]["bytes"]),
             _human(comm[kind]["wire_bytes"]), comm[kind]["theory_formula"],
             _human(comm[kind]["theory_wire_bytes"]), _human(comm[kind]["difference"]))
            for kind in (*KINDS, "total")
            if kind == "total" or comm[kind]["count"] or comm[kind]["theory_wire_bytes"]]
    out += [f"==== communication per step, per rank ({symbols}) ====",
            tabulate(rows, headers=["", "count", "unsharded", "on the wire", "theory (formula)",
                                    "theory", "difference"]),
            *[f"  - {note}" for note in comm["notes"]], ""]

    per = est["per_graph"]
    rows = [(kind, f"{g['total_s'] * 1e3:.2f}", f"{g['compute_s'] * 1e3:.2f}",
             f"{g['comm_s'] * 1e3:.2f}", f"{g['exposed_comm_s'] * 1e3:.2f}",
             _human(g["peak_transient_bytes"])) for kind, g in per.items()]
    rows.append(("step", f"{est['step_s'] * 1e3:.2f}", f"{est['compute_s'] * 1e3:.2f}",
                 f"{est['comm_s'] * 1e3:.2f}", f"{est['exposed_comm_s'] * 1e3:.2f}", ""))
    cluster = est["cluster"]
    if mem["peak_graph"] == "backward":
        working_set = (f"backward: saved activations {_human(mem['backward_saved_bytes'])} + "
                       f"its own peak {_human(mem['backward_transient_bytes'])}")
    else:
        working_set = f"forward: its own peak {_human(mem['forward_transient_bytes'])}"
    out += [f"==== estimate (cost model: alpha {cluster['latency_s'] * 1e6:.0f} us, "
            f"{_human(cluster['bandwidth_Bps'])}/s, {cluster['flops_per_s']:.3g} FLOP/s) ====",
            tabulate(rows, headers=["", "time ms", "compute ms", "comm ms", "exposed comm ms",
                                    "own peak"]),
            "  own peak: the most a graph allocates at one time beyond its inputs (the forward's "
            "includes the activations it saves for backward)",
            f"peak memory per rank: {_human(mem['peak_bytes'])} = model state "
            f"{_human(mem['model_state_bytes'])} (params {_human(mem['param_bytes'])}, grads "
            f"{_human(mem['grad_bytes'])}, AdamW {_human(mem['optimizer_bytes'])}) + inputs "
            f"{_human(mem['input_bytes'])} + {working_set} (at {mem['peak_node']})",
            f"dump took {r['timing']['total_s']:.1f} s (capture {r['timing']['capture_s']:.1f} s)"]
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + line
        raise DumpError(message)


def _model_args(items: Sequence[str]) -> dict[str, Any]:
    """['dim=32,n_layers=1', 'vocab_size=64'] -> {...}; values are Python literals."""
    args: dict[str, Any] = {}
    for item in (part for text in items for part in text.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep:
            raise DumpError(f"--model-args expects KEY=VALUE, got {item!r}")
        try:
            args[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            args[key.strip()] = value.strip()
    return args


def _parser() -> argparse.ArgumentParser:
    from graphshard.compiler.backend import STAGES
    from graphshard.tools.cli import parse_dtype

    p = _Parser(prog="graphshard dump",
                description="Show what the graphshard compiler does to a model at any world "
                            "size: graphs per stage, every collective, bytes against theory, "
                            "and cost-model estimates. One process, fake process group, no "
                            "weights allocated. JSON schema: graphshard/dump.py docstring.")
    p.add_argument("target", help="built-in model (transformer, transformer-large, llama, "
                                  "llama3-8b), package.module:factory or path/file.py:factory")
    p.add_argument("--world-size", "-n", type=int, default=8, help="ranks to simulate (default 8)")
    p.add_argument("--strategy", default="full_shard",
                   help="full_shard, shard_grad_op, no_shard or hybrid_shard")
    p.add_argument("--shard-size", type=int, help="hybrid_shard: ranks per shard group")
    p.add_argument("--stage", default="none",
                   help=f"also print the FX graphs after a stage: {', '.join(STAGES)}, or all "
                        "(default none: the summary only)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option, as in torch.compile(options=...); repeatable")
    p.add_argument("--param-dtype", type=parse_dtype, metavar="DTYPE",
                   help="mixed precision: dtype of gathered parameters (bf16/bfloat16, "
                        "fp16/float16, fp32/float32)")
    p.add_argument("--reduce-dtype", type=parse_dtype, metavar="DTYPE",
                   help="mixed precision: dtype of gradient reduction (same spellings)")
    p.add_argument("--batch", type=int,
                   help="batch size (per rank) of the example inputs: factory kwarg batch=")
    p.add_argument("--seq", type=int,
                   help="sequence length of the example inputs: factory kwarg seq_len=")
    p.add_argument("--model-args", action="append", default=[], metavar="K=V,...",
                   help="factory keyword arguments, e.g. n_layers=2,dim=64 (built-ins: config)")
    p.add_argument("--no-meta", dest="meta", action="store_false",
                   help="call a factory as written instead of under torch.device('meta')")
    p.add_argument("--cluster", metavar="FILE", help="ClusterSpec JSON (graphshard calibrate)")
    p.add_argument("--json", metavar="FILE",
                   help="write the report as JSON (schema: graphshard/dump.py docstring)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the simulated step")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress messages on stderr")
    return p


def _progress_printer(quiet: bool) -> Callable[[str], None]:
    if quiet:
        return lambda message: None
    started = time.perf_counter()

    def show(message: str) -> None:
        print(f"graphshard dump [{time.perf_counter() - started:5.1f} s]: {message}",
              file=sys.stderr, flush=True)

    return show


def run(argv: Sequence[str]) -> int:
    from graphshard.compiler.backend import STAGES
    from graphshard.compiler.options import parse_option_strings
    from graphshard.policy import ShardingStrategy

    args = _parser().parse_args(list(argv))
    stage_choices = (*STAGES, "all", "none")
    if args.stage not in stage_choices:
        raise DumpError(f"unknown stage {args.stage!r}; valid: {', '.join(stage_choices)}")
    stages = STAGES if args.stage == "all" else () if args.stage == "none" else (args.stage,)
    if args.world_size < 1:
        raise DumpError(f"--world-size must be at least 1, got {args.world_size}")
    for flag in ("batch", "seq", "shard_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise DumpError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    try:
        strategy = ShardingStrategy.parse(args.strategy).value
        options = parse_option_strings(args.option)
    except ValueError as e:
        raise DumpError(str(e)) from None
    cluster = None
    if args.cluster:
        from graphshard.compiler.cost_model import ClusterSpec
        try:
            cluster = ClusterSpec.from_json(args.cluster)
        except (OSError, ValueError, TypeError) as e:
            raise DumpError(f"--cluster {args.cluster!r}: {_one_line(e)}") from None

    workload = load_workload(args.target, meta=args.meta, batch=args.batch, seq_len=args.seq,
                             model_args=_model_args(args.model_args))
    try:
        result = dump(workload, world_size=args.world_size, strategy=strategy, options=options,
                      stages=stages, shard_size=args.shard_size, param_dtype=args.param_dtype,
                      reduce_dtype=args.reduce_dtype, cluster=cluster,
                      progress=_progress_printer(args.quiet))
    except DumpError:
        raise
    except Exception as e:
        print(f"graphshard dump: compiling {args.target!r} failed: {_one_line(e)}", file=sys.stderr)
        return COMPILE_ERROR
    print(format_report(result, stages))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.report, f, indent=1)
        print(f"wrote {args.json}")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(result.trace, f)
        print(f"wrote {args.trace}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except DumpError as e:
        print(f"graphshard dump: {e}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as e:  # --help
        return int(e.code or 0)


if __name__ == "__main__":
    sys.exit(main())
