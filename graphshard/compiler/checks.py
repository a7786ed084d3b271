"""What the backend refuses in a Dynamo graph, before compiling it: each check says what is
wrong and what to do instead."""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor

from graphshard import _torch_compat as compat
from graphshard.passes.graph_utils import all_nodes, is_unshard
from graphshard.passes.markers import UnshardSpec


def _unsharded_trainable_shapes(example_inputs: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in example_inputs
            if isinstance(x, torch.nn.Parameter) and x.requires_grad and not isinstance(x, DTensor)]


def check_unsharded_model_trains_alone(example_inputs: Sequence[Any]) -> None:
    # A graph without graphshard's markers compiles as plain Inductor. In a job of several
    # ranks, trainable parameters that shard() never saw (shard() forgotten) get no gradient
    # reduction: each rank would train its own copy, and the copies drift apart unnoticed.
    if not (torch.is_grad_enabled() and dist.is_initialized()):
        return
    world_size = dist.get_world_size()
    plain = _unsharded_trainable_shapes(example_inputs)
    if world_size > 1 and plain:
        raise ValueError(
            f"torch.compile(backend='graphshard') got a model whose {len(plain)} trainable "
            f"parameter(s) (shapes {plain[:4]}) graphshard.shard has not sharded, in a job of "
            f"{world_size} ranks: each rank would train its own copy, never averaging gradients "
            "with the others. Call graphshard.shard(model) before torch.compile; or freeze "
            "those parameters; or, if each rank is meant to train a model of its own (or DDP "
            "wraps it), compile with backend='inductor'.")


def check_all_parameters_sharded(example_inputs: Sequence[Any]) -> None:
    # A parameter added after shard() (an adapter, a re-assigned weight) would get no gradient
    # reduction at all: each rank would silently train its own copy.
    plain = _unsharded_trainable_shapes(example_inputs)
    if plain:
        raise ValueError(
            f"{len(plain)} trainable parameter(s) of shapes {plain[:4]} are not sharded (added or "
            "replaced after graphshard.shard?): their gradients would never be averaged across "
            "ranks. Create all parameters before graphshard.shard(model), or freeze them."
        )


def check_parameters_read_as_attributes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
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


def check_gathered_weights_not_edited(gm: fx.GraphModule) -> None:
    # Under compile a parameter read is the gathered weight, a copy (eagerly a GatheredWeight
    # writes edits back to the shard): an in-place edit of it inside the graph would change
    # the copy only, and the shard would silently keep its old values. Dynamo ran the forward
    # on fake tensors, so the copy's version counter shows such an edit, even one hidden inside
    # a function (nn.Embedding's max_norm renormalises the rows it reads in place).
    def edited_in_place(node: fx.Node) -> bool:
        value = node.meta.get("example_value")
        # (an inference tensor has no version counter: nothing to see, and nothing to train)
        return (isinstance(value, torch.Tensor) and not value.is_inference()
                and compat.version_counter(value) > 0)

    edited = dict.fromkeys(UnshardSpec.from_node(node).name for node in all_nodes(gm)
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
