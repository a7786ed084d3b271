"""The `graphshard` torch.compile backend: one list of stages, each a pass over a GraphModule.

    Dynamo graph    -- merged -->                  (merge_duplicate_unshards)
    AOTAutograd joint graph -- tagged -->          (tag_reshard_policy), then the min-cut partition
    forward / backward graphs -- partitioned --> lowered --> bucketed --> scheduled --> transport
    --> Inductor (compile_fx_inner)

`PIPELINE` below is that list; `graphshard dump --stage` takes its stage names from it, and an
observer sees every stage's graph. Each stage runs on one family of graphs and names the stages
that must have run on the same graph before it: running one out of order fails loudly.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor

import graphshard as graphshard_package
import graphshard.passes as passes_package
from graphshard import _torch_compat as compat
from graphshard.compiler import ops  # noqa: F401  (registers torch.ops.graphshard.*)
from graphshard.compiler.auto_reshard import longest_fitting_prefix
from graphshard.compiler.cost_model import (ClusterSpec, collective_node_cost, collective_time,
                                            node_cost)
from graphshard.compiler.options import GraphshardOptions
from graphshard.passes.context import PassContext
from graphshard.passes.graph_utils import is_reduce_grad, is_unshard, tensor_bytes
from graphshard.passes.liveness import MemoryEstimate, graph_memory, saved_activations, step_memory
from graphshard.passes.markers import ReduceSpec, UnshardSpec
from graphshard.passes.bucket_collectives import bucket_collectives
from graphshard.passes.insert_collectives import insert_collectives
from graphshard.passes.all_gather_via_all_to_all import all_gather_via_all_to_all
from graphshard.passes.free_collective_buffers import free_collective_buffers
from graphshard.passes.merge_duplicate_unshards import merge_duplicate_unshards
from graphshard.passes.reduce_scatter_via_all_to_all import reduce_scatter_via_all_to_all
from graphshard.passes.reorder_collectives import ReorderPolicy, reorder_collectives
from graphshard.passes.reshard_policy import (keeping_costs_peak_memory, last_forward_unit,
                                               params_to_keep, rank_units_to_keep, reshard_unit,
                                               tag_reshard_policy, unit_costs)

def _schedule(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    budget = ctx.options.max_inflight_mb
    cluster = ctx.cluster or ClusterSpec.default()  # PassContext's cluster None: the default
    policy = ReorderPolicy(
        prefetch=ctx.options.prefetch,
        max_inflight_bytes=math.inf if budget is None else budget * 2**20,
        within_peak=ctx.options.overlap_within_peak,
        freed_inputs=frozenset(saved_activations(gm)) if ctx.graph_kind == "backward" else frozenset(),
        via_all_to_all=ctx.via_all_to_all,
        compute_seconds=lambda node: node_cost(node, cluster).seconds,
        collective_seconds=lambda node: collective_node_cost(node, cluster).seconds,
    )
    return reorder_collectives(gm, policy)


@dataclass(frozen=True)
class Stage:
    name: str
    graphs: str  # "dynamo", "joint", or "split": the forward, backward and inference graphs
    run: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    requires: tuple[str, ...] = ()  # stages that must already have run on this graph
    enabled: Callable[[GraphshardOptions], bool] = lambda options: True


def _transport(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Adapt collectives to the process group's transport (after all analysis)."""
    if "reduce_scatter" in ctx.via_all_to_all:
        gm = reduce_scatter_via_all_to_all(gm, ctx)
    if "all_gather" in ctx.via_all_to_all:
        gm = all_gather_via_all_to_all(gm, ctx)
    return gm


def _uses_gloo(gm: fx.GraphModule) -> bool:
    """Whether the markers' process groups are gloo's (their backend travels in each marker)."""
    backends = {UnshardSpec.from_node(node).backend for node in _all_nodes(gm) if is_unshard(node)}
    return backends == {"gloo"}


def _group_ranks(gm: fx.GraphModule) -> dict[str, int]:
    """This process's rank in each process group the markers name (gather and reduce groups)."""
    names = set()
    for node in _all_nodes(gm):
        if is_unshard(node):
            spec = UnshardSpec.from_node(node)
            names.update((spec.gather_group, *spec.reduce_groups))
    return {name: compat.process_group_rank(name) for name in sorted(names) if name}


def _param_order(gm: fx.GraphModule) -> dict[str, int]:
    """Parameter name -> registration index, from the markers (bucketing packs in this order)."""
    specs = (UnshardSpec.from_node(node) for node in _all_nodes(gm) if is_unshard(node))
    return {spec.name: spec.order for spec in specs}


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


def _unshard_specs(gm: fx.GraphModule) -> dict[str, UnshardSpec]:
    specs = (UnshardSpec.from_node(n) for n in gm.graph.nodes if is_unshard(n))
    return {spec.name: spec for spec in specs}


def agree_on_minimum(value: int) -> int:
    """The minimum of `value` over all ranks (decisions that change collectives must match)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    with compat.real_tensors():  # called while compiling, under the compile's fake mode
        agreed = torch.tensor([value], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return int(agreed.item())


def _partitioned(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Not a pass: marks a graph as the partitioner's output (what the later stages expect)."""
    return gm


PIPELINE: tuple[Stage, ...] = (
    Stage("merged", "dynamo", merge_duplicate_unshards),
    Stage("tagged", "joint", tag_reshard_policy),
    Stage("partitioned", "split", _partitioned),
    Stage("lowered", "split", insert_collectives, requires=("partitioned",)),
    Stage("bucketed", "split", bucket_collectives, requires=("lowered",),
          enabled=lambda options: options.bucket_mb > 0),
    Stage("scheduled", "split", _schedule, requires=("bucketed",),
          enabled=lambda options: options.reorder),
    # After all analysis: the analysis reads collectives, the transport rewrites them.
    Stage("transport", "split", _transport, requires=("scheduled",),
          enabled=lambda options: bool(options.via_all_to_all(on_gloo=True))),
    # Last: frees what the collectives that run actually hold.
    Stage("freed", "split", free_collective_buffers, requires=("lowered",)),
)
STAGES: tuple[str, ...] = tuple(stage.name for stage in PIPELINE)
_FAMILY = {"dynamo": "dynamo", "joint": "joint", "forward": "split", "backward": "split",
           "inference": "split"}

# Observer of each stage's graph: (graph_kind, stage_name, graph_module) -> None
StageObserver = Callable[[str, str, fx.GraphModule], None]


def _all_nodes(gm: fx.GraphModule):
    """Nodes of the graph and of its subgraphs (activation-checkpoint and other HOP bodies)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from module.graph.nodes


@functools.cache
def _source_digest() -> str:
    """Digest of graphshard's Python sources (the package and its passes): a changed pass must
    not be served a graph compiled by the old one from AOTAutograd's cache."""
    digest = hashlib.sha256()
    for package in (graphshard_package, passes_package):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def has_markers(gm: fx.GraphModule) -> bool:
    return any(is_unshard(node) or is_reduce_grad(node) for node in _all_nodes(gm))


def _check_all_parameters_sharded(example_inputs: Sequence[Any]) -> None:
    # A parameter added after shard() (an adapter, a re-assigned weight) would get no gradient
    # reduction at all: each rank would silently train its own copy.
    plain = [tuple(x.shape) for x in example_inputs
             if isinstance(x, torch.nn.Parameter) and x.requires_grad and not isinstance(x, DTensor)]
    if plain:
        raise ValueError(
            f"{len(plain)} trainable parameter(s) of shapes {plain[:4]} are not sharded (added or "
            "replaced after graphshard.shard?): their gradients would never be averaged across "
            "ranks. Create all parameters before graphshard.shard(model), or freeze them."
        )


def _check_parameters_read_as_attributes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    # Code that reads a parameter through module.parameters() (an L2 penalty, DDP's
    # `0 * sum(p.sum() ...)`) gets the sharded DTensor itself, not the gathered weight: its
    # result is this rank's part, and mixing it with the plain tensors of the rest of the
    # forward fails only in backward, inside torch.
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    read = [_parameter_name(node) for node, value in zip(placeholders, example_inputs)
            if isinstance(value, torch.nn.Parameter) and isinstance(value, DTensor)]
    if read:
        raise ValueError(
            f"forward reads parameter(s) {', '.join(read)} through module.parameters() (or "
            "named_parameters(), _parameters): after graphshard.shard these hold this rank's "
            "shard as a DTensor (what optimizers and checkpoints see), not the full weight. "
            "Read parameters as module attributes (module.weight), which graphshard gathers, "
            "e.g. sum(getattr(m, n).pow(2).sum() for m in self.modules() for n, _ in "
            "m.named_parameters(recurse=False)); or compute such a term outside forward, from "
            "the DTensor parameters.")


def _check_gathered_weights_not_edited(gm: fx.GraphModule) -> None:
    # Under compile a parameter read is the gathered weight, a copy (eagerly a GatheredWeight
    # writes edits back to the shard): an in-place edit of it inside the graph would change
    # the copy only, and the shard would silently keep its old values. Dynamo ran the forward
    # on fake tensors, so the copy's version counter shows such an edit, even one hidden inside
    # a function (nn.Embedding's max_norm renormalises the rows it reads in place).
    def edited_in_place(node: fx.Node) -> bool:
        value = node.meta.get("example_value")
        # (an inference tensor has no version counter: nothing to see, and nothing to train)
        return isinstance(value, torch.Tensor) and not value.is_inference() and value._version > 0

    edited = dict.fromkeys(UnshardSpec.from_node(node).name for node in _all_nodes(gm)
                           if is_unshard(node) and edited_in_place(node))
    if edited:
        raise ValueError(
            f"forward edits parameter(s) {', '.join(edited)} in place (nn.Embedding(max_norm=...) "
            "renormalises its weight in place when it reads it; so does any in-place op on "
            "module.weight): under torch.compile graphshard reads a gathered copy of the "
            "weight, and the edit would not reach this rank's shard. Make the edit outside the "
            "compiled forward, on the DTensor parameter (module._parameters[name], under "
            "torch.no_grad()), or run that module eagerly (module.forward = "
            "torch.compiler.disable(module.forward)), where graphshard writes such edits back.")


def _parameter_name(placeholder: fx.Node) -> str:
    """`layers.0.weight` for a graph input Dynamo read as L['self']._modules['layers']..."""
    source = compat.graph_input_source(placeholder) or placeholder.name
    keys = re.findall(r"\['([^']*)'\]", source)
    return ".".join(keys[1:]) if len(keys) > 1 else source


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, observer: StageObserver | None = None,
                 *, stop_after: str | None = None, resume: bool = False) -> fx.GraphModule:
    """Run the stages of `ctx.graph_kind`'s family, in order, up to `stop_after` (default: to
    the end); with `resume`, only those not yet run on `gm` (a graph stopped earlier: option
    sets that differ only in later stages share the earlier ones, as in the planner). A
    disabled stage leaves the graph unchanged but still counts as run (its successors'
    requirements hold)."""
    family = [stage for stage in PIPELINE if stage.graphs == _FAMILY[ctx.graph_kind]]
    if stop_after is not None and stop_after not in {stage.name for stage in family}:
        raise ValueError(f"stop_after={stop_after!r} is not a stage of the {ctx.graph_kind} graph: "
                         f"{[stage.name for stage in family]}")
    for stage in family:
        done = gm.meta.get("graphshard_stages", ())
        if resume and stage.name in done:
            if stage.name == stop_after:
                break
            continue
        missing = [name for name in stage.requires if name not in done]
        if missing:
            raise RuntimeError(f"graphshard stage {stage.name!r} needs {missing} to have run on "
                               f"this {ctx.graph_kind} graph first; it has run {list(done)}")
        if stage.enabled(ctx.options):
            gm = stage.run(gm, ctx)
        gm.meta["graphshard_stages"] = (*done, stage.name)
        if observer:
            observer(ctx.graph_kind, stage.name, gm)
        if stage.name == stop_after:
            break
    return gm


class SplitContext(NamedTuple):
    """What the split stages (forward, backward) know of the Dynamo graph they come from."""

    param_order: Mapping[str, int] = {}  # parameter name -> registration index
    via_all_to_all: frozenset[str] = frozenset()  # collective kinds exchanged by all-to-all
    group_ranks: Mapping[str, int] = {}  # process group name -> this process's rank in it


class GraphshardCompiler:
    """A Dynamo backend; `observer` sees every stage's graph (used by `graphshard dump`)."""

    def __init__(self, options: GraphshardOptions, observer: StageObserver | None = None,
                 cluster: ClusterSpec | None = None, *, aot_cache: bool = True):
        self.options = options
        self.observer = observer
        self.aot_cache = aot_cache  # see _reuses_cache
        self.cluster = cluster or (ClusterSpec.from_json(options.cluster) if options.cluster
                                   else ClusterSpec.default())
        self.split_context = SplitContext()  # of the Dynamo graph being compiled
        # The memory model's view of the compiled step (`predicted_peak_bytes`).
        self.training_graphs = 0  # joint graphs partitioned (one per Dynamo graph)
        self.state_bytes: int | None = None
        self.graph_memory: dict[str, MemoryEstimate] = {}

    @property
    def predicted_peak_bytes(self) -> int | None:
        """Per-rank peak of the training step compiled last, as the memory model predicts it
        (the number `graphshard dump` shows and reshard_after_forward="auto" keeps within the
        budget): model state plus the larger of the forward's and the backward's own peak.
        None until both of its graphs are compiled (the backward compiles at the first
        backward), for a compile served from AOTAutograd's cache (pass aot_cache=False), and
        for a model Dynamo split into several graphs (each graph's memory is modelled on its
        own; their sum over a step is not)."""
        if (self.training_graphs != 1 or self.state_bytes is None
                or not {"forward", "backward"} <= self.graph_memory.keys()):
            return None
        return self.state_bytes + max(self.graph_memory[kind].peak_transient_bytes
                                      for kind in ("forward", "backward"))

    def with_options(self, options: GraphshardOptions) -> "GraphshardCompiler":
        """The same compiler (cluster, the graph being compiled) with other options and no
        observer: what it lowers is a probe (the planner's, "auto"'s), not the compiled step."""
        other = GraphshardCompiler(options, None, self.cluster)
        # A probe's prediction must be every rank's: no rank-specific lowering in it.
        other.split_context = self.split_context._replace(group_ranks={})
        return other

    def lower_joint(self, joint: fx.GraphModule, joint_inputs, **partition_kwargs):
        """The forward and backward graphs this backend hands Inductor for a joint graph (what
        the planner evaluates per option set)."""
        forward, backward = self.partition(joint, joint_inputs, **partition_kwargs)
        return self.run_split_stages(forward, backward)

    def run_split_stages(self, forward: fx.GraphModule, backward: fx.GraphModule, *,
                         stop_after: str | None = None, resume: bool = False):
        """The split stages on a partition's forward and backward (`run_pipeline`'s options)."""
        return tuple(run_pipeline(gm, self._context(kind, self.split_context), self.observer,
                                  stop_after=stop_after, resume=resume)
                     for kind, gm in (("forward", forward), ("backward", backward)))

    def _context(self, graph_kind: str, split: SplitContext = SplitContext()) -> PassContext:
        return PassContext(graph_kind, self.options, split.param_order, self.cluster,
                           split.via_all_to_all, group_ranks=split.group_ranks)

    def partition(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        """AOTAutograd's partition_fn: the joint stages (tag what stays gathered), then Inductor's
        min-cut partition into forward and backward."""
        ctx = self._context("joint")
        if self.options.reshard_after_forward == "auto":
            ctx = replace(ctx, keep_gathered=self._choose_kept_units(joint, joint_inputs, kwargs))
        joint = run_pipeline(joint, ctx, self.observer)
        self.training_graphs += 1
        self.state_bytes, self.graph_memory = model_state_bytes(joint), {}
        forward, backward = compat.inductor_partition(joint, joint_inputs, **kwargs)
        if ctx.keep_gathered is None:
            # The default's tail beyond the last unit (the last block), kept only where the
            # partition shows that costs no peak memory; else partitioned again without it.
            option = self.options.reshard_after_forward
            tail = params_to_keep(joint, option) - params_to_keep(joint, option, keep_tail=False)
            if tail and self._keeping_costs_peak_memory(joint, forward, backward, tail):
                joint = run_pipeline(joint, replace(ctx, keep_tail=False), self.observer)
                forward, backward = compat.inductor_partition(joint, joint_inputs, **kwargs)
        return forward, backward

    def _keeping_costs_peak_memory(self, joint, forward, backward, params) -> bool:
        """`keeping_costs_peak_memory` with this compile's cost model."""
        group_size = max(spec.gather_size for name, spec in _unshard_specs(joint).items()
                         if name in params)
        return keeping_costs_peak_memory(
            forward, backward, params, lambda node: node_cost(node, self.cluster).seconds,
            lambda nbytes: collective_time("all_gather", nbytes, group_size, self.cluster),
            send_buffer="all_gather" in self.split_context.via_all_to_all)

    def _choose_kept_units(self, joint: fx.GraphModule, joint_inputs, kwargs) -> frozenset[str]:
        """reshard_after_forward="auto": rank the units by gather time saved per byte kept, then
        keep the longest prefix of that ranking whose predicted peak, by the same passes and
        memory model as `graphshard dump`, fits memory_budget_mb (the whole ranking first,
        then a binary search: each probe partitions and estimates the step once). Ranks agree
        on the prefix length: the minimum over ranks (the ranking itself uses only
        rank-invariant sizes)."""
        free = last_forward_unit(joint)  # kept at no cost in peak memory, as by default
        names = _unshard_specs(joint)

        def keep_set(units: list[str]) -> frozenset[str]:
            return free | {name for name in names if reshard_unit(name) in units}

        def predicted_peak(keep: frozenset[str]):
            tag_reshard_policy(joint, replace(self._context("joint"), keep_gathered=keep))
            forward, backward = compat.inductor_partition(joint, joint_inputs, **kwargs)
            regathered = {n for n, spec in _unshard_specs(backward).items() if spec.gather_size > 1}
            forward, backward = self.with_options(self.options).run_split_stages(forward, backward)
            return model_state_bytes(joint) + step_memory(forward, backward).transient_bytes, regathered

        budget = self.options.memory_budget_mb * 2**20
        base_peak, regathered = predicted_peak(free)
        ranked = rank_units_to_keep(unit_costs(joint, regathered, lambda nbytes, group_size:
                                               collective_time("all_gather", nbytes, group_size,
                                                               self.cluster)))
        if base_peak > budget:
            warnings.warn(f"graphshard: memory_budget_mb={self.options.memory_budget_mb} is below "
                          f"the predicted peak with every unit resharded ({base_peak / 2**20:.1f} "
                          "MiB): no unit is kept gathered beyond the default")
            ranked = []
        fits = longest_fitting_prefix(
            len(ranked), lambda n: predicted_peak(keep_set(ranked[:n]))[0], budget)
        return keep_set(ranked[:agree_on_minimum(fits)])

    def _reuses_cache(self) -> bool:
        """Whether AOTAutograd may serve this compile from its cache (a job restarting on
        unchanged code skips tracing, partitioning and our passes, as plain torch.compile does).
        Not where the graphs themselves are wanted: by an observer (`graphshard dump`) or for
        `predicted_peak_bytes` (the bench: aot_cache=False); not for "eager", which produces
        nothing Inductor can store; not for "auto", which agrees on its choice with the other
        ranks during the compile (a rank served from the cache would never join that
        collective)."""
        return (self.aot_cache and self.observer is None and self.options.compiler == "inductor"
                and self.options.reshard_after_forward != "auto")

    def _cache_salt(self) -> str:
        """What the compiled graphs depend on beyond the Dynamo graph: our options, the cluster
        the cost model schedules for, graphshard's code, and the ranks the transport's graphs
        are specific to (ranks sharing a cache directory must not load each other's)."""
        ranks = sorted(self.split_context.group_ranks.items())
        return "graphshard-" + hashlib.sha256(
            repr((self.options, self.cluster, _source_digest(), ranks)).encode()).hexdigest()[:32]

    def _graph_compiler(self, graph_kind: str, split: SplitContext):
        def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]):
            ctx = self._context(graph_kind, split)
            gm = run_pipeline(gm, ctx, self.observer)
            self.graph_memory[graph_kind] = graph_memory(gm, graph_kind)
            if self.options.compiler == "eager":
                return compat.boxed(gm.forward)
            # Inductor mutates the graph it compiles; observers already hold their copies.
            return compat.inductor_compile_graph(gm, example_inputs, graph_kind)

        return compile_graph

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        if not has_markers(gm):
            # Not sharded by graphshard: behave exactly like the backend we hand off to.
            if self.options.compiler == "eager":
                return gm.forward
            return compat.inductor_compile(gm, example_inputs)
        _check_all_parameters_sharded(example_inputs)
        _check_parameters_read_as_attributes(gm, example_inputs)
        _check_gathered_weights_not_edited(gm)
        gm = run_pipeline(gm, self._context("dynamo"), self.observer)
        via_all_to_all = self.options.via_all_to_all(on_gloo=_uses_gloo(gm))
        split = SplitContext(_param_order(gm), via_all_to_all,
                             _group_ranks(gm) if via_all_to_all else {})
        self.split_context = split
        compilers = {kind: self._graph_compiler(kind, split)
                     for kind in ("forward", "backward", "inference")}
        # A backend id set by Dynamo itself (precompile packaging) is not ours to replace.
        if self._reuses_cache() and getattr(gm, "_backend_id", None) is None:
            compilers = {kind: compat.cacheable_graph_compiler(fn) for kind, fn in compilers.items()}
            compat.salt_aot_autograd_cache_key(gm, self._cache_salt())
        backend = compat.aot_autograd_backend(
            fw_compiler=compilers["forward"],
            bw_compiler=compilers["backward"],
            inference_compiler=compilers["inference"],
            partition_fn=self.partition,
            decompositions=compat.inductor_decompositions(),
            keep_inference_input_mutations=True,
        )
        with compat.fake_mode_of_inputs(example_inputs), compat.lazy_graph_modules():
            return backend(gm, example_inputs)


class OptionsError(ValueError, compat.short_traceback_error()):
    """Bad `options` to torch.compile(backend="graphshard"), raised at the first compilation.

    torch.compile only stores `options` and Dynamo passes them to the backend when it compiles
    the first graph, so that is the earliest they can be checked. Dynamo wraps anything a
    backend raises in BackendCompilerFailed, whose first line is "backend='graphshard' raised:",
    except its own ShortenTraceback (graphshard/_torch_compat.py), which it re-raises as
    is, with its frames cut above `first_useful_frame`: so our message is the error's first
    line and the traceback ends in graphshard_backend. Still a ValueError to catch."""

    def __init__(self, message: str, first_useful_frame):
        ValueError.__init__(self, message)
        self.first_useful_frame = first_useful_frame


def graphshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                       options: dict | None = None, mode: str | None = None):
    """Entry point of `torch.compile(model, backend="graphshard", options={...})`."""
    try:
        if mode not in (None, "default"):  # torch.compile passes its mode= to any backend
            raise ValueError(
                f"graphshard takes no torch.compile mode= (got {mode!r}): drop it. graphshard "
                "hands its graphs to Inductor under Inductor's global settings, so set those "
                "instead (e.g. torch._inductor.config.max_autotune = True); CUDA graphs "
                "(mode='reduce-overhead') are not supported around graphshard's collectives.")
        parsed = GraphshardOptions.from_dict(options)
    except ValueError as exc:
        raise OptionsError(str(exc), inspect.currentframe()) from None
    return GraphshardCompiler(parsed)(gm, example_inputs)

