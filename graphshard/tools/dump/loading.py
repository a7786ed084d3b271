"""Target loading: a built-in name or a factory -> (model, inputs, loss_fn), then fake tensors."""

from __future__ import annotations

import collections.abc
import contextlib
import importlib
import importlib.util
import os
import sys
from typing import Callable

from graphshard.tools.workload import Workload


class DumpError(Exception):
    """Bad input: reported as one line, exit status 2."""


def one_line(e: BaseException) -> str:
    """An exception as `Type: first line of its message`, for one-line error reports."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def check_output_paths(**paths: str | None) -> None:
    """Before any work: each given output file (flag name -> path) can be written, so a long run
    does not end in a traceback. Raises DumpError naming the flag."""
    for flag, path in paths.items():
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        problem = ("is a directory" if os.path.isdir(path)
                   else f"folder {folder} does not exist" if not os.path.isdir(folder)
                   else f"folder {folder} is not writable" if not os.access(folder, os.W_OK)
                   else "is not writable" if os.path.exists(path) and not os.access(path, os.W_OK)
                   else None)
        if problem:
            raise DumpError(f"--{flag} {path!r}: {problem}")


def import_factory(target: str) -> Callable:
    """`package.module:factory` or `path/to/file.py:factory` -> the factory."""
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise DumpError(f"target {target!r} must be module:factory or path/to/file.py:factory")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module = _import_file(target, module_name)
    else:
        module = _import_module(module_name)
    if not hasattr(module, attr):
        raise DumpError(f"cannot import {target!r}: module {module_name!r} has no attribute "
                        f"{attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise DumpError(f"target {target!r} is not callable (it is a {type(factory).__name__})")
    return factory


def _import_file(target: str, file_name: str):
    path = os.path.abspath(file_name)
    if not os.path.isfile(path):
        raise DumpError(f"cannot import {target!r}: no such file {file_name!r}")
    name = f"_graphshard_dump_target_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    sys.path.insert(0, os.path.dirname(path))  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise DumpError(f"cannot import {file_name!r}: {one_line(e)}") from e
    finally:
        sys.path.remove(os.path.dirname(path))
    return module


def _import_module(module_name: str):
    added = os.getcwd() not in sys.path  # as `python -m` does, so local packages resolve
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise DumpError(f"cannot import {module_name!r}: {one_line(e)}") from e
    finally:
        if added:
            sys.path.remove(os.getcwd())


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
        factory = import_factory(target)
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
        raise DumpError(f"factory {target!r} raised {one_line(e)}{hint}") from e
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
    if isinstance(inputs, collections.abc.Mapping):  # a tokenizer's BatchEncoding too
        inputs = dict(inputs)
    if not isinstance(inputs, (tuple, list, dict)):
        raise DumpError(f"factory {target!r} must return {shape}; example_inputs is a "
                        f"{type(inputs).__name__}, not a tuple of inputs, a dict of keyword "
                        "inputs or one tensor")
    if loss_fn is not None and not callable(loss_fn):
        raise DumpError(f"factory {target!r} must return {shape}; loss_fn is a "
                        f"{type(loss_fn).__name__}, not callable")
    if not any(True for _ in model.parameters()):
        raise DumpError(f"factory {target!r} returned a model without parameters: nothing to shard")
    return Workload(model, inputs if isinstance(inputs, dict) else tuple(inputs), loss_fn, target)


def to_fake_tensors(workload: Workload, fake_mode, device: str = "cpu") -> None:
    """Parameters, buffers and inputs -> FakeTensors on `device`: shapes and dtypes, no memory.

    Meta tensors would do for tracing, but Inductor's joint-graph passes replace every meta
    value the graph returns with empty_strided, which would hollow out the graphs we show.
    """
    import torch

    from graphshard._torch_compat import tree_map

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

        workload.inputs = tree_map(fake, workload.inputs)


@contextlib.contextmanager
def sharded_on_fake_cluster(workload: Workload, world_size: int, strategy: str,
                            shard_size: int | None = None, param_dtype=None, reduce_dtype=None,
                            tp: int = 1):
    """A fake process group of `world_size` in this process, the workload's tensors made fake,
    its model sharded over a 1-D mesh ((replicate, shard) for hybrid_shard), after applying
    its TP plan on an innermost "tp" dim of `tp` ranks; yields the data-parallel mesh and
    destroys the group on exit (how dump and plan see a cluster they do not have)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from graphshard._torch_compat import (clear_dtensor_caches, fake_tensor_mode,
                                          init_fake_process_group)
    from graphshard.tools.plan.apply import parallelize_and_shard

    if tp < 1 or world_size % tp:
        raise DumpError(f"--tp {tp} must be >= 1 and divide the world size {world_size}")
    data_parallel = world_size // tp
    if strategy == "hybrid_shard" and data_parallel % shard_size:
        raise DumpError(f"--shard-size {shard_size} must divide the data-parallel size "
                        f"{data_parallel} (world size {world_size} / tp {tp})")
    clear_dtensor_caches()  # nothing from an earlier (fake) cluster in this process
    init_fake_process_group(world_size)
    try:
        to_fake_tensors(workload, fake_tensor_mode())
        if strategy == "hybrid_shard":
            dims = ((data_parallel // shard_size, shard_size), ("replicate", "shard"))
        else:
            dims = ((data_parallel,), ("dp",))
        if tp > 1:
            dims = ((*dims[0], tp), (*dims[1], "tp"))
        mesh = init_device_mesh("cpu", dims[0], mesh_dim_names=dims[1])
        parallelize_and_shard(workload.model, mesh, dict(strategy=strategy,
                                                         param_dtype=param_dtype,
                                                         reduce_dtype=reduce_dtype),
                              tp_refused=lambda e: DumpError(f"--tp {tp}: {e}"))
        yield mesh[dims[1][:-1]] if tp > 1 else mesh
    finally:
        dist.destroy_process_group()
