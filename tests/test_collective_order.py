"""One collective order on every rank: the schedule digest, ranks with different batches, a
given order followed, two models of one architecture kept apart."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphshard.tools.models import build_model
from graphshard.passes.bucket_collectives import bucket_collectives
from tests.capture import capture_step
from tests.pass_graphs import gather_graph, ctx


def test_the_schedule_digest_tells_apart_schedules_that_would_pair_wrongly():
    """Another bucket size, another order of the same collectives (equal sizes: they would pair
    without error and mix two parameters' shards), or one collective more: each is another
    digest, and the record names the parameters each collective serves."""
    from graphshard.passes.schedule_digest import collective_sequence, schedule_digest

    params = [("layers.0.a", (8, 4), torch.float32), ("layers.1.a", (8, 4), torch.float32)]
    base = collective_sequence(bucket_collectives(gather_graph(4, params), ctx(bucket_mb=64)))
    assert [r.params for r in base] == [("layers.0.a",), ("layers.1.a",)]
    wider = collective_sequence(bucket_collectives(
        gather_graph(4, [("layers.0.a", (8, 8), torch.float32), params[1]]), ctx(bucket_mb=64)))
    more = collective_sequence(bucket_collectives(
        gather_graph(4, params + [("layers.2.a", (8, 4), torch.float32)]), ctx(bucket_mb=64)))
    digests = {schedule_digest(base), schedule_digest(wider), schedule_digest(more),
               schedule_digest(base[::-1])}
    assert len(digests) == 4


def _step_digests(batch: int) -> dict[str, str]:
    from graphshard.passes.schedule_digest import collective_sequence, schedule_digest

    torch.manual_seed(0)
    model, inputs, loss_fn = build_model("transformer", dim=64, n_layers=3, vocab_size=64,
                                         batch=batch, seq_len=16)
    graphs = capture_step(model, inputs, loss_fn)
    return {kind: schedule_digest(collective_sequence(graphs[(kind, "freed")]))
            for kind in ("forward", "backward")}


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_ranks_with_different_batches_issue_collectives_in_one_order(fake_pg, monkeypatch):
    """Two ranks, one given 4 rows and one 16: planned alone, the scheduler's compute and memory
    weights (local activations) order the backward's prefetches and reductions differently;
    through one store (the default process group's, here an in-process one) the second rank
    adopts the first one's order, and its step still runs."""
    from graphshard.compiler import rank_agreement

    alone = [_step_digests(4), _step_digests(16)]
    assert alone[0]["backward"] != alone[1]["backward"]  # what would pair wrongly
    store = dist.HashStore()
    monkeypatch.setattr(rank_agreement, "agreement_store", lambda: store)
    agreed = [_step_digests(4), _step_digests(16)]
    assert agreed[0] == agreed[1] == alone[0]
    # the other way round: the 16-row rank plans first, the 4-row rank follows it
    monkeypatch.setattr(rank_agreement, "agreement_store", lambda store=dist.HashStore(): store)
    assert [_step_digests(16), _step_digests(4)] == [alone[1], alone[1]]


def test_a_graph_follows_a_given_collective_order_where_its_data_allows():
    from graphshard.passes.collective_order import follow_collective_order, issue_order

    params = [("layers.0.a", (8, 4), torch.float32), ("layers.1.a", (8, 4), torch.float32)]
    gm = bucket_collectives(gather_graph(4, params), ctx(bucket_mb=64))
    mine = issue_order(gm)
    swapped = follow_collective_order(gm, mine[::-1])
    assert swapped is not None and issue_order(swapped) == mine[::-1]
    swapped.graph.lint()
    assert follow_collective_order(gm, mine[:1]) is None  # not the graph it was planned on


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_two_models_of_one_architecture_take_their_decisions_apart(fake_pg, monkeypatch):
    """shard() numbers the models it makes in program order (alike on every rank), and the
    key of a decision shared through the store names the model: a second model of the same
    architecture, given another batch, does not adopt the first one's decision."""
    import graphshard
    from graphshard.compiler import rank_agreement
    from graphshard.passes.graph_utils import unshard_specs

    store = dist.HashStore()
    monkeypatch.setattr(rank_agreement, "agreement_store", lambda: store)
    keys, indices = [], []
    for batch in (1, 4):
        torch.manual_seed(0)
        model, inputs, loss_fn = build_model("transformer", dim=32, n_layers=2, vocab_size=32,
                                             batch=batch, seq_len=8)
        graphshard.shard(model)
        joint = capture_step(model, inputs, loss_fn)[("joint", "tagged")]
        names = sorted(unshard_specs(joint))
        keys.append(rank_agreement.decision_key(joint, names, "default"))
        indices.append({spec.model for spec in unshard_specs(joint).values()})
    assert indices == [{0}, {1}]
    assert keys[0] != keys[1]
