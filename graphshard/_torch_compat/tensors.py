"""Tensors, fake tensors, pytrees and module internals.

Part of graphshard._torch_compat (see its docstring): every public name here is re-exported there.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


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
    allocation event in `prof` (a torch.profiler.profile that has stopped), in time order. Public
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


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """Names of `module`'s own buffers registered with persistent=False (not in its state
    dict: load_pretrained computes them instead of reading them). Public replacement: none
    (comparing named_buffers with state_dict keys builds the whole state dict)."""
    return set(module._non_persistent_buffers_set)
