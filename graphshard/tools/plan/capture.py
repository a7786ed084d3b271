"""One capture per layout: the training step traced the way `graphshard dump` traces it (one
process, a fake process group of `devices` ranks, fake tensors), every option set evaluated on
its joint graph by the backend's own passes and the cost model."""

from __future__ import annotations

import copy
from typing import Sequence

from graphshard.tools.plan.config import FLOAT8_RECIPE, Probe, compute_dtype
from graphshard.tools.plan.space import Knobs, Layout, PlanError


def capture_probes(target: str, layout: Layout, devices: int, seq: int, n_layers: int | None,
                   knobs: Sequence[Knobs], cluster, model_args: dict) -> dict[Knobs, Probe]:
    """Capture `target` in `layout` (with `n_layers` blocks, or as built) and evaluate every
    knob set on its joint graph."""
    import graphshard
    from graphshard.compiler.backend import GraphshardCompiler
    from graphshard.compiler.options import GraphshardOptions
    from graphshard.tools.dump.capture import CaptureComplete
    from graphshard.tools.dump.loading import DumpError, load_workload, sharded_on_fake_cluster

    args = dict(model_args) | ({"n_layers": n_layers} if n_layers is not None else {})
    workload = load_workload(target, batch=layout.micro_batch, seq_len=seq, model_args=args)
    if layout.param_dtype == "float8":
        convert_to_float8(workload.model)
    graphshard.apply_activation_checkpointing(workload.model, layout.ac)
    probes: dict[Knobs, Probe] = {}

    class Recorder(GraphshardCompiler):
        def partition(self, joint, joint_inputs, **kwargs):
            probes.update(_probes(self, joint, joint_inputs, kwargs, knobs, cluster, devices,
                                  layout.tp))
            raise CaptureComplete()  # nothing needs to run

    low = layout.param_dtype != "float32"
    try:
        with sharded_on_fake_cluster(workload, devices, layout.strategy, layout.shard_size,
                                     param_dtype=compute_dtype(layout.param_dtype) if low else None,
                                     reduce_dtype="float32" if low else None, tp=layout.tp):
            # MFU counts every parameter once, whole (a TP rank's graph reads its piece)
            trainable = sum(p.numel() for p in workload.model.parameters() if p.requires_grad)
            _run(workload, Recorder(GraphshardOptions(compiler="eager"), cluster=cluster))
    except DumpError as e:  # the model's TP plan cannot split it this way (heads, widths)
        raise PlanError(f"{target}: {e}") from None
    for probe in probes.values():
        probe.trainable_params = trainable
    if not probes:
        raise PlanError(f"{target}: no sharded training graph reached the backend (does the model "
                        "have trainable parameters read in forward?)")
    return probes


def convert_to_float8(model, config: dict | None = None) -> None:
    """Convert `model` as a float8 configuration's JSON says (FLOAT8_RECIPE; `config`: its
    Float8LinearConfig arguments): torchao's float8 training of the Linears whose widths divide
    by 16, their weights gathered in float8."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise PlanError("--dtypes float8 needs torchao: pip install 'graphshard[float8]'") from e
    convert_to_float8_training(
        model, config=Float8LinearConfig(**(FLOAT8_RECIPE["config"] if config is None
                                            else config)),
        module_filter_fn=lambda module, fqn: (module.in_features % 16 == 0
                                              and module.out_features % 16 == 0))


def _run(workload, recorder) -> None:
    import torch

    from graphshard._torch_compat import quiet_selective_checkpoint_notice
    from graphshard.compiler.collection_pause import full_collections_paused
    from graphshard.tools.dump.capture import CaptureComplete, caused_by

    torch.compiler.reset()
    try:
        # The policy is graphshard's: Dynamo's advice on a user's own selective
        # checkpointing policy, logged at every capture, is noise among the progress lines.
        with quiet_selective_checkpoint_notice(), full_collections_paused():
            workload.run(torch.compile(workload.model, backend=recorder, fullgraph=True))
    except Exception as e:
        if not caused_by(e, CaptureComplete):
            raise
    finally:
        torch.compiler.reset()


def capture_job(job: tuple) -> dict[Knobs, Probe] | str:
    """One capture in a worker process; the simulated events stay there (only --trace needs
    them, for one configuration). A layout the model's TP plan cannot split: why, instead."""
    try:
        probes = capture_probes(*job)
    except PlanError as e:
        if job[1].tp == 1:
            raise
        return str(e)
    for probe in probes.values():
        probe.estimates = None
    return probes


def _group_links(joint, cluster, devices: int, tp: int) -> dict:
    """Each process group's link: a shard group of s contiguous ranks stays in a node when
    s <= devices per node; a replica group (stride s) spans every node of the cluster."""
    from graphshard.passes.graph_utils import collective_group, is_collective, is_unshard
    from graphshard.passes.markers import UnshardSpec

    node = cluster.devices_per_node or devices
    links = {}
    for n in joint.graph.nodes:
        if is_unshard(n):
            spec = UnshardSpec.from_node(n)
            for position, (group, size) in enumerate(zip(spec.reduce_groups, spec.reduce_sizes)):
                # a shard group's ranks are tp devices apart (TP innermost)
                span = size * tp if position == 0 else devices - devices // size + 1
                links[group] = cluster.link(spans_nodes=span > node)
    for n in joint.graph.nodes:  # the TP plan's collectives: within a node
        if is_collective(n) and collective_group(n)[0] not in links:
            links[collective_group(n)[0]] = cluster.link(spans_nodes=False)
    return links


def _probes(compiler, joint, joint_inputs, kwargs, knobs: Sequence[Knobs], cluster,
            devices: int, tp: int) -> dict[Knobs, Probe]:
    """Evaluate every knob set on one joint graph: its partition and split stages (sharing
    the stages knob sets have in common), then the estimate."""
    from graphshard.compiler.partition import gradient_bytes, model_state_bytes, trainable_reads
    from graphshard.compiler.options import GraphshardOptions
    from graphshard.compiler.simulator import graph_estimate
    from graphshard.passes.graph_utils import unshard_specs
    from graphshard.passes.keep_gathered import keep_gathered
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
    compiler.split_context = compiler.split_context._replace(via_all_to_all=transport,
                                                             own_chunk_local=False)
    links = _group_links(joint, cluster, devices, tp)

    def probe(forward, backward) -> Probe:
        estimates = {kind: graph_estimate(gm, cluster, group_specs=links, graph_kind=kind)
                     for kind, gm in (("forward", forward), ("backward", backward))}
        memory = step_memory(forward, backward, estimates["forward"].memory,
                             estimates["backward"].memory)
        return Probe(
            step_s=sum(e.total_s for e in estimates.values()),
            model_compute_s=sum(e.model_compute_s for e in estimates.values()),
            flops=sum(e.flops for e in estimates.values()),
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
    # keep="all" is derived from the default's partition rather than partitioned again (a
    # min-cut partition is about a quarter of a capture's time)
    partitions = {}
    if "last" in by_keep:
        default = next(iter(by_keep["last"].values()))[0]
        partitions["last"] = compiler.with_options(options(default)).partition(
            joint, joint_inputs, **kwargs)
        if "all" in by_keep:
            partitions["all"] = keep_gathered(*partitions["last"], set(unshard_specs(joint)))
    probes = {}
    for keep, by_bucket in by_keep.items():
        lowerer = compiler.with_options(options(next(iter(by_bucket.values()))[0]))
        partitioned = partitions.get(keep) or lowerer.partition(joint, joint_inputs, **kwargs)
        lowered = lowerer.run_split_stages(*partitioned, stop_after="lowered")
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
    for _ in range(users - 1):
        yield copy.deepcopy(graphs)
    yield graphs


def _wire_bytes(estimates) -> float:
    from graphshard.compiler.cost_model import wire_bytes

    return sum(wire_bytes(c.kind, c.nbytes, c.group_size) for e in estimates.values()
               for c in e.collectives)
