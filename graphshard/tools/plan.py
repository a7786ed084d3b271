"""`graphshard plan`: the fastest configuration that fits, for a cluster you do not have.

    graphshard plan llama3-8b --devices 64 --cluster h100 --global-batch 64 --seq 8192
    graphshard plan my_pkg.models:make_model --devices 16 --cluster a100 --global-batch 32 \\
        --seq 2048 --json all.json --out best.json --trace best_step.json

TARGET is as for `graphshard dump` (a built-in name, package.module:factory or file.py:factory).
The planner captures the training step the way dump does (one process, a fake process group of
`--devices` ranks, fake tensors: no weights, no GPU), then searches:

- layout (each needs its own capture): strategy (full_shard over all devices, or hybrid_shard
  with every shard-group size that divides the device count and is whole nodes: one node or
  several), activation checkpointing of the repeated blocks (none, full, selective), parameter
  dtype (bf16 with fp32 reduction, or fp32), micro-batch size (accumulating to the global batch);
- options (only the passes and the estimate run again): which units stay gathered from forward
  to backward (the last one: full_shard's default; all: shard_grad_op; "auto": as many blocks as
  the device memory allows), prefetch depth, bucket size.

Each configuration's step is predicted by the cost model (graphshard.compiler.cost_model: roofline
compute with per-kernel overhead, alpha-beta collectives on the intra- or inter-node link each
process group spans, the optimizer step as a memory-bound pass over the shards) simulated on the
compiled forward and backward graphs, and its peak memory by the liveness model dump reports.
A model with more than five repeated blocks whose factory takes `n_layers` is captured with 4
and 5 blocks and extrapolated linearly to its depth (blocks repeat: so do their costs; see
`depth_probes` for why not fewer); others are captured whole.

Output: a ranked table (fitting configurations first, fastest first), the best configuration as
JSON (`--out`): {"shard": keyword arguments for graphshard.shard plus "mesh_shape", "options":
for torch.compile(..., backend="graphshard", options=...), "activation_checkpointing":
graphshard.apply_activation_checkpointing's mode, "micro_batch", "accumulation_steps"}; `--json`
every configuration tried (a list under "configs", best first); `--trace` a Chrome trace of the
best configuration's simulated step (of the captured graphs: the 5-block probe when
extrapolated). Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

USAGE_ERROR = 2
GiB = 2**30
ADAMW_BYTES_PER_ELEMENT = 28  # fused AdamW on fp32 shards: reads p, g, m, v; writes p, m, v


class PlanError(Exception):
    """Bad input: one line for the user."""


@dataclass(frozen=True)
class Layout:
    """What needs its own capture."""

    strategy: str  # "full_shard" or "hybrid_shard"
    shard_size: int  # ranks per shard group (all devices for full_shard)
    ac: str  # activation checkpointing: "none", "full", "selective"
    param_dtype: str  # "bfloat16" (fp32 reduction) or "float32"
    micro_batch: int  # per device


@dataclass(frozen=True)
class Knobs:
    """What only re-runs the passes and the estimate."""

    keep: str  # units kept gathered for backward: "last" (the default's tail), "all", "auto"
    prefetch: int
    bucket_mb: float


KNOBS = tuple(Knobs(keep, prefetch, bucket) for keep in ("last", "all")
              for prefetch, bucket in ((1, 64.0), (2, 64.0), (1, 25.0)))


@dataclass
class Probe:
    """One knob set on one capture (per device, one micro-batch step)."""

    step_s: float  # forward + backward
    exposed_comm_s: float
    comm_bytes: float  # wire bytes this device sends
    # StepMemory's parts, extrapolated each on its own: the peak is their max, which need not
    # be linear in depth (it may move from the forward to the backward)
    forward_peak_bytes: float
    backward_peak_bytes: float
    state_bytes: float  # parameter shards, AdamW state, the batch
    gradient_bytes: float  # held between micro-batches under accumulation
    trainable_params: float  # full parameter count (for MFU)
    trainable_shard_elements: float  # this device's (for the optimizer step)
    estimates: Any = None  # {"forward", "backward": GraphEstimate}, for --trace

    @property
    def transient_bytes(self) -> float:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    def combine(self, other: "Probe", weight: float) -> "Probe":
        """self + weight * (other - self), field by field (linear extrapolation in depth)."""
        values = {f.name: getattr(self, f.name) + weight * (getattr(other, f.name) - getattr(self, f.name))
                  for f in dataclasses.fields(self) if f.name != "estimates"}
        return Probe(**values, estimates=other.estimates)


@dataclass
class Config:
    layout: Layout
    knobs: Knobs
    accumulation: int
    step_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: float
    comm_bytes: float
    exposed_comm_s: float
    fits: bool
    why: str = ""  # why it does not fit
    kept_blocks: int | None = None  # "auto": blocks kept gathered
    estimates: Any = field(default=None, repr=False)

    @property
    def strategy_name(self) -> str:
        if self.knobs.keep == "all" and self.layout.strategy == "full_shard":
            return "shard_grad_op"
        return self.layout.strategy

    def mesh_shape(self, devices: int) -> list[int]:
        if self.layout.strategy == "hybrid_shard":
            return [devices // self.layout.shard_size, self.layout.shard_size]
        return [devices]

    def shard_kwargs(self, devices: int) -> dict:
        strategy = self.layout.strategy
        if self.knobs.keep == "all" and strategy == "full_shard":
            strategy = "shard_grad_op"
        kwargs = {"strategy": strategy, "mesh_shape": self.mesh_shape(devices)}
        if self.layout.param_dtype != "float32":
            kwargs |= {"param_dtype": self.layout.param_dtype, "reduce_dtype": "float32"}
        return kwargs

    def options(self, budget_mb: float | None) -> dict:
        options: dict[str, Any] = {"prefetch": self.knobs.prefetch, "bucket_mb": self.knobs.bucket_mb}
        if self.knobs.keep == "all" and self.layout.strategy == "hybrid_shard":
            options["reshard_after_forward"] = False
        elif self.knobs.keep == "auto":
            options |= {"reshard_after_forward": "auto", "memory_budget_mb": budget_mb}
        return options

    def as_json(self, devices: int, budget_mb: float | None) -> dict:
        return {
            "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "peak_memory_bytes": int(self.peak_memory_bytes), "fits": self.fits, "why": self.why,
            "comm_bytes": int(self.comm_bytes), "exposed_comm_s": self.exposed_comm_s,
            "shard": self.shard_kwargs(devices), "options": self.options(budget_mb),
            "activation_checkpointing": self.layout.ac, "micro_batch": self.layout.micro_batch,
            "accumulation_steps": self.accumulation,
            **({"kept_blocks": self.kept_blocks} if self.kept_blocks is not None else {}),
        }


# --------------------------------------------------------------------------- search space


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


def layouts(devices: int, devices_per_node: int | None, local_batch: int,
            ac_modes: Sequence[str], dtypes: Sequence[str]) -> list[Layout]:
    strategies = [("full_shard", devices)] + [("hybrid_shard", s)
                                              for s in shard_group_sizes(devices, devices_per_node)]
    return [Layout(strategy, size, ac, dtype, micro)
            for (strategy, size), ac, dtype, micro in itertools.product(
                strategies, ac_modes, dtypes, micro_batches(local_batch))]


# --------------------------------------------------------------------------- capture + estimate


def _group_links(joint, cluster, devices: int) -> dict:
    """Each process group's link: a shard group of s contiguous ranks stays in a node when
    s <= devices per node; a replica group (stride s) spans every node of the cluster."""
    from graphshard.passes.graph_utils import is_unshard
    from graphshard.passes.markers import UnshardSpec

    node = cluster.devices_per_node or devices
    links = {}
    for n in joint.graph.nodes:
        if is_unshard(n):
            spec = UnshardSpec.from_node(n)
            for position, (group, size) in enumerate(zip(spec.reduce_groups, spec.reduce_sizes)):
                span = size if position == 0 else devices - devices // size + 1
                links[group] = cluster.link(spans_nodes=span > node)
    return links


def _probes(compiler, joint, joint_inputs, kwargs, knobs: Sequence[Knobs], cluster,
            devices: int) -> dict[Knobs, Probe]:
    """Evaluate every knob set on one joint graph: its partition and split stages (sharing
    the stages knob sets have in common), then the estimate."""
    from graphshard.compiler.backend import gradient_bytes, model_state_bytes, trainable_reads
    from graphshard.compiler.options import GraphshardOptions
    from graphshard.compiler.simulator import graph_estimate
    from graphshard.passes.liveness import step_memory

    def options(knob: Knobs) -> GraphshardOptions:
        return GraphshardOptions(prefetch=knob.prefetch, bucket_mb=knob.bucket_mb,
                                 reshard_after_forward=False if knob.keep == "all" else None,
                                 compiler="eager")

    trainable = [(read.meta["val"].numel(), read.args[0].meta["val"].numel())
                 for read in trainable_reads(joint).values()]  # (full, this rank's shard)
    state, gradients = model_state_bytes(joint), gradient_bytes(joint)
    # The collectives as the cluster's process groups run them (the capture's are fake).
    transport = GraphshardOptions().via_all_to_all(on_gloo=cluster.collective_backend == "gloo")
    compiler.split_context = compiler.split_context._replace(via_all_to_all=transport, group_ranks={})
    links = _group_links(joint, cluster, devices)

    def probe(forward, backward) -> Probe:
        estimates = {kind: graph_estimate(gm, cluster, group_specs=links, graph_kind=kind)
                     for kind, gm in (("forward", forward), ("backward", backward))}
        memory = step_memory(forward, backward, estimates["forward"].memory,
                             estimates["backward"].memory)
        return Probe(
            step_s=sum(e.total_s for e in estimates.values()),
            exposed_comm_s=sum(e.exposed_comm_s for e in estimates.values()),
            comm_bytes=_wire_bytes(estimates),
            forward_peak_bytes=memory.forward_peak_bytes,
            backward_peak_bytes=memory.backward_peak_bytes,
            state_bytes=state,
            gradient_bytes=gradients,
            trainable_params=sum(full for full, _ in trainable),
            trainable_shard_elements=sum(local for _, local in trainable),
            estimates=estimates)

    # Option sets share the stages before the first one they differ in: one partition and
    # lowering per reshard decision, one bucketing per bucket size under it, then the
    # schedule per option set.
    by_keep: dict[str, dict[float, list[Knobs]]] = {}
    for knob in knobs:
        by_keep.setdefault(knob.keep, {}).setdefault(knob.bucket_mb, []).append(knob)
    probes = {}
    for by_bucket in by_keep.values():
        lowerer = compiler.with_options(options(next(iter(by_bucket.values()))[0]))
        lowered = lowerer.run_split_stages(*lowerer.partition(joint, joint_inputs, **kwargs),
                                           stop_after="lowered")
        for group, graphs in zip(by_bucket.values(), _copies(lowered, len(by_bucket))):
            bucketed = compiler.with_options(options(group[0])).run_split_stages(
                *graphs, stop_after="bucketed", resume=True)
            for knob, graphs in zip(group, _copies(bucketed, len(group))):
                probes[knob] = probe(*compiler.with_options(options(knob)).run_split_stages(
                    *graphs, resume=True))
    return probes


def _copies(graphs, users: int):
    """`graphs` for each of `users` (the passes change what they run on): copies, and the
    graphs themselves for the last user."""
    import copy

    for _ in range(users - 1):
        yield copy.deepcopy(graphs)
    yield graphs


def _wire_bytes(estimates) -> float:
    from graphshard.compiler.cost_model import wire_bytes

    return sum(wire_bytes(c.kind, c.nbytes, c.group_size) for e in estimates.values()
               for c in e.collectives)


def capture_probes(target: str, layout: Layout, devices: int, seq: int, n_layers: int | None,
                   knobs: Sequence[Knobs], cluster, model_args: dict) -> dict[Knobs, Probe]:
    """Capture `target` in `layout` (with `n_layers` blocks, or as built) and evaluate every
    knob set on its joint graph."""
    import torch

    import graphshard
    from graphshard.compiler.backend import GraphshardCompiler
    from graphshard.compiler.options import GraphshardOptions
    from graphshard.tools.dump.capture import CaptureComplete, caused_by
    from graphshard.tools.dump.loading import load_workload, sharded_on_fake_cluster

    args = dict(model_args) | ({"n_layers": n_layers} if n_layers is not None else {})
    workload = load_workload(target, batch=layout.micro_batch, seq_len=seq, model_args=args)
    graphshard.apply_activation_checkpointing(workload.model, layout.ac)
    probes: dict[Knobs, Probe] = {}

    class Recorder(GraphshardCompiler):
        def partition(self, joint, joint_inputs, **kwargs):
            probes.update(_probes(self, joint, joint_inputs, kwargs, knobs, cluster, devices))
            raise CaptureComplete()  # nothing needs to run

    low = layout.param_dtype != "float32"
    with sharded_on_fake_cluster(workload, devices, layout.strategy, layout.shard_size,
                                 param_dtype=layout.param_dtype if low else None,
                                 reduce_dtype="float32" if low else None):
        recorder = Recorder(GraphshardOptions(compiler="eager"), cluster=cluster)
        torch.compiler.reset()
        try:
            with _quiet_selective_checkpoint_notice():
                workload.run(torch.compile(workload.model, backend=recorder, fullgraph=True))
        except Exception as e:
            if not caused_by(e, CaptureComplete):
                raise
        finally:
            torch.compiler.reset()
    if not probes:
        raise PlanError(f"{target}: no sharded training graph reached the backend (does the model "
                        "have trainable parameters read in forward?)")
    return probes


@contextlib.contextmanager
def _quiet_selective_checkpoint_notice():
    """Dynamo logs a notice for every selective-checkpointing capture ("make sure the
    checkpointed region does not contain in-place ops"): advice for a user's own policy, noise
    among the planner's progress lines (the policy is graphshard's)."""
    import logging

    logger = logging.getLogger("torch._higher_order_ops.wrap")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _capture_job(job: tuple) -> dict[Knobs, Probe]:
    """One capture in a worker process; the simulated events stay there (only --trace needs
    them, for one configuration)."""
    probes = capture_probes(*job)
    for probe in probes.values():
        probe.estimates = None
    return probes


@contextlib.contextmanager
def _pool(workers: int):
    """Processes for the captures (each is single-threaded Python: one per core)."""
    if workers <= 1:
        yield _InProcess()
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


class _InProcess:
    @staticmethod
    def map(fn, jobs):
        return map(fn, jobs)


def depth_probes(target: str, model_args: dict) -> tuple[int | None, tuple]:
    """(repeated blocks in the model, the block counts to capture: (4, 5) to extrapolate from,
    or (None,): the model as built). The first blocks are unlike the rest: a 1-block model's
    only block is also the last one of forward, and where backward peaks (while the last
    blocks' activations are alive, or at its end with every gradient produced) settles only
    from about 4 blocks on: from 3 and 4 blocks the backward's peak grew 4x faster per block
    than it does after (an 8-block transformer, tests/test_plan.py)."""
    from graphshard.activation_checkpointing import repeated_blocks
    from graphshard.tools.dump.loading import import_factory, load_workload
    from graphshard.tools.models import BUILTIN_MODELS

    workload = load_workload(target, batch=1, seq_len=8, model_args=model_args)
    try:
        depth = len(repeated_blocks(workload.model))
    except ValueError:
        return None, (None,)
    factory = BUILTIN_MODELS.get(target) or import_factory(target)
    takes = target in BUILTIN_MODELS or "n_layers" in inspect.signature(factory).parameters
    probed = takes and "n_layers" not in model_args and depth > 5
    return depth, (4, 5) if probed else (None,)


def _finish(layout: Layout, knobs: Knobs, probe: Probe, *, accumulation: int, cluster, devices: int,
            tokens: int) -> Config:
    optimizer_s = (probe.trainable_shard_elements * ADAMW_BYTES_PER_ELEMENT / cluster.memory_bandwidth_Bps
                   + cluster.kernel_overhead_s)
    step = accumulation * (probe.step_s + cluster.step_overhead_s) + optimizer_s
    # Micro-batches after the first run with the earlier ones' gradients held.
    peak = probe.state_bytes + probe.transient_bytes + (probe.gradient_bytes if accumulation > 1 else 0)
    import torch

    peak_flops = cluster.peak_flops(getattr(torch, layout.param_dtype))
    limit = cluster.device_memory_bytes
    fits = limit is None or peak <= limit
    why = "" if fits else f"needs {peak / GiB:.1f} GiB per device > {limit / GiB:.1f} GiB"
    return Config(layout, knobs, accumulation, step, tokens / step,
                  6 * probe.trainable_params * tokens / (step * devices * peak_flops), peak,
                  accumulation * probe.comm_bytes, accumulation * probe.exposed_comm_s, fits, why,
                  estimates=probe.estimates)


def _auto(layout: Layout, at: Callable[[Knobs], Probe], depth: int, knobs: Knobs,
          finish: Callable, limit: float | None) -> Config | None:
    """reshard_after_forward="auto" at the device memory: keep as many blocks gathered as fit,
    each beyond the default's (the last block) adding 1/(depth - 1) of the difference between
    keeping every block and the default."""
    last, every = dataclasses.replace(knobs, keep="last"), dataclasses.replace(knobs, keep="all")
    if limit is None or depth < 3:
        return None  # nothing between the default and "all"
    try:
        at(every)
    except KeyError:  # "all" not searched
        return None
    base, full = at(last), at(every)
    per_block = (full.transient_bytes - base.transient_bytes) / (depth - 1)
    spare = limit - finish(layout, last, base).peak_memory_bytes
    kept = depth if per_block <= 0 else max(1, min(depth, 1 + int(spare // per_block)))
    if not 1 < kept < depth:
        return None  # the same as the default or "all"
    probe = base.combine(full, (kept - 1) / (depth - 1))
    config = finish(layout, dataclasses.replace(knobs, keep="auto"), probe)
    config.kept_blocks = kept
    return config


def _at_depth(captured: list[dict[Knobs, Probe]], probe_sizes: tuple, depth: int | None,
              knob: Knobs) -> Probe:
    """A knob set's probe at the model's depth: as captured, or extrapolated from the probes."""
    if len(captured) == 1:
        return captured[0][knob]
    low, high = probe_sizes
    return captured[0][knob].combine(captured[1][knob], (depth - low) / (high - low))


def _as_ranks_see_it(cluster, devices: int):
    """The cluster as each rank sees it when `devices` ranks fill its nodes (ranks beyond a
    node's compute slots share them)."""
    return cluster.shared_by(min(devices, cluster.devices_per_node or devices))


def predict(target: str, devices: int, cluster, global_batch: int, seq: int, layout: Layout,
            knobs: Knobs, model_args: dict | None = None) -> Config:
    """One configuration's prediction, as `plan` makes it (the fidelity bench compares it with
    a measurement)."""
    model_args = dict(model_args or {})
    cluster = _as_ranks_see_it(cluster, devices)
    depth, probe_sizes = depth_probes(target, model_args)
    knob = dataclasses.replace(knobs, keep="last") if knobs.keep == "auto" else knobs
    captured = [capture_probes(target, layout, devices, seq, n, (knob,), cluster, model_args)
                for n in probe_sizes]
    return _finish(layout, knobs, _at_depth(captured, probe_sizes, depth, knob),
                   accumulation=global_batch // devices // layout.micro_batch, cluster=cluster,
                   devices=devices, tokens=global_batch * seq)


def plan(target: str, devices: int, cluster, global_batch: int, seq: int, *,
         model_args: dict | None = None, ac_modes: Sequence[str] = ("none", "full", "selective"),
         dtypes: Sequence[str] = ("bfloat16", "float32"), knobs: Sequence[Knobs] = KNOBS,
         workers: int = 1, progress: Callable[[str], None] = lambda message: None) -> list[Config]:
    """Every configuration, best first (fitting ones by step time, then the rest by peak)."""
    model_args = dict(model_args or {})
    if devices < 1:
        raise PlanError(f"--devices must be at least 1, got {devices}")
    node = cluster.devices_per_node
    if node and devices > node and devices % node:
        raise PlanError(f"--devices {devices} is not a whole number of nodes of {node} devices: "
                        f"use at most {node} or a multiple of {node}")
    if global_batch < 1 or global_batch % devices:
        raise PlanError(f"--global-batch {global_batch} must be a positive multiple of --devices "
                        f"{devices} (every device trains an equal share)")
    cluster = _as_ranks_see_it(cluster, devices)
    depth, probe_sizes = depth_probes(target, model_args)
    if depth is None:
        ac_modes = ("none",)  # no repeated blocks to checkpoint
    local_batch = global_batch // devices
    tokens = global_batch * seq
    candidates = layouts(devices, node, local_batch, ac_modes, dtypes)
    configs: list[Config] = []
    started = time.perf_counter()
    jobs = [(target, layout, devices, seq, n, tuple(knobs), cluster, model_args)
            for layout in candidates for n in probe_sizes]
    progress(f"{len(candidates)} layouts x {len(probe_sizes)} captures, {len(knobs)} option sets "
             f"each, on {workers} process(es)")
    with _pool(workers) as pool:
        results = iter(pool.map(_capture_job, jobs))
        for index, layout in enumerate(candidates):
            captured = [next(results) for _ in probe_sizes]
            progress(f"[{time.perf_counter() - started:5.1f} s] layout {index + 1}/{len(candidates)}"
                     f" done: {layout}")

            at = functools.partial(_at_depth, captured, probe_sizes, depth)

            def finish(layout_, knob, probe):
                return _finish(layout_, knob, probe, accumulation=local_batch // layout_.micro_batch,
                               cluster=cluster, devices=devices, tokens=tokens)

            for knob in knobs:
                configs.append(finish(layout, knob, at(knob)))
                if knob.keep == "last" and depth:
                    auto = _auto(layout, at, depth, knob, finish, cluster.device_memory_bytes)
                    if auto is not None:
                        configs.append(auto)
    configs.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.peak_memory_bytes))
    return configs


# --------------------------------------------------------------------------- output


def budget_mb(cluster) -> float | None:
    return None if cluster.device_memory_bytes is None else cluster.device_memory_bytes / 2**20


def table(configs: Sequence[Config], devices: int, cluster, top: int) -> str:
    from tabulate import tabulate

    limit = cluster.device_memory_bytes
    rows = []
    for rank, c in enumerate(configs[:top], 1):
        keep = {"last": "tail", "all": "all", "auto": f"{c.kept_blocks} blocks"}[c.knobs.keep]
        rows.append([
            rank, c.strategy_name, "x".join(map(str, c.mesh_shape(devices))), c.layout.ac,
            "bf16" if c.layout.param_dtype == "bfloat16" else "fp32",
            f"{c.layout.micro_batch}x{c.accumulation}", keep, c.knobs.prefetch, f"{c.knobs.bucket_mb:g}",
            f"{c.step_s * 1e3:.1f}", f"{c.tokens_per_s / devices:,.0f}", f"{100 * c.mfu:.1f}",
            f"{c.peak_memory_bytes / GiB:.1f}" + (f" / {limit / GiB:.0f}" if limit else ""),
            f"{c.comm_bytes / GiB:.2f}", f"{c.exposed_comm_s * 1e3:.1f}",
            "yes" if c.fits else f"no: {c.why}"])
    return tabulate(rows, headers=[
        "#", "strategy", "mesh", "AC", "dtype", "micro x acc", "kept gathered", "prefetch",
        "bucket MiB", "step ms", "tokens/s/dev", "MFU %", "peak GiB", "comm GiB", "exposed ms",
        "fits"])


# Published measurements to print beside a prediction, as a sanity check (not a tuning target).
PUBLISHED = {
    ("llama3-8b", "h100", 8): (
        "torchtitan (pytorch/torchtitan issue 1881): Llama-3-8B, 8x H100, FSDP over 8, local "
        "batch 1, bf16: about 7,200 tokens/s per GPU at about 41 GiB"),
}


def published_figures(target: str, devices: int, cluster: str, seq: int, configs) -> list[str]:
    figure = PUBLISHED.get((target, cluster, devices))
    if figure is None:
        return []
    fsdp = [c for c in configs if c.layout.strategy == "full_shard" and c.knobs.keep == "last"
            and c.layout.param_dtype == "bfloat16" and c.layout.micro_batch == 1]
    lines = [f"published: {figure}"]
    for c in sorted(fsdp, key=lambda c: c.layout.ac):
        lines.append(f"  predicted, full_shard bf16 local batch 1 seq {seq} AC {c.layout.ac} "
                     f"prefetch {c.knobs.prefetch} bucket {c.knobs.bucket_mb:g}: "
                     f"{c.tokens_per_s / devices:,.0f} tokens/s per GPU, "
                     f"{c.peak_memory_bytes / GiB:.1f} GiB")
    return lines


def _parser() -> argparse.ArgumentParser:
    from graphshard.compiler.clusters import PRESET_NAMES

    p = argparse.ArgumentParser(prog="graphshard plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="built-in model name, package.module:factory or file.py:factory")
    p.add_argument("--devices", "-n", type=int, required=True, help="devices (ranks) to plan for")
    p.add_argument("--cluster", required=True,
                   help=f"a preset ({', '.join(PRESET_NAMES)}; sources in "
                        "graphshard/compiler/clusters.py) or a JSON file from `graphshard "
                        "calibrate --out FILE`")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--model-args", default="", metavar="K=V,...",
                   help="keyword arguments for the model factory")
    p.add_argument("--ac", default="none,full,selective",
                   help="activation checkpointing modes to try (comma-separated)")
    p.add_argument("--dtypes", default="bf16,fp32", help="parameter dtypes to try")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--out", default="graphshard_plan.json", help="the best configuration (JSON)")
    p.add_argument("--json", help="every configuration tried, best first")
    p.add_argument("--trace", help="Chrome trace of the best configuration's simulated step")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes capturing in parallel (default: up to 2)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from graphshard.bench.workload import parse_model_args
    from graphshard.compiler.clusters import resolve_cluster
    from graphshard.policy import DTYPE_NAMES
    from graphshard.tools.dump.loading import DumpError, check_output_paths

    args = _parser().parse_args(argv)
    try:
        check_output_paths(out=args.out, json=args.json, trace=args.trace)
        cluster = resolve_cluster(args.cluster)
        model_args = dict(parse_model_args(args.model_args)) if args.model_args else {}
        ac_modes = [m.strip() for m in args.ac.split(",") if m.strip()]
        bad = [m for m in ac_modes if m not in ("none", "full", "selective")]
        if bad or not ac_modes:
            raise PlanError(f"--ac takes none, full, selective; got {args.ac!r}")
        dtypes = [DTYPE_NAMES.get(d.strip().lower(), "") for d in args.dtypes.split(",")]
        if not all(d in ("bfloat16", "float32") for d in dtypes):
            raise PlanError(f"--dtypes takes bf16 and/or fp32; got {args.dtypes!r}")
        progress = (lambda m: None) if args.quiet else (lambda m: print(f"graphshard plan {m}",
                                                                        file=sys.stderr, flush=True))
        started = time.perf_counter()
        configs = plan(args.target, args.devices, cluster, args.global_batch, args.seq,
                       model_args=model_args, ac_modes=ac_modes, dtypes=dtypes,
                       workers=args.jobs, progress=progress)
        took = time.perf_counter() - started
        if not configs[0].fits:
            smallest = min(configs, key=lambda c: c.peak_memory_bytes)
            raise PlanError(
                f"{args.target} fits in no configuration on {args.devices} devices of "
                f"{cluster.device_memory_bytes / GiB:.0f} GiB: the smallest peak is "
                f"{smallest.peak_memory_bytes / GiB:.1f} GiB per device "
                f"({(smallest.peak_memory_bytes - cluster.device_memory_bytes) / GiB:.1f} GiB too "
                "much); use more devices or a smaller micro-batch")
    except (PlanError, DumpError, ValueError, argparse.ArgumentTypeError) as e:
        print(f"graphshard plan: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    budget = budget_mb(cluster)
    print(f"{args.target} on {args.devices} devices ({args.cluster}), global batch "
          f"{args.global_batch} x seq {args.seq}: {len(configs)} configurations in {took:.0f} s")
    print(table(configs, args.devices, cluster, args.top))
    best = configs[0]
    with open(args.out, "w") as f:
        json.dump(best.as_json(args.devices, budget), f, indent=2)
    print(f"best configuration written to {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "devices": args.devices, "cluster": args.cluster,
                       "global_batch": args.global_batch, "seq": args.seq, "seconds": took,
                       "configs": [c.as_json(args.devices, budget) for c in configs]}, f, indent=2)
        print(f"all configurations written to {args.json}")
    for line in published_figures(args.target, args.devices, args.cluster, args.seq, configs):
        print(line)
    if args.trace:
        from graphshard.compiler.simulator import chrome_trace

        _, probe_sizes = depth_probes(args.target, model_args)
        knob = dataclasses.replace(best.knobs, keep="last") if best.knobs.keep == "auto" else best.knobs
        probes = capture_probes(args.target, best.layout, args.devices, args.seq, probe_sizes[-1],
                                (knob,), cluster, model_args)
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(probes[knob].estimates,
                                   process_name=f"graphshard plan {args.target} (simulated)"), f)
        print(f"trace of the best configuration written to {args.trace}")
    return 0
