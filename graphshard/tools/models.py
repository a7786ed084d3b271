"""Built-in models: the demo Transformer and a Llama-style decoder.

Used by `graphshard train`, `graphshard dump` and the benchmarks. Each builder returns
`(model, example_inputs, loss_fn)` so every tool drives a model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------- Transformer


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 64
    weight_tying: bool = False


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        head_dim = dim // self.n_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(bsz, seq, self.n_heads, head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """GPT-style decoder (the 4-block, dim-256 model of the design notes by default)."""

    def __init__(self, config: TransformerConfig = TransformerConfig()):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(config.dim, config.n_heads) for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------- Llama


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 688
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


LLAMA3_8B = LlamaConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
    ffn_hidden=14336, max_seq_len=8192,
)
LLAMA3_70B = LlamaConfig(
    vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
    ffn_hidden=28672, max_seq_len=8192,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (bsz, heads, seq, head_dim); rotate interleaved halves
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x, cos, sin):
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class LlamaFeedForward(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = LlamaFeedForward(config)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama-3-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU."""

    # Its tensor-parallel plan (graphshard.parallelize): torchtitan's for the blocks. The output
    # head stays whole on every TP rank (sharded by graphshard): gathering column-parallel
    # logits would move batch x seq x vocab per step (4 GiB at seq 8192, vocab 128k).
    tp_plan = {
        "layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
    }

    def __init__(self, config: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        head_dim = self.config.dim // self.config.n_heads
        cos, sin = rotary_tables(head_dim, tokens.shape[1], self.config.rope_theta, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------- registry


def cross_entropy_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token prediction loss: predict tokens[:, 1:] from logits[:, :-1]."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
    )


def synthetic_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Deterministic token batch with learnable structure (a noisy repeating pattern)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.arange(seq_len).repeat(batch, 1) * 7 + torch.randint(0, 5, (batch, 1), generator=gen)
    noise = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    keep = torch.rand(batch, seq_len, generator=gen) < 0.8
    return torch.where(keep, base % vocab_size, noise)


def _config_from(cls, base, overrides: dict):
    known = {f.name for f in fields(cls)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(
            f"unknown option(s) {sorted(unknown)} for {cls.__name__}; valid: {sorted(known)}"
        )
    values = {f.name: getattr(base, f.name) for f in fields(cls)}
    values.update(overrides)
    return cls(**values)


def build_transformer(batch: int = 8, seq_len: int = 32, **overrides):
    config = _config_from(TransformerConfig, TransformerConfig(), overrides)
    model = Transformer(config)
    tokens = synthetic_tokens(config.vocab_size, batch, min(seq_len, config.max_seq_len))
    return model, (tokens,), cross_entropy_loss


def build_llama(batch: int = 4, seq_len: int = 64, preset: str | None = None, **overrides):
    base = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, None: LlamaConfig()}.get(preset)
    if base is None:
        raise ValueError(f"unknown llama preset {preset!r}; valid: 'llama3-8b', 'llama3-70b'")
    config = _config_from(LlamaConfig, base, overrides)
    model = Llama(config)
    tokens = synthetic_tokens(config.vocab_size, batch, min(seq_len, config.max_seq_len))
    return model, (tokens,), cross_entropy_loss


BUILTIN_MODELS: dict[str, Callable] = {
    "transformer": build_transformer,
    "transformer-large": lambda **kw: build_transformer(**{"dim": 512, "n_layers": 8, "n_heads": 8, **kw}),
    "llama": build_llama,
    "llama3-8b": lambda **kw: build_llama(preset="llama3-8b", **kw),
    "llama3-70b": lambda **kw: build_llama(preset="llama3-70b", **kw),
}


def build_model(name: str, **overrides):
    """Build a built-in model by name: returns (model, example_inputs, loss_fn)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; valid: {sorted(BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name](**overrides)
