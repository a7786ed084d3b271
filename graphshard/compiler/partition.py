"""The joint-graph partition: the joint stages decide what forward keeps gathered for backward
(reshard_after_forward), then Inductor's min-cut partition splits forward from backward; and
the joint graph's model state, which the memory model adds to each graph's own peak."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.fx as fx

from graphshard import _torch_compat as compat
from graphshard.compiler.auto_reshard import longest_fitting_prefix
from graphshard.compiler.cost_model import collective_time, compute_seconds
from graphshard.compiler.pipeline import run_pipeline
from graphshard.passes.graph_utils import is_reduce_grad, is_unshard, tensor_bytes, unshard_specs
from graphshard.passes.keep_gathered import keep_gathered
from graphshard.passes.liveness import step_memory
from graphshard.passes.markers import ReduceSpec, UnshardSpec
from graphshard.compiler.rank_agreement import agreed_minimum, decision_key, first_decision
from graphshard.passes.reshard_policy import (keeping_costs_peak_memory, last_forward_unit,
                                              params_to_keep, rank_units_to_keep,
                                              tag_reshard_policy, unit_costs)
from graphshard.passes.units import unit_of

if TYPE_CHECKING:
    from graphshard.compiler.backend import GraphshardCompiler


def partition(compiler: GraphshardCompiler, joint: fx.GraphModule, joint_inputs, **kwargs):
    """AOTAutograd's partition_fn: the joint stages (tag what stays gathered), then Inductor's
    min-cut partition into forward and backward."""
    ctx = compiler.context("joint")
    if compiler.options.reshard_after_forward == "auto":
        ctx = replace(ctx, keep_gathered=choose_kept_units(compiler, joint, joint_inputs, kwargs))
    # The default's tail beyond the last unit (the last block) is kept only where that costs no
    # peak memory: partitioned without it, and the partition that keeps it derived from that
    # one (keep_gathered) rather than partitioned again, to compare the two.
    decides_tail = ctx.keep_gathered is None
    joint = run_pipeline(joint, replace(ctx, keep_tail=False) if decides_tail else ctx,
                         compiler.observer)
    compiler.training_graphs += 1
    compiler.state_bytes, compiler.graph_memory = model_state_bytes(joint), {}
    forward, backward = compat.inductor_partition(joint, joint_inputs, **kwargs)
    option = compiler.options.reshard_after_forward
    tail = (params_to_keep(joint, option) - params_to_keep(joint, option, keep_tail=False)
            if decides_tail else frozenset())
    if not tail:
        return forward, backward
    kept = keep_gathered(forward, backward, tail)
    if kept is None:  # a partition this cannot rewrite: partition again, keeping the tail
        kept = compat.inductor_partition(run_pipeline(joint, ctx, compiler.observer),
                                         joint_inputs, **kwargs)
    # decided on the local batch: the first rank to decide decides for all
    if first_decision(decision_key(joint, tail, option),
                      lambda: _keeping_costs_peak_memory(compiler, joint, *kept, tail)):
        return forward, backward
    return kept


def _keeping_costs_peak_memory(compiler: GraphshardCompiler, joint, forward, backward,
                               params) -> bool:
    """`keeping_costs_peak_memory` with this compile's cost model."""
    group_size = max(spec.gather_size for name, spec in unshard_specs(joint).items()
                     if name in params)
    return keeping_costs_peak_memory(
        forward, backward, params, compute_seconds(compiler.cluster, forward, backward),
        lambda nbytes: collective_time("all_gather", nbytes, group_size, compiler.cluster),
        send_buffer="all_gather" in compiler.split_context.via_all_to_all)


def choose_kept_units(compiler: GraphshardCompiler, joint: fx.GraphModule, joint_inputs,
                      kwargs) -> frozenset[str]:
    """reshard_after_forward="auto": rank the units by gather time saved per byte kept, then
    keep the longest prefix of that ranking whose predicted peak, by the same passes and
    memory model as `graphshard dump`, fits memory_budget_mb (the whole ranking first,
    then a binary search: each probe partitions and estimates the step once). Ranks agree
    on the prefix length: the minimum over ranks, kept for a rank that later recompiles
    alone (the ranking itself uses only rank-invariant sizes)."""
    free = last_forward_unit(joint)  # kept at no cost in peak memory, as by default
    names = unshard_specs(joint)
    options, cluster = compiler.options, compiler.cluster

    def keep_set(units: list[str]) -> frozenset[str]:
        return free | {name for name in names if unit_of(name) in units}

    def partitioned(keep: frozenset[str]):
        tag_reshard_policy(joint, replace(compiler.context("joint"), keep_gathered=keep))
        return compat.inductor_partition(joint, joint_inputs, **kwargs)

    # One min-cut partition, keeping only the free units; each probe's partition is derived
    # from it (keep_gathered), not partitioned again.
    base = partitioned(free)
    regathered = {n for n, spec in unshard_specs(base[1]).items() if spec.gather_size > 1}

    def predicted_peak(keep: frozenset[str]) -> int:
        graphs = keep_gathered(*base, keep - free) or partitioned(keep)
        forward, backward = compiler.with_options(options).run_split_stages(*graphs)
        return model_state_bytes(joint) + step_memory(forward, backward).transient_bytes

    budget = options.memory_budget_mb * 2**20
    base_peak = predicted_peak(free)
    ranked = rank_units_to_keep(unit_costs(joint, regathered, lambda nbytes, group_size:
                                           collective_time("all_gather", nbytes, group_size,
                                                           cluster)))

    def longest_prefix_that_fits() -> int:
        if base_peak > budget:
            warnings.warn(f"graphshard: memory_budget_mb={options.memory_budget_mb} is below "
                          f"the predicted peak with every unit resharded "
                          f"({base_peak / 2**20:.1f} MiB): no unit is kept gathered beyond the "
                          "default")
            return 0
        return longest_fitting_prefix(
            len(ranked), lambda n: predicted_peak(keep_set(ranked[:n])), budget)

    # decided on the local batch: the minimum over ranks, taken once, for a recompile too
    fits = agreed_minimum(decision_key(joint, names, ("auto", options.memory_budget_mb)),
                          longest_prefix_that_fits, agree_on_minimum)
    return keep_set(ranked[:fits])


def agree_on_minimum(value: int) -> int:
    """The minimum of `value` over all ranks (decisions that change collectives must match)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    with compat.real_tensors():  # called while compiling, under the compile's fake mode
        agreed = torch.tensor([value], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return int(agreed.item())


def model_state_bytes(joint: fx.GraphModule) -> int:
    """Per-rank bytes held across the step outside its graphs: the joint graph's inputs
    (parameter shards, buffers, the batch) plus two AdamW states per trainable shard. Not the
    gradients: the backward produces them (they are in its peak); held across micro-batches
    only under gradient accumulation (`gradient_bytes`)."""
    nodes = joint.graph.nodes
    inputs = sum(tensor_bytes(n.meta["val"]) for n in nodes  # primals: not the tangents
                 if n.op == "placeholder" and n.name.startswith("primals")
                 and isinstance(n.meta.get("val"), torch.Tensor))
    return inputs + 2 * gradient_bytes(joint)


def gradient_bytes(joint: fx.GraphModule) -> int:
    """Per-rank bytes of the gradients: one per trainable shard, in the shard's dtype."""
    return sum(tensor_bytes(read.args[0].meta["val"]) for read in trainable_reads(joint).values())


def trainable_reads(joint: fx.GraphModule) -> dict[str, fx.Node]:
    """Parameter name -> its unshard node in a joint graph, for the parameters whose gradient
    is reduced (the trainable ones); the node's first argument is this rank's shard."""
    reduced = {ReduceSpec.from_node(n).name for n in joint.graph.nodes if is_reduce_grad(n)}
    reads = {}
    for node in joint.graph.nodes:
        if is_unshard(node):
            name = UnshardSpec.from_node(node).name
            if name in reduced:
                reads.setdefault(name, node)
    return reads
