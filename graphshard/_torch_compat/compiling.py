"""Dynamo, AOTAutograd and Inductor: the hooks graphshard's backend compiles through.

Part of graphshard._torch_compat (see its docstring): every public name here is re-exported there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx


def aot_autograd_backend(**kwargs) -> Callable:
    """AOTAutograd with our forward/backward compilers and partition function.
    Public replacement: none (torch.compile exposes backends, not AOTAutograd's hooks)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**kwargs)


def graph_input_source(placeholder: fx.Node) -> str | None:
    """Where Dynamo read a graph input from, as Python (L['self']._modules['lin']...), or None.
    Public replacement: none."""
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return None if source is None else str(source.name)


def lazy_graph_modules():
    """Graph modules made inside generate their Python code only when it is used (called,
    printed), as inside Inductor's own compile: our passes recompile after each rewrite, and
    Inductor reads the graph, never the code (a tenth of a plan's time went to generating code
    no one ran). Public replacement: none."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def _lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as a graph module whose code is generated when used (see `lazy_graph_modules`)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    lazy = _LazyGraphModule.from_graphmodule(gm)
    if lazy is not gm:
        lazy.meta.update(gm.meta)
    return lazy


def mark_static(tensor: torch.Tensor) -> None:
    """Dynamo treats `tensor`'s shape as static, even under dynamic=True or after a shape
    change elsewhere. Public replacement: none (torch.compiler has no mark_static)."""
    torch._dynamo.mark_static(tensor)


def boxed(fn: Callable) -> Callable:
    """Wrap a graph's forward in AOTAutograd's boxed calling convention (compiler="eager").
    Public replacement: none."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


def inductor_partition(joint: fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's min-cut partitioner (it honours the recompute tags we set on the joint graph).
    Its joint-graph rewrites (pattern matching: about half of a partition's time on a large
    graph) run on the first partition of `joint` only: they rewrite the graph in place, and a
    joint graph partitioned again under other recompute tags (the default's tail check, each
    "auto" probe, each reshard decision the planner weighs) needs them no more.
    Public replacement: none."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import partition_fn

    from graphshard.passes import meta_keys

    rewritten = joint.meta.get(meta_keys.JOINT_PASSES_RUN, False)
    with inductor_config.patch(use_joint_graph_passes=inductor_config.use_joint_graph_passes
                               and not rewritten):
        forward, backward = partition_fn(joint, joint_inputs, **kwargs)
    joint.meta[meta_keys.JOINT_PASSES_RUN] = True
    return _lazy(forward), _lazy(backward)  # the partitioner makes eager graph modules


def inductor_compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], graph_kind: str):
    """Inductor on one already-partitioned graph, without its peak-memory reordering: that pass
    knows nothing of collectives, so it could undo our schedule, and where graphs differ by
    rank order collectives differently on different ranks (a hang). Also
    without its buffer reuse, which keeps a dead buffer allocated until a later buffer of the
    same size takes it over, wherever its own estimate of the peak allows: that estimate sees
    neither a collective's buffers nor the saved activations a backward frees as it goes, so in
    our graphs the reuse held a unit's gathered or reduced buffer beside the next one (measured:
    2-5 MiB over the memory model's peak on the bench's transformers; each buffer is now freed
    at its last use, as the memory model and the schedule assume).
    Public replacement: none (torch.compile's Inductor takes whole Dynamo graphs)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    with inductor_config.patch(reorder_for_peak_memory=False, allow_buffer_reuse=False):
        return compile_fx_inner(gm, example_inputs, is_backward=graph_kind == "backward",
                                is_inference=graph_kind == "inference")


def free_storage_op():
    """The op that frees a tensor's storage in place (resizes it to 0 bytes), whoever else
    holds the tensor; Inductor lowers it as an ordered side effect (FSDP's compiled path frees
    its all-gather buffers with it). Public replacement: none (untyped_storage().resize_(0)
    is not an op a graph can carry)."""
    return torch.ops.inductor.resize_storage_bytes_.default


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """Inductor on a whole Dynamo graph (a model graphshard did not shard).
    Public replacement: torch._dynamo.lookup_backend("inductor") is no more public."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def inductor_decompositions() -> dict:
    """The decomposition table Inductor lowers after; AOTAutograd must decompose with it or
    compile_fx_inner fails ("both a fallback and a decomp for same op"). Also imports Inductor's
    lowerings, which some decompositions consult (max_pool2d_with_indices) and which nothing
    else imports under compiler="eager". Public replacement: none."""
    import torch._inductor.lowering  # noqa: F401
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


@contextmanager
def fake_mode_of_inputs(example_inputs: Sequence[Any]):
    """Make the inputs' fake mode Inductor's current one while AOTAutograd traces (Inductor's
    decompositions read it). Public replacement: none."""
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(example_inputs)):
        yield


def short_traceback_error() -> type:
    """Dynamo re-raises this exception type as is, instead of wrapping it in
    BackendCompilerFailed: our option errors stay the first line the user reads.
    Public replacement: none."""
    from torch._dynamo.exc import ShortenTraceback

    return ShortenTraceback


def run_eagerly_when_called_from_eager_code(fn: Callable) -> Callable:
    """Dynamo still inlines `fn` inside compiled frames but never compiles it as a frame of its
    own (SKIP for the frame and what it calls). Public replacement: torch.compiler.disable would
    also stop the inlining (a graph break), which is not what we want."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn


def backward_compiled_with_forward():
    """Compile the backward graph together with the forward (as AOT compile does), so `graphshard
    dump` sees both graphs without running any. Public replacement: none."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def compile_counters() -> dict:
    """Dynamo/Inductor/AOTAutograd counters (graphs, graph breaks, cache hits and misses) for the
    bench. Public replacement: none (torch._dynamo.utils.counters)."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters


def allow_recompiles(per_code: int, total: int) -> None:
    """Raise Dynamo's recompile limits (the bench compiles one forward under many methods).
    Public replacement: none (torch._dynamo.config)."""
    import torch._dynamo.config

    torch._dynamo.config.recompile_limit = per_code
    torch._dynamo.config.accumulated_recompile_limit = total


@contextmanager
def quiet_selective_checkpoint_notice():
    """Silence Dynamo's notice, logged at every capture of a selective-checkpointing policy, to
    make sure the checkpointed region holds no in-place ops: advice for a user's own policy,
    noise among `graphshard plan`'s progress lines (the policy is graphshard's). Public
    replacement: none (the notice comes from the private torch._higher_order_ops.wrap logger)."""
    import logging

    logger = logging.getLogger("torch._higher_order_ops.wrap")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def compiled_module_original(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (the model itself when it is not a compiled wrapper):
    checkpoints keep the model's own state-dict names, not the wrapper's `_orig_mod.` ones.
    Public replacement: none (torch.compile returns an OptimizedModule, whose `_orig_mod` is
    the only way back to the original)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def inductor_config_changes_made_by(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run `fn`, which sets Inductor's global config (torchtitan's JIT recipe does), and return
    what it changed as `torch.compile(options=...)` keys, the global config put back as it was:
    the bench compiles one method with them and every other method without. Public
    replacement: none (torch._inductor.config)."""
    import torch._inductor.config as inductor_config

    before = inductor_config.get_config_copy()
    try:
        fn()
        after = inductor_config.get_config_copy()
    finally:
        inductor_config.load_config(before)
    return {key: value for key, value in after.items() if before.get(key) != value}


def settle_inductor_host_probes() -> None:
    """Run, in this process, the per-process checks Inductor makes of the host before its first
    CPU kernel: which vector ISAs g++ builds and loads (one probe subprocess per ISA, about 1-2 s
    a process) and the hash of torch's sources that keys its caches. Both are cached for the
    process's life, so processes forked after this inherit the answers."""
    from torch._inductor import codecache, cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()
    codecache.torch_key()


def inductor_vector_isa_probed() -> bool:
    """Whether this process already knows which vector ISAs Inductor's kernels may use."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
