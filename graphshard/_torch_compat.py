"""Every private torch API graphshard's compiler and runtime use, in one place.

Each entry says what it is for and what public API would replace it. torch 2.13 is the version
the test suite runs on (pyproject pins it); a torch upgrade starts by re-checking this file.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx


def aot_autograd_backend(**kwargs) -> Callable:
    """AOTAutograd with our forward/backward compilers and partition function.
    Public replacement: none (torch.compile exposes backends, not AOTAutograd's hooks)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**kwargs)


def cacheable_graph_compiler(compile_graph: Callable) -> Callable:
    """Mark a forward/backward compiler that returns Inductor's compiled graph, so AOTAutograd
    may store the result in its cache and, on a later run of the same program, skip tracing,
    partitioning and `compile_graph` altogether. Public replacement: none (AOTAutograd's cache
    serves torch.compile's own Inductor backend; a backend opts in with this wrapper)."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import CompiledFxGraph

    return SerializableAOTDispatchCompiler(CompiledFxGraph, compile_graph)


def salt_aot_autograd_cache_key(gm: fx.GraphModule, salt: str) -> None:
    """Make `salt` part of AOTAutograd's cache key for `gm`: its key covers the Dynamo graph,
    the inputs and torch's configs, not what our compilers do with the graph (our options, our
    passes' code). AOTAutograd reads the graph's backend id into the key. Public replacement:
    none."""
    gm._backend_id = salt


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


def real_tensors():
    """A context in which no fake mode is active: for a collective a backend runs while
    AOTAutograd traces under its fake mode (agreeing on a decision across ranks), and for a pass
    that enters its graph's own fake mode to compute a new node's value. Public replacement:
    none."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def count_cpu_frees_on_every_thread() -> None:
    """Make the CPU allocator keep its live-bytes total on every thread (the profiler's memory
    events report that total): by default a free on a thread the profiler does not profile (one
    of gloo's) is never subtracted. The c10 flag caffe2_report_cpu_memory_usage does exactly
    this; it has no Python binding, so it is set in libc10 directly. Public replacement: none
    (torch.cpu has no memory statistics)."""
    import ctypes
    import os

    libc10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(libc10, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def cpu_allocations(prof) -> list[tuple[int, int, int]]:
    """(time ns, bytes (negative: a free), the allocator's live total after it) of every CPU
    allocation event a finished torch.profiler session recorded, in time order. Public
    replacement: none (the event tree is kineto_results' experimental API)."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    return sorted(found)


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


def rank_invariant_group_name(mesh, dim: int) -> str:
    """The name graphshard's graphs give this rank's process group along `dim` of `mesh`. Where
    the mesh has several groups along `dim` (hybrid sharding's replica and shard groups), each
    rank's own has its own c10d name, which would make every rank's graphs its own; so every
    rank registers its group under one alias, alike on all of them (the mesh's layout and the
    dim), and c10d resolves the alias to the rank's own group when a collective runs. Where
    the group spans the whole mesh, its own name is already alike on every rank.
    Public replacement: none (c10d's process-group registry)."""
    import hashlib

    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

    group = mesh.get_group(dim)
    if mesh.size(dim) == mesh.size():
        return group.group_name
    layout = repr((mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names))
    alias = f"graphshard:mesh-{hashlib.sha256(layout.encode()).hexdigest()[:16]}:dim-{dim}"
    try:
        _resolve_process_group(alias)  # an equal mesh made again: its groups have the same ranks
    except RuntimeError:  # not registered yet (destroy_process_group() clears the registry)
        _register_process_group(alias, group)
    return alias


def process_group_size(group_name: str) -> int:
    """Size of a live process group known only by the name a functional collective carries
    (all_reduce nodes carry no size). Public replacement: none (groups by name are private)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def process_group_rank(group_name: str) -> int:
    """This process's rank in a live process group known only by its name (as above)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).rank()


def process_group(group_name: str):
    """A live process group known only by its name (as above): the eager collectives' tag
    exchange runs on it. Public replacement: none."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def process_group_ranks(group_name: str) -> list[int]:
    """The global ranks of a live process group known only by its name (as above)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def backward_compiled_with_forward():
    """Compile the backward graph together with the forward (as AOT compile does), so `graphshard
    dump` sees both graphs without running any. Public replacement: none."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def compile_cache_dir() -> str:
    """The directory Inductor's and AOTAutograd's local caches live in (TORCHINDUCTOR_CACHE_DIR,
    or torch's default under the temporary directory). Public replacement: none."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def compile_caches_enabled() -> bool:
    """Whether a compile can be served from AOTAutograd's and Inductor's local caches (both on,
    not force-disabled). Public replacement: none (torch._functorch / torch._inductor config)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return (functorch_config.enable_autograd_cache and inductor_config.fx_graph_cache
            and not torch.compiler.config.force_disable_caches)


def aot_cache_bypass_reason(gm) -> str | None:
    """Why AOTAutograd's cache would not store a compile of the Dynamo graph `gm` (an op it
    cannot key: an autograd.Function; a selective activation-checkpointing policy without a
    cache_hash, or one its key cannot pickle, e.g. a partial over a list of ops), or None.
    Public replacement: none (torch._functorch._aot_autograd.autograd_cache)."""
    from torch._functorch._aot_autograd import autograd_cache
    from torch._inductor.codecache import BypassFxGraphCache

    try:
        autograd_cache.check_cacheable(gm)
        autograd_cache._collect_context_fn_hashes(gm)  # a policy without a cache_hash
    except (autograd_cache.BypassAOTAutogradCache, BypassFxGraphCache) as exc:
        return str(exc)
    try:  # the graph as the cache key pickles it; any failure there is a bypass to the cache too
        with autograd_cache.sanitize_gm_for_cache(gm):
            autograd_cache.AOTAutogradCachePickler(gm).dumps(gm)
    except Exception as exc:
        return f"its key cannot be computed: {type(exc).__name__}: {exc}"
    return None


# Packages whose autograd.Functions AOTAutograd's cache may store: the key names each Function
# and salt_cache_key adds the package's code (graphshard's sources, torchao's version).
KEYED_FUNCTION_PACKAGES = ("graphshard", "torchao")


def _trampoline_function(target) -> type | None:
    """The autograd.Function behind a call Dynamo left in the graph for AOTAutograd to trace
    (`produce_trampoline_autograd_apply`: a Function on tensor subclasses), else None."""
    if getattr(target, "__name__", None) != "trampoline_autograd_apply":
        return None
    cells = [cell.cell_contents for cell in getattr(target, "__closure__", None) or ()]
    return next((c for c in cells if isinstance(c, type)
                 and issubclass(c, torch.autograd.Function)), None)


def _from_keyed_package(qualified_name: str) -> bool:
    return qualified_name.split(".", 1)[0] in KEYED_FUNCTION_PACKAGES


def _called_from_keyed_package(node: fx.Node) -> bool:
    """Whether the innermost frame of `node`'s stack trace is in a KEYED_FUNCTION_PACKAGES
    package's directory (where a traced autograd.Function was applied)."""
    import os
    import re
    import sys

    files = re.findall(r'File "([^"]+)", line', node.meta.get("stack_trace") or "")
    roots = [os.path.dirname(os.path.abspath(sys.modules[name].__file__)) + os.sep
             for name in KEYED_FUNCTION_PACKAGES if name in sys.modules]
    return bool(files) and any(os.path.abspath(files[-1]).startswith(root) for root in roots)


@contextmanager
def keyed_package_functions_cacheable(gm: fx.GraphModule):
    """Let AOTAutograd's cache store `gm` where only autograd.Functions and config classes of
    KEYED_FUNCTION_PACKAGES keep it from doing so (float8 training: torchao's matmul Function
    and configs, graphshard's float8 weight Functions), each named in the key; otherwise
    change nothing. Dynamo traces a Function's forward and backward into `gm` (their code is
    in the key then) or leaves a call AOTAutograd traces (the key names the Function).
    Public replacement: none (torch._functorch.config's
    autograd_cache_allow_custom_autograd_functions, torch._inductor.config's
    unsafe_marked_cacheable_functions)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

    higher_order, marked = False, set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is torch.ops.higher_order.autograd_function_apply:
            if not _called_from_keyed_package(node):
                yield
                return
            higher_order = True
        elif (function := _trampoline_function(target)) is not None:
            if not _from_keyed_package(function.__module__):
                yield
                return
            marked.add(f"{target.__module__}.{target.__name__}")
        elif isinstance(target, type) and _from_keyed_package(target.__module__):
            marked.add(f"{target.__module__}.{target.__name__}")
    if not higher_order and not marked:
        yield
        return

    original = AOTAutogradCachePickler._format_global_for_cache_key

    def format_global(name: str, obj: Any) -> str:
        function = _trampoline_function(obj)
        if function is not None:  # a local function: named by the Function it applies
            return f"# autograd.Function {name}: {function.__module__}.{function.__qualname__}"
        return original(name, obj)

    AOTAutogradCachePickler._format_global_for_cache_key = staticmethod(format_global)
    allowed = higher_order or functorch_config.autograd_cache_allow_custom_autograd_functions
    try:
        with functorch_config.patch(autograd_cache_allow_custom_autograd_functions=allowed), \
                inductor_config.patch(unsafe_marked_cacheable_functions=sorted(
                    marked | set(inductor_config.unsafe_marked_cacheable_functions))):
            yield
    finally:
        AOTAutogradCachePickler._format_global_for_cache_key = staticmethod(original)


def cache_key_of_object(gm, obj) -> str:
    """A digest of what AOTAutograd's cache key makes of `obj`, a non-tensor input of the Dynamo
    graph `gm` (a DeviceMesh from a tensor-parallel plan: its ranks and coordinate), or a
    rank-specific string where it cannot be pickled (the key would not match across ranks).
    Public replacement: none (torch._functorch._aot_autograd.autograd_cache)."""
    import hashlib

    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

    try:
        return hashlib.sha256(AOTAutogradCachePickler(gm).dumps(obj)).hexdigest()[:16]
    except Exception:
        return f"{type(obj).__name__} on rank {dist.get_rank()}"


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


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group of any world size in one process, whose collectives do nothing: how
    `graphshard dump` traces a cluster it does not have. Public replacement: the "fake" backend
    is built in, but is registered (with its store) only by torch's testing package."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fake_mode_of_value(val):
    """The FakeTensorMode a value belongs to, or None for anything but a fake tensor (how a
    pass finds the mode its graph was traced in). Public replacement: none."""
    from torch._subclasses.fake_tensor import FakeTensor

    return val.fake_mode if isinstance(val, FakeTensor) else None


def fake_tensor_mode():
    """Tensors with shapes and dtypes but no storage (dump's parameters and inputs).
    Public replacement: none (torch._subclasses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def tree_leaves(tree: Any) -> list:
    """The leaves of nested tuples, lists and dicts (a workload's inputs), in torch's pytree
    order. Public replacement: none (torch.utils._pytree; the optree package is the same)."""
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(tree)


def tree_map(fn: Callable, tree: Any) -> Any:
    """`tree` with every leaf replaced by `fn(leaf)` (as `tree_leaves`)."""
    from torch.utils._pytree import tree_map as map_leaves

    return map_leaves(fn, tree)


def tree_map_only(cls: type, fn: Callable, tree: Any) -> Any:
    """`tree` with every leaf of type `cls` replaced by `fn(leaf)` (as `tree_leaves`)."""
    from torch.utils._pytree import tree_map_only as map_only

    return map_only(cls, fn, tree)


def is_op_overload(target: Any) -> bool:
    """Whether an FX node's target is one overload of an operator (aten.mm.default), which has
    a schema and an overload packet, rather than a Python function. Public replacement: none
    (the class is torch._ops.OpOverload)."""
    return isinstance(target, torch._ops.OpOverload)


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place edits `tensor` (a fake one included) has seen. Public replacement:
    none (Tensor._version)."""
    return tensor._version


def cache_key_salt(gm: fx.GraphModule) -> str | None:
    """What `salt_aot_autograd_cache_key` (or Dynamo's own precompile packaging) set as `gm`'s
    backend id, or None. Public replacement: none."""
    return getattr(gm, "_backend_id", None)


def sharded_like(param, local: torch.Tensor):
    """`local` (this rank's shard, param's dtype and local shape) as a DTensor laid out like the
    DTensor `param`, without DTensor.from_local's autograd Function and spec building: ~4 us
    against ~40 us, for every gradient of every step. Public replacement: DTensor.from_local."""
    from torch.distributed.tensor import DTensor

    if local.dtype != param.dtype or local.shape != param._local_tensor.shape:
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return DTensor(local, param._spec, requires_grad=False)


def set_local_tensor(param, local: torch.Tensor) -> None:
    """Make the DTensor `param` hold `local` (its dtype, device and local shape; other storage)
    as its local shard, the parameter object and its global metadata unchanged. Public
    replacement: torch.utils.swap_tensors with a new DTensor, which also swaps the autograd
    metadata (hooks, the optimizer's identity checks) that must stay."""
    old = param._local_tensor
    if (local.dtype, local.device, local.shape) != (old.dtype, old.device, old.shape):
        raise ValueError(f"graphshard: a local shard {tuple(local.shape)} {local.dtype} cannot "
                         f"replace {tuple(old.shape)} {old.dtype}")
    param._local_tensor = local


def wrapper_tensor(cls: type, like: torch.Tensor) -> torch.Tensor:
    """An instance of the tensor subclass `cls` with `like`'s metadata and no storage of its own
    (its __torch_dispatch__ computes on a tensor it holds). Public replacement: none (every
    torch wrapper subclass, DTensor included, is made this way)."""
    return torch.Tensor._make_wrapper_subclass(
        cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(),
        dtype=like.dtype, device=like.device, requires_grad=False)


def written_arguments(func, args: tuple, kwargs: dict) -> list:
    """The values of an ATen call that the op writes in place (its schema's mutable
    arguments). Public replacement: none (OpOverload's schema is private)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(value)
    return written


# --------------------------------------------------------------------------- runtime of shard()
#
# What graphshard.shard's runtime (graphshard/sharding.py, graphshard/runtime/) reads of torch's
# internals.


def is_norm_with_running_stats(module: torch.nn.Module) -> bool:
    """A BatchNorm or InstanceNorm layer, their lazy and sync variants and subclasses of their
    common base (which keeps the parameters beside fp32 running statistics). Public replacement:
    isinstance over the public BatchNorm*/InstanceNorm*/SyncBatchNorm classes, which misses
    subclasses of the private base (torch.nn.modules.batchnorm._NormBase)."""
    return isinstance(module, torch.nn.modules.batchnorm._NormBase)


def rnn_flat_weight_names(module: torch.nn.RNNBase) -> list[str]:
    """An RNN's weight names in the order its kernel takes them. Public replacement: none
    (nn.RNNBase._flat_weights_names)."""
    return module._flat_weights_names


def _no_weight_cache(self) -> None:
    return None


def rnn_weight_cache_overrides(read_weights: Callable) -> dict[str, Any]:
    """Class attributes for an nn.RNNBase subclass that reads its weights through
    `read_weights(module)` at every call, instead of the parameter objects nn.RNNBase caches at
    construction (`_flat_weights`), and re-caches nothing when they change (`_apply`, each
    forward's check: `_init_flat_weights`, `_update_flat_weights`). Public replacement: none."""
    return {"_flat_weights": property(read_weights, lambda self, value: None),
            "_init_flat_weights": _no_weight_cache, "_update_flat_weights": _no_weight_cache}


# --------------------------------------------------------------------------- tensor parallelism


def root_mesh(mesh):
    """The DeviceMesh `mesh` was sliced from (itself if not). Public replacement: none."""
    return mesh._get_root_mesh()


def strided_shard(dim: int, split_factor: int):
    """A data-parallel cut of a TP piece cut on the same dim (FSDP2 + TP's layout). Public
    replacement: none."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding results, keyed by mesh equality (ranks, names: not groups):
    after a fake process group is remade (dump, plan) they would name dead groups. Public
    replacement: none."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()


def all_reduce_min(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """The elementwise minimum of `tensor` over the 1-D `mesh`, as a traceable functional
    collective (a float8 weight's scale over its TP group). Public replacement: none
    (torch.distributed's all_reduce is in place and not traced as a graph collective)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(tensor, "min", mesh)


def is_strided_shard(placement) -> bool:
    """Whether `placement` is a `_StridedShard` (not is_shard()). Public replacement: none."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


# --- Ranks agreeing on one collective schedule (graphshard/compiler/schedule_check.py) ---

def default_store():
    """The default process group's key-value store: ranks compare their compiled schedules
    through it, without a collective (a rank recompiling alone must not wait for the others).
    Public replacement: none (torch.distributed exposes no accessor for the default store)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# --------------------------------------------------------------------------- the planner


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


# --------------------------------------------------------------------------- checkpoints


def compiled_module_original(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (the model itself when it is not a compiled wrapper):
    checkpoints keep the model's own state-dict names, not the wrapper's `_orig_mod.` ones.
    Public replacement: none (torch.compile returns an OptimizedModule, whose `_orig_mod` is
    the only way back to the original)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """Names of `module`'s own buffers registered with persistent=False (not in its state
    dict: load_pretrained computes them instead of reading them). Public replacement: none
    (comparing named_buffers with state_dict keys builds the whole state dict)."""
    return set(module._non_persistent_buffers_set)


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
