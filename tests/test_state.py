"""The state graphshard.shard leaves on a model: one ShardState, one record per sharded module,
nothing on tensors or optimizers; and the little logic the state objects have of their own."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphshard
from graphshard.state import (BASE_CLASS_ATTR, MODULE_ATTR, STATE_ATTR, GradSync, SyncMode,
                              module_shards, plain_class, shard_state, sharded_modules,
                              sharded_params)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight


def _graphshard_attributes(obj) -> set[str]:
    return {name for name in vars(obj) if name.startswith("_graphshard")}


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_one_state_per_model_and_one_record_per_sharded_module(fake_pg):
    model = Tied()
    originals = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # before shard(): swapped in
    graphshard.shard(model)
    state = shard_state(model)
    assert state.mesh.size() == 2 and state.async_save is None
    records = dict(sharded_modules(model))
    assert set(records) == {model.emb, model.body[0], model.head}
    assert all(record.model is state for record in records.values())
    assert _graphshard_attributes(model) == {STATE_ATTR}
    for module in model.modules():
        assert _graphshard_attributes(module) <= {STATE_ATTR, MODULE_ATTR}
        assert plain_class(module).__name__ == type(module).__name__.removeprefix("Sharded")
    assert BASE_CLASS_ATTR in vars(type(model.head))
    # Nothing is left on tensors or optimizers: tags would travel with them.
    for tensor in [*originals, *model.parameters()]:
        assert _graphshard_attributes(tensor) == set()
    for record in records.values():
        for shard in record.shards.values():
            assert _graphshard_attributes(shard.leaf) == set()
    assert _graphshard_attributes(optimizer) == set()
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    # Tied weights: one parameter, one local shard, listed once.
    assert records[model.emb].shards["weight"] is records[model.head].shards["weight"]
    assert len(list(sharded_params(model))) == 3  # emb/head weight, body weight and bias


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_local_shards_follow_casts_and_are_bound_again_when_copied(fake_pg):
    model = graphshard.shard(Tied())
    shard = module_shards(model.emb).shards["weight"]
    model.head.double()  # the tied weight's storage moves: both modules follow one new shard
    _ = model.emb.weight  # (a read follows it eagerly)
    moved = module_shards(model.emb).shards["weight"]
    assert moved is not shard and moved is shard.successor and moved.leaf.dtype == torch.float64
    assert module_shards(model.head).shards["weight"] is moved
    assert moved.leaf.data_ptr() == model.emb._parameters["weight"].to_local().data_ptr()

    twin = copy.deepcopy(model)
    copied = module_shards(twin.emb).shards["weight"]
    assert copied.param is twin.emb._parameters["weight"] is not model.emb._parameters["weight"]
    assert module_shards(twin.head).shards["weight"] is copied
    assert module_shards(twin.emb).model is shard_state(twin) is not shard_state(model)
    assert copy.copy(model.body[0]).__dict__[MODULE_ATTR] is module_shards(model.body[0])


def test_grad_sync_mode_and_accumulation():
    sync = GradSync()
    assert sync.mode is SyncMode.SYNC
    sync.requires_all_reduce = False
    assert sync.mode is SyncMode.NO_ALL_REDUCE
    sync.requires_gradient_sync = False
    assert sync.mode is SyncMode.NO_SYNC  # no reduction at all wins over skipping the all-reduce
    leaf = torch.zeros(3, requires_grad=True)
    sync.full_leaves["w"] = leaf
    assert not sync.accumulating(partial=False)
    leaf.sum().backward()
    assert sync.accumulating(partial=False) and not sync.accumulating(partial=True)


def test_state_of_an_unsharded_model_is_refused_by_name():
    assert not graphshard.is_sharded(nn.Linear(2, 2))
    assert module_shards(nn.Linear(2, 2)) is None and plain_class(nn.Linear(2, 2)) is nn.Linear
    with pytest.raises(ValueError, match="not sharded: call graphshard.shard"):
        shard_state(nn.Linear(2, 2))
