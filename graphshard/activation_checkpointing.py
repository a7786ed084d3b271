"""Activation checkpointing of a model's repeated blocks, without changing its parameter names.

    graphshard.apply_activation_checkpointing(model, "full")       # recompute each block
    graphshard.apply_activation_checkpointing(model, "selective")  # keep matmul outputs only

Each block's forward runs under torch.utils.checkpoint (non-reentrant, which torch.compile
traces as one region); the module tree is left as it is, so state-dict keys, sharding and
checkpoints see the same names as without it (a wrapper module would add a prefix). In a
Hugging Face model every transformers layer (GradientCheckpointingLayer: both stacks of an
encoder-decoder) is switched through its own hook instead, as gradient_checkpointing_enable
does, and every `config.use_cache` in the model (on by default in causal LMs) is turned off, as
fine-tuning scripts do: a KV-cache write inside a checkpointed block would happen again when
backward recomputes it, and the layer's notice that it drops the cache is a logging call that
torch.compile(fullgraph=True) refuses. generate() still caches (it asks for the cache itself).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from graphshard._transformers import transformers_names
from graphshard.passes.units import repeated_blocks  # what a block is: one definition

MODES = ("none", "full", "selective")
# Selective: save what is expensive to recompute (matmul and attention outputs), recompute the
# rest (norms, activations, residual adds), as torchtitan's op-level selective AC does.
SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


def selective_context():
    """context_fn for torch.utils.checkpoint: save SAVED_OPS' outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(list(SAVED_OPS))


# What AOTAutograd's cache keys a selective-AC graph by (without it, it stores none, and each
# rank of a host compiles its own): the policy is SAVED_OPS, nothing else.
selective_context.cache_hash = "graphshard-selective:" + ",".join(str(op) for op in SAVED_OPS)


def _checkpointed(context_fn, forward, *args, **kwargs):
    if context_fn is None:  # full: Dynamo traces checkpoint's default context, not a named one
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> nn.Module:
    """Checkpoint every repeated block ("full"), or keep only its matmul and attention outputs
    ("selective"); "none" leaves the model as it is. Applying it again replaces the mode (it
    does not nest). Returns the same model."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return model
    context_fn = selective_context if mode == "selective" else None
    # transformers' blocks (what its gradient_checkpointing_enable switches), if any
    found = transformers_names("transformers.modeling_layers", "GradientCheckpointingLayer")
    transformers_layers = [] if found is None else [m for m in model.modules() if isinstance(m, found[0])]
    if transformers_layers:
        for layer in transformers_layers:
            # What gradient_checkpointing_enable sets per layer: in training, the layer drops
            # its cache arguments and calls this function on its bound forward.
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(_checkpointed, context_fn)
        for module in model.modules():  # a composite model's parts have configs of their own
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", False):
                config.use_cache = False
        return model
    for block in repeated_blocks(model):
        forward = block.forward
        if isinstance(forward, functools.partial) and forward.func is _checkpointed:
            forward = forward.args[1]  # applied before: checkpoint the block's own forward
        block.forward = functools.partial(_checkpointed, context_fn, forward)
    return model
