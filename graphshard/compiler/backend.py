"""The `graphshard` torch.compile backend: Dynamo hands it a graph, it runs the stages of
`pipeline.PIPELINE` on it and on the graphs AOTAutograd derives from it, and hands the result
to Inductor.

    Dynamo graph -> checks (checks.py) -> dynamo stages -> AOTAutograd: joint graph -> joint
    stages and the partition (partition.py) -> forward / backward: split stages -> Inductor

What AOTAutograd may cache is decided in compile_cache.py.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Sequence

import torch.fx as fx

from graphshard import _torch_compat as compat
from graphshard.compiler import ops  # noqa: F401  (registers torch.ops.graphshard.*)
from graphshard.compiler.collection_pause import full_collections_paused
from graphshard.compiler.checks import (check_all_parameters_sharded,
                                        check_gathered_weights_not_edited,
                                        check_parameters_read_as_attributes,
                                        check_unsharded_model_trains_alone)
from graphshard.compiler.compile_cache import reuses_cache, salt_cache_key
from graphshard.compiler.cost_model import ClusterSpec
from graphshard.compiler.dynamo_graph import SplitContext, has_markers, split_context
from graphshard.compiler.host_compile import (compile_once_per_host, host_compile_key,
                                              log_per_rank_compile, per_rank_compile_reason,
                                              takes_device_mesh)
from graphshard.compiler.options import GraphshardOptions
from graphshard.compiler import rank_agreement
from graphshard.compiler.partition import agree_on_minimum, partition
from graphshard.compiler.schedule_check import check_schedule, record_served_from_cache
from graphshard.compiler.pipeline import StageObserver, run_pipeline
from graphshard.passes.context import PassContext
from graphshard.passes.liveness import MemoryEstimate, graph_memory


class GraphshardCompiler:
    """A Dynamo backend; `observer` sees every stage's graph (used by `graphshard dump`) of
    each compile this process runs: all of them unless `aot_cache=True` lets AOTAutograd's
    cache serve it (compile_cache.reuses_cache)."""

    def __init__(self, options: GraphshardOptions, observer: StageObserver | None = None,
                 cluster: ClusterSpec | None = None, *, aot_cache: bool | None = None):
        self.options = options
        self.observer = observer
        self.aot_cache = aot_cache  # see compile_cache.reuses_cache
        self.cluster = cluster or (ClusterSpec.from_json(options.cluster) if options.cluster
                                   else ClusterSpec.default())
        self.split_context = SplitContext()  # of the Dynamo graph being compiled
        # The memory model's view of the compiled step (`predicted_peak_bytes`).
        self.training_graphs = 0  # joint graphs partitioned (one per Dynamo graph)
        self.state_bytes: int | None = None
        self.graph_memory: dict[str, MemoryEstimate] = {}
        # why AOTAutograd's cache would not store the Dynamo graph compiled last (None: it would)
        self.cache_bypass: str | None = None
        self.takes_device_mesh = False  # ... and whether it takes a DeviceMesh (a TP plan's)

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
        # A probe prices every chunk through the transport (N gather copies, not N - 1): the
        # form the planner's fit and fidelity were measured with.
        other.split_context = self.split_context._replace(own_chunk_local=False)
        return other

    def run_split_stages(self, forward: fx.GraphModule, backward: fx.GraphModule, *,
                         stop_after: str | None = None, resume: bool = False):
        """The split stages on a partition's forward and backward (`run_pipeline`'s options)."""
        return tuple(run_pipeline(gm, self.context(kind, self.split_context), self.observer,
                                  stop_after=stop_after, resume=resume)
                     for kind, gm in (("forward", forward), ("backward", backward)))

    def context(self, graph_kind: str, split: SplitContext = SplitContext()) -> PassContext:
        """What a stage of `graph_kind`'s graph may know besides the graph."""
        return PassContext(graph_kind, self.options, split.param_order, self.cluster,
                           split.via_all_to_all, own_chunk_local=split.own_chunk_local)

    def partition(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        """AOTAutograd's partition_fn (partition.partition)."""
        return partition(self, joint, joint_inputs, **kwargs)

    def _graph_compiler(self, graph_kind: str, split: SplitContext, dynamo_key: str,
                        compiled: list[str]):
        def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]):
            compiled.append(graph_kind)
            with full_collections_paused():  # (a backward compiled lazily, at its first run)
                gm = run_pipeline(gm, self.context(graph_kind, split), self.observer)
                self.graph_memory[graph_kind] = graph_memory(gm, graph_kind)
                if self.options.check_schedule:
                    check_schedule(gm, graph_kind, dynamo_key=dynamo_key)
                if self.options.compiler == "eager":
                    return compat.boxed(gm.forward)
                # Inductor mutates the graph it compiles; observers already hold their copies.
                return compat.inductor_compile_graph(gm, example_inputs, graph_kind)

        return compile_graph

    @full_collections_paused()
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        if not has_markers(gm):
            # Not sharded by graphshard: compile as the backend we hand off to does.
            check_unsharded_model_trains_alone(example_inputs)
            if self.options.compiler == "eager":
                return gm.forward
            return compat.inductor_compile(gm, example_inputs)
        check_all_parameters_sharded(example_inputs)
        check_parameters_read_as_attributes(gm, example_inputs)
        check_gathered_weights_not_edited(gm)
        gm = run_pipeline(gm, self.context("dynamo"), self.observer)
        split = self.split_context = split_context(gm, self.options)
        # what identifies this compile on every rank, whether it runs or comes from the cache
        dynamo_key = hashlib.sha256(f"{gm.code}{self.options}".encode()).hexdigest()[:24]
        compiled: list[str] = []
        compilers = {kind: self._graph_compiler(kind, split, dynamo_key, compiled)
                     for kind in ("forward", "backward", "inference")}
        observed = self.observer is not None
        cached = (reuses_cache(self.options, aot_cache=self.aot_cache, observed=observed)
                  and salt_cache_key(gm, self.options, self.cluster, split, observed=observed))
        if cached:
            compilers = {kind: compat.cacheable_graph_compiler(fn) for kind, fn in compilers.items()}
        backend = compat.aot_autograd_backend(
            fw_compiler=compilers["forward"],
            bw_compiler=compilers["backward"],
            inference_compiler=compilers["inference"],
            partition_fn=self.partition,
            decompositions=compat.inductor_decompositions(),
            keep_inference_input_mutations=True,
        )

        def compile_graphs():
            with compat.fake_mode_of_inputs(example_inputs), compat.lazy_graph_modules():
                return backend(gm, example_inputs)

        # float8's autograd.Functions (torchao's, ours) are keyed by name, not refused
        with compat.keyed_package_functions_cacheable(gm):
            self.cache_bypass = compat.aot_cache_bypass_reason(gm)
            self.takes_device_mesh = takes_device_mesh(example_inputs)
            reason = per_rank_compile_reason(self.options, cached=cached, bypass=self.cache_bypass,
                                             takes_device_mesh=self.takes_device_mesh)
            if reason is None:
                key = host_compile_key(gm.code, compat.cache_key_salt(gm), example_inputs,
                                       lambda obj: compat.cache_key_of_object(gm, obj))
                # the claimant stores the whole compile, backward included, before its first step
                with compat.backward_compiled_with_forward():
                    compiled_fn = compile_once_per_host(
                        key, compile_graphs, announce=lambda: self.options.check_schedule
                        and record_served_from_cache(dynamo_key),
                        join=lambda: agree_on_minimum(rank_agreement.NEUTRAL_MINIMUM))
            else:
                log_per_rank_compile(reason)
                compiled_fn = compile_graphs()
        if self.options.check_schedule and not compiled:  # served by AOTAutograd's cache
            record_served_from_cache(dynamo_key)
        return compiled_fn


class OptionsError(ValueError, compat.short_traceback_error()):
    """Bad `options` to torch.compile(backend="graphshard"), raised at the first compilation.

    torch.compile only stores `options` and Dynamo passes them to the backend when it compiles
    the first graph, so that is the earliest they can be checked. Dynamo wraps anything a
    backend raises in BackendCompilerFailed, whose first line is "backend='graphshard' raised:",
    except its own ShortenTraceback (graphshard/_torch_compat/compiling.py), which it re-raises as
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
