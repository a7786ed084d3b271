"""Meta-device init: build on meta, shard, materialise only this rank's shards, initialise with
the modules' own reset_parameters; then train a model larger than a per-rank budget."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import graphshard
from graphshard.tools.launch import run_local
from graphshard.tools.models import Transformer, TransformerConfig, cross_entropy_loss, synthetic_tokens
from graphshard.passes.graph_utils import dim0_chunk

CONFIG = TransformerConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=16)
# Per-rank budget as a fraction of what the unsharded model needs: the full model does not fit.
BUDGET_FRACTION = 0.6


def _state_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a bucket's gradients share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _worker(rank, world):
    with torch.device("meta"):
        model = Transformer(CONFIG)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Expected: this rank's torch.chunk rows of every parameter (0-dim ones are replicated).
    expected = sum(dim0_chunk(p.shape[0], world) * p[0].numel() * p.element_size()
                   if rank < len(torch.empty(p.shape[0]).chunk(world)) else 0
                   for p in model.parameters())
    graphshard.shard(model)
    assert all(p.to_local().is_meta for p in model.parameters())
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(0)
        graphshard.materialize(model, device="cpu")
    init_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    local_bytes = _state_bytes(p.to_local() for p in model.parameters())

    torch.manual_seed(0)
    reference = Transformer(CONFIG)  # same seed, same module order: the same values
    init_error = max((p.full_tensor() - reference.state_dict()[n]).abs().max().item()
                     for n, p in model.named_parameters())
    tokens = synthetic_tokens(CONFIG.vocab_size, 4, 16)[rank * 2:(rank + 1) * 2]
    unsharded = _training_state_bytes(reference, lambda: cross_entropy_loss(reference(tokens), tokens))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="graphshard", options={"compiler": "eager"},
                             fullgraph=True)
    losses = []
    for _ in range(3):
        loss = cross_entropy_loss(compiled(tokens), tokens)
        loss.backward()
        grad_bytes = _state_bytes(_local(p.grad) for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt_bytes = _state_bytes(_local(v) for s in opt.state.values() for k, v in s.items()
                             if k != "step")
    return dict(full=full_bytes, expected=expected, local=local_bytes, init_peak=init_peak,
                init_error=init_error, grad=grad_bytes, opt=opt_bytes, losses=losses,
                unsharded=unsharded)


def _training_state_bytes(model, loss_fn) -> int:
    """Measured bytes of parameters, gradients and AdamW state over one unsharded step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn().backward()
    grad_bytes = _state_bytes(p.grad for p in model.parameters())
    opt.step()
    opt_bytes = _state_bytes(v for s in opt.state.values() for k, v in s.items() if k != "step")
    return _state_bytes(model.parameters()) + grad_bytes + opt_bytes


@pytest.fixture(scope="module")
def results():
    return run_local(_worker, 2)


def test_each_rank_allocates_only_its_shard(results):
    for r in results:
        assert r["local"] == r["expected"]  # exactly this rank's rows: 1/N up to padding
        assert abs(r["local"] - r["full"] / 2) <= 0.01 * r["full"]
        # Peak while materialising: the shards plus one module's full parameters at a time.
        assert r["init_peak"] < BUDGET_FRACTION * r["full"], (r["init_peak"], r["full"])


def test_initialised_like_the_unsharded_model(results):
    assert all(r["init_error"] == 0.0 for r in results)


def test_trains_beyond_per_rank_budget(results):
    for r in results:
        # Both sides measured on the rank (parameters + gradients + AdamW's moments): the budget
        # is a fraction of what the unsharded step held, so that one does not fit in it; the
        # sharded training state does.
        budget = BUDGET_FRACTION * r["unsharded"]
        assert r["local"] + r["grad"] + r["opt"] < budget, (r["local"], r["grad"], r["opt"], budget)
        assert r["losses"][-1] < r["losses"][0]


class _NoReset(torch.nn.Module):
    """A module without reset_parameters (an RMSNorm's shape), with a buffer its __init__
    computes (a rotary table's)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.register_buffer("table", torch.arange(dim, dtype=torch.float32), persistent=False)
        self.register_buffer("positions", torch.arange(dim), persistent=False)

    def forward(self, x):
        return x * self.weight + self.table


def _meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return graphshard.shard(torch.nn.Sequential(torch.nn.Linear(8, 8), _NoReset(8)))


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_what_materialize_leaves_uninitialised_is_nan_and_named(fake_pg):
    model = _meta_model()
    with pytest.warns(UserWarning, match=r"3 parameter\(s\) or buffer\(s\) were not initialised "
                      r"and hold NaN \(integers: zeros\): 1\.table, 1\.positions, 1\.weight "
                      r".*pass init_fn="):
        graphshard.materialize(model)
    assert model[0]._parameters["weight"].to_local().isfinite().all()  # reset_parameters ran
    assert model[1]._parameters["weight"].to_local().isnan().all() and model[1].table.isnan().all()
    assert (model[1].positions == 0).all()  # alike on every rank, not whatever memory held

    def init(module):
        if isinstance(module, _NoReset):
            module.weight.fill_(1.0)
            module.table.copy_(torch.arange(8.0))
            module.positions = torch.arange(8)  # a new tensor in its place counts as written
        else:
            module.reset_parameters()

    model = _meta_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything written: no warning
        graphshard.materialize(model, init_fn=init)
    assert torch.equal(model[1].table, torch.arange(8.0))
    assert (model[1]._parameters["weight"].to_local() == 1).all()
