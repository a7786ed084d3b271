"""Same initial model on every rank: after shard(), each rank's shards are slices of rank 0's full
tensors and replicated parameters and buffers are rank 0's, whatever each rank was seeded with;
after materialize(), the full model is the same at world sizes 1, 2 and 3."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from graphshard.initial_sync import sync_initial_state
from graphshard.tools.launch import run_local
from graphshard.sharding import shard_state
from tests.zoo import Zoo


def _seed_unalike(rank: int) -> None:
    torch.manual_seed(1000 + 17 * rank)  # as an unseeded script would be: each rank differs


def _zoo(rank: int, **kwargs) -> Zoo:
    """A Zoo whose every parameter and buffer differs between ranks (its 0-dim `scale` and its
    buffer are constants by construction: drawn here)."""
    _seed_unalike(rank)
    model = Zoo(**kwargs)
    with torch.no_grad():
        model.scale.normal_()
        model.offset.normal_()
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors before sharding (tied weights once), and buffers."""
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers()})
    return state


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local shards (replicated parameters whole) and buffers, after sharding."""
    out = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.clone() for n, b in model.named_buffers()})
    return out


def _shard_worker(rank, world):
    results = {}
    for strategy in ("full_shard", "no_shard"):
        model = _zoo(rank)
        before = _state(model)
        graphshard.shard(model, strategy=strategy)
        results[strategy] = (before, _locals(model))

    # Opted out: each rank keeps slices of what it built.
    model = _zoo(rank)
    before = _state(model)
    graphshard.shard(model, sync_module_states=False)
    results["opt_out"] = (before, _locals(model))

    # Called on an already sharded model: in place, into the very tensors the parameters hold.
    model = _zoo(rank)
    originals = list(model.parameters())
    graphshard.shard(model, sync_module_states=False)
    params = list(model.parameters())
    storage = [p.to_local().untyped_storage().data_ptr() for p in params]
    sync_initial_state(model, shard_state(model).mesh, zip(originals, params))
    results["in_place"] = (
        all(a is b for a, b in zip(params, model.parameters())),
        storage == [p.to_local().untyped_storage().data_ptr() for p in model.parameters()],
        _locals(model)["emb.weight"])

    # Ranks that built different models: a clear error on every rank, not a hang.
    model = _zoo(rank, vocab=11 + rank)
    try:
        graphshard.shard(model)
        results["mismatch"] = None
    except ValueError as exc:
        results["mismatch"] = str(exc)
    results["materialize"] = _materialize_worker(rank, world)  # one launch for world size 2
    return results


def _hybrid_worker(rank, world):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _zoo(rank)
    before = _state(model)
    graphshard.shard(model, mesh, strategy="hybrid_shard")
    return before, _locals(model), mesh.get_coordinate()


def _chunk(full: torch.Tensor, index: int, size: int) -> torch.Tensor:
    chunks = full.chunk(size)
    return chunks[index] if index < len(chunks) else full[:0]


def _check_from_rank0(per_rank, shard_coordinate, shard_size, sharded_names):
    """Each rank's local tensors against rank 0's full ones."""
    origin = per_rank[0][0]
    for rank, (before, local) in enumerate(per_rank):
        for name, full in origin.items():
            expected = (_chunk(full, shard_coordinate(rank), shard_size)
                        if name in sharded_names else full)
            assert torch.equal(local[name], expected), (rank, name)


ZOO_SHARDED = {"emb.weight", "block.weight", "block.bias", "frozen.weight", "frozen.bias",
               "gate.weight", "gate.bias"}  # all but the 0-dim `scale` (and the buffer)


@pytest.fixture(scope="module")
def shard_results():
    return run_local(_shard_worker, 2)


def test_ranks_seeded_unalike_start_from_rank0_model(shard_results):
    before = [r["full_shard"][0] for r in shard_results]
    # The test can fail: unseeded, the ranks built different parameters and buffers.
    assert all(not torch.equal(before[0][n], before[1][n]) for n in before[0])
    _check_from_rank0([r["full_shard"] for r in shard_results], lambda rank: rank, 2, ZOO_SHARDED)
    # no_shard: every parameter replicated, all of them rank 0's
    _check_from_rank0([r["no_shard"] for r in shard_results], lambda rank: 0, 1, set())


def test_opting_out_keeps_each_ranks_own_slices(shard_results):
    for rank, r in enumerate(shard_results):
        before, local = r["opt_out"]
        assert torch.equal(local["emb.weight"], _chunk(before["emb.weight"], rank, 2))
    rank1_before, rank1_local = shard_results[1]["opt_out"]
    rank0_full = shard_results[0]["opt_out"][0]["emb.weight"]
    assert not torch.equal(rank1_local["emb.weight"], _chunk(rank0_full, 1, 2))


def test_sync_writes_into_the_parameters_local_tensors(shard_results):
    rank0_full = shard_results[0]["opt_out"][0]["emb.weight"]  # same seed as the in-place run
    for rank, r in enumerate(shard_results):
        same_objects, same_storage, emb = r["in_place"]
        assert same_objects and same_storage
        assert torch.equal(emb, _chunk(rank0_full, rank, 2))


def test_different_models_on_ranks_are_refused_clearly(shard_results):
    for r in shard_results:
        assert r["mismatch"] and "ranks built different models" in r["mismatch"]


def test_hybrid_replica_groups_start_from_rank0_model():
    results = run_local(_hybrid_worker, 4)
    coordinate = {rank: coord for rank, (_, _, coord) in enumerate(results)}
    assert not torch.equal(results[0][0]["emb.weight"], results[2][0]["emb.weight"])
    _check_from_rank0([(b, loc) for b, loc, _ in results], lambda rank: coordinate[rank][1], 2,
                      ZOO_SHARDED)


# --------------------------------------------------------------------------- meta + materialize


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.value = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.value)


class _Init(nn.Module):
    """Uneven shards (11 and 5 rows at world sizes 2 and 3) and a randomly initialised 0-dim
    parameter, every module with a reset_parameters for materialize()."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 5)
        self.gain = _Scalar()


def _materialize_worker(rank, world):
    out = {}
    for strategy in ("full_shard", "no_shard"):
        # Rank 0 seeded 0, the others not alike: the full model must be the seed-0 one.
        torch.manual_seed(0) if rank == 0 else _seed_unalike(rank)
        with torch.device("meta"):
            model = _Init()
        graphshard.shard(model, strategy=strategy)
        graphshard.materialize(model, device="cpu")
        out[strategy] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_materialized_model_is_the_same_at_every_world_size(world, shard_results):
    torch.manual_seed(0)
    reference = dict(_Init().named_parameters())
    results = ([r["materialize"] for r in shard_results] if world == 2
               else run_local(_materialize_worker, world))
    for rank, per_strategy in enumerate(results):
        for strategy, full in per_strategy.items():
            for name, ref in reference.items():
                assert torch.equal(full[name], ref.detach()), (world, rank, strategy, name)
