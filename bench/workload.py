"""What every method trains: one model, one global batch, one loss, the same on every rank."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from graphshard.passes.units import repeated_blocks
from graphshard.tools.models import BUILTIN_MODELS, build_model, cross_entropy_loss, synthetic_tokens
from graphshard.tools.workload import Workload

HF_LLAMA = "hf-llama"
# llama3-8b is left out: at full size it does not fit a benchmark on these machines.
MODEL_NAMES = (*(n for n in ("transformer", "transformer-large", "llama") if n in BUILTIN_MODELS),
               HF_LLAMA)


class ModelUnavailable(RuntimeError):
    """The model needs an optional package that is not installed."""


class _LogitsOnly(nn.Module):
    """Adapts a Hugging Face causal LM to the `model(tokens) -> logits` convention."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens, use_cache=False).logits


def _build_hf_llama(batch: int, seq_len: int, **overrides) -> tuple[nn.Module, tuple, Callable]:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ModelUnavailable(f"{HF_LLAMA} needs Hugging Face transformers ({exc})") from exc
    # Small config, random weights: nothing is downloaded.
    settings = dict(vocab_size=512, hidden_size=256, intermediate_size=688,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    max_position_embeddings=max(128, seq_len))
    settings.update(overrides)
    config = LlamaConfig(**settings)
    model = _LogitsOnly(LlamaForCausalLM(config))
    tokens = synthetic_tokens(config.vocab_size, batch, seq_len)
    return model, (tokens,), cross_entropy_loss


def build_workload(name: str, batch: int, seq_len: int, seed: int, overrides: dict) -> Workload:
    """Build `name` with the global batch, seeded so every rank and method starts identical:
    pristine initial weights, of which every method trains its own deep copy."""
    torch.manual_seed(seed)
    if name == HF_LLAMA:
        model, inputs, loss_fn = _build_hf_llama(batch, seq_len, **overrides)
    else:
        model, inputs, loss_fn = build_model(name, batch=batch, seq_len=seq_len, **overrides)
    return Workload(model, tuple(inputs), loss_fn, name)


def tensor_parallel_module(model: nn.Module) -> nn.Module:
    """The module whose TP plan applies: the Hugging Face model inside the logits adapter."""
    return model.inner if isinstance(model, _LogitsOnly) else model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (graphshard's units, passes/units.py): FSDP2 shards each one separately."""
    return repeated_blocks(model)

