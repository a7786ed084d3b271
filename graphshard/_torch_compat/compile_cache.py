"""AOTAutograd's and Inductor's caches: what their keys cover, what they refuse.

Part of graphshard._torch_compat (see its docstring): every public name here is re-exported there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx


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


def _keyed_package_roots() -> list[str]:
    import os
    import sys

    return [os.path.dirname(os.path.abspath(sys.modules[name].__file__)) + os.sep
            for name in KEYED_FUNCTION_PACKAGES if name in sys.modules]


def _keyed_package_calls(gm: fx.GraphModule) -> tuple[bool, set[str]] | None:
    """What in `gm` and its subgraphs (a checkpointed region's body) keeps AOTAutograd's cache
    from storing it and comes from KEYED_FUNCTION_PACKAGES: (whether an autograd.Function
    traced into the graph was applied there, found by the innermost frame of its stack trace;
    the qualified names of the calls left in the graph), or None where a Function of another
    package (a user's) is among them."""
    import os
    import re

    roots, higher_order, marked = _keyed_package_roots(), False, set()
    nodes = [node for module in gm.modules() if isinstance(module, fx.GraphModule)
             for node in module.graph.nodes if node.op == "call_function"]
    for node in nodes:
        target = node.target
        if target is torch.ops.higher_order.autograd_function_apply:
            files = re.findall(r'File "([^"]+)", line', node.meta.get("stack_trace") or "")
            if not files or not os.path.abspath(files[-1]).startswith(tuple(roots)):
                return None
            higher_order = True
        elif (function := _trampoline_function(target)) is not None:
            if not _from_keyed_package(function.__module__):
                return None
            marked.add(f"{target.__module__}.{target.__name__}")
        elif isinstance(target, type) and _from_keyed_package(target.__module__):
            marked.add(f"{target.__module__}.{target.__name__}")
    return higher_order, marked


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

    calls = _keyed_package_calls(gm)
    if calls is None or calls == (False, set()):
        yield
        return
    higher_order, marked = calls

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
    graph `gm`, or a rank-specific string where it cannot be pickled (the key would not match
    across ranks).
    Public replacement: none (torch._functorch._aot_autograd.autograd_cache)."""
    import hashlib

    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

    try:
        return hashlib.sha256(AOTAutogradCachePickler(gm).dumps(obj)).hexdigest()[:16]
    except Exception:
        return f"{type(obj).__name__} on rank {dist.get_rank()}"


def cache_key_salt(gm: fx.GraphModule) -> str | None:
    """What `salt_aot_autograd_cache_key` (or Dynamo's own precompile packaging) set as `gm`'s
    backend id, or None. Public replacement: none."""
    return getattr(gm, "_backend_id", None)
