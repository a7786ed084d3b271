"""Tiny factories for `graphshard dump` tests (file and module targets)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tiny(nn.Module):
    """Three linears: a frozen one in the middle, and an output of 5 rows (uneven shards at
    world size 4, so padding shows up)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.frozen(F.relu(self.inp(x)))))


def make(batch: int = 2, dim: int = 16):
    """(model, example_inputs): the loss is a plain reduction of the output."""
    return Tiny(dim), (torch.randn(batch, 8),)


def make_with_loss(batch: int = 2):
    return Tiny(), (torch.randn(batch, 8),), lambda out, x: out.square().mean()


def raises():
    raise RuntimeError("boom: the factory failed")


def wrong_shape():
    return Tiny()


def wrong_model():
    return "not a model", (torch.randn(2, 8),)


NOT_CALLABLE = 3


def frozen_model():
    """Nothing requires grad: torch.compile makes one inference graph and no backward."""
    model = Tiny()
    model.requires_grad_(False)
    return model, (torch.randn(2, 8),)


def make_cnn(batch: int = 2):
    """Conv + BatchNorm (buffers) + max-pool (Inductor's decomposition of it consults its
    lowerings) + linear head."""
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(5 * 3 * 3, 4))
    return model, (torch.randn(batch, 3, 8, 8),)


def make_tied(batch: int = 2):
    """The test zoo's GPT: embedding and output head share one weight."""
    from tests.zoo import TinyGPT, gpt_batch

    return TinyGPT(), (gpt_batch(batch),), lambda out, tokens: out.float().square().mean()


class ReadsParametersDirectly(Tiny):
    """Adds a term read through parameters(), which after sharding hold DTensor shards:
    compiling it fails."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + sum(p.sum() for p in self.out.parameters())


def fails_to_compile():
    return ReadsParametersDirectly(), (torch.randn(2, 8),)


def make_fixed():
    """Example inputs of one fixed shape: no batch= or seq_len= to build them at another."""
    return Tiny(), (torch.randn(2, 8),)
