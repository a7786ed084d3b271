"""Small test models that exercise every parameter shape graphshard must handle."""

from __future__ import annotations

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
