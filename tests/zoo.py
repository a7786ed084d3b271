"""Small test models that exercise every parameter shape graphshard must handle, and tiny
Hugging Face Llamas saved as pretrained weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class Zoo(nn.Module):
    """Uneven and empty shards, tied weights, a module called twice, frozen, 0-dim and
    1-element parameters, and a buffer, in one model."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)  # 11 rows: uneven at world sizes 2, 3, 4
        self.block = nn.Linear(dim, dim)  # called twice per forward
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.gate = nn.Linear(dim, 1)  # weight (1, dim): empty shards; bias: 1 element
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.register_buffer("offset", torch.linspace(-1, 1, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.offset
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        h = h + self.frozen(h)
        h = h * torch.sigmoid(self.gate(h)) * self.scale
        return self.head(h)


def zoo_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def zoo_batch(batch: int = 12, seq: int = 8, vocab: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


class GPTBlock(nn.Module):
    """Pre-norm attention (scaled_dot_product_attention) and MLP; 30- and 15-row weights shard
    unevenly at world sizes 2 and 4 (and 15 at 2)."""

    def __init__(self, dim: int = 10, heads: int = 2, hidden: int = 15):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _save_matmuls_context():
    # Save matmul outputs, recompute everything else (the usual selective-AC policy).
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(
        [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default])


# What AOTAutograd's cache keys the policy by (a module-level function, so its key can name it;
# a partial over a list of ops cannot be pickled into a key): cached, a host compiles once.
_save_matmuls_context.cache_hash = "tests-selective-mm-addmm-bmm"


def _selective_policy():
    return _save_matmuls_context


class TinyGPT(nn.Module):
    """A GPT with what sharding finds hard: tied embedding/head (13 rows: uneven at 2, 3, 4), a
    frozen parameter, a 0-dim parameter; each block optionally under non-reentrant activation
    checkpointing ("full") or a selective policy ("selective")."""

    def __init__(self, ac: str = "none", vocab: int = 13, dim: int = 10, n_blocks: int = 2):
        super().__init__()
        if ac not in ("none", "full", "selective"):
            raise ValueError(f"ac must be 'none', 'full' or 'selective', got {ac!r}")
        self.ac = ac
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim) for _ in range(n_blocks))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.emb(tokens)
        for block in self.blocks:
            if self.ac == "none":
                h = block(h)
            elif self.ac == "full":
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = checkpoint(block, h, use_reentrant=False, context_fn=_selective_policy())
        h = h + torch.tanh(self.frozen(h)) * self.scale
        return self.head(self.norm(h))


def gpt_batch(batch: int, seq: int = 8, vocab: int = 13) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(5))


def plain_zoo(seed: int = 5, **kwargs) -> Zoo:
    """An unsharded Zoo, its weights drawn from `seed`."""
    torch.manual_seed(seed)
    return Zoo(**kwargs)


def tiny_llama(tied: bool, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def pretrained_llamas(root: Path) -> dict[str, Any]:
    """Tiny Hugging Face Llamas saved with save_pretrained under `root` (tied embeddings in one
    file; untied, sharded with an index), and the unsharded originals' outputs and first step."""
    tokens = torch.randint(0, 64, (6, 8), generator=torch.Generator().manual_seed(3))

    def saved(path: Path, tied: bool, max_shard_size: str) -> dict[str, Any]:
        model = tiny_llama(tied)
        model.save_pretrained(path, max_shard_size=max_shard_size)
        with torch.no_grad():
            logits = model(tokens).logits
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        return {"path": path, "logits": logits, "loss": loss.item(), "grads": grads,
                "after_step": {k: v.clone() for k, v in model.state_dict().items()}}

    return {"tokens": tokens, "tied": saved(root / "tied", True, "5GB"),
            "untied": saved(root / "untied", False, "30KB")}
