"""Ranks agree on one collective schedule: a short last batch trains right, a rank-dependent
forward fails at compile time on every rank with a graphshard error.

World size 2 on gloo, a tiny Hugging Face Llama (tests/model_zoo.py) given a different number
of rows on each rank, one SGD step per batch, against a single process: under DDP's semantics
the gradient is the mean over ranks of each rank's mean-loss gradient. One spawned group runs
every configuration (Inductor compiles dominate the time).
"""

from __future__ import annotations

import time

import pytest
import torch

from graphshard.tools.launch import run_local

pytestmark = pytest.mark.timeout(1800)

WORLD, SEQ, LR = 2, 8, 0.5
TOL = 1e-5  # fp32: per-rank graphs change only the order of float sums
NATIVE = {"all_gather": "native", "reduce_scatter": "native"}
# (name, torch.compile arguments or None for eager, rows per rank for each step)
CONFIGS = [
    # the second step: rank 1 alone recompiles; the third: rank 0 alone, to an odd batch
    ("inductor-4v1-then-4v2-then-3v2", {}, [(4, 1), (4, 2), (3, 2)]),
    ("inductor-dynamic-4v1", {"dynamic": True}, [(4, 1)]),
    ("eager-4v1", None, [(4, 1)]),
    ("inductor-native-4v1", {"options": NATIVE}, [(4, 1)]),  # the NCCL path's collectives
    # planned alone, the backward's prefetches and reductions would be ordered differently
    ("graphs-only-16v4", {"options": {"compiler": "eager"}}, [(16, 4)]),
]


def _model(name: str) -> torch.nn.Module:
    """The zoo's untied Llama; one layer under Inductor (each rank compiles its own batch
    shapes), the zoo's two where only the graphs are checked: their backward's prefetches and
    reductions, planned alone, would be ordered differently."""
    from transformers import LlamaForCausalLM

    from tests.model_zoo import ZOO

    model = ZOO["llama-untied"].build()
    if name.startswith("graphs-only"):
        return model
    torch.manual_seed(0)
    model.config.num_hidden_layers = 1
    return LlamaForCausalLM(model.config)


def _tokens(step: int, rows: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 64, (rows, SEQ), generator=generator)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    from tests.model_zoo import causal_lm_loss
    return causal_lm_loss(model(input_ids=tokens).logits, tokens)


def _train(rank: int, world: int, name: str, compile_args, steps) -> dict:
    import traceback

    try:
        return {"params": _steps(rank, name, compile_args, steps), "error": None}
    except Exception:  # reported by the test, with the rank's traceback
        return {"params": [], "error": traceback.format_exc()}


def _steps(rank: int, name: str, compile_args, steps) -> list[dict[str, torch.Tensor]]:
    import graphshard

    model = _model(name)
    graphshard.shard(model)
    fn = model if compile_args is None else torch.compile(model, backend="graphshard",
                                                          fullgraph=True, **compile_args)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = []
    for step, rows in enumerate(steps):
        _loss(fn, _tokens(step, rows[rank], rank)).backward()
        opt.step()
        opt.zero_grad()
        params.append({n: p.full_tensor() for n, p in model.named_parameters()})
    torch._dynamo.reset()
    return params


BRANCH_OPTIONS = {"default": {}, "native": NATIVE}


class RankBranch(torch.nn.Module):
    """A forward that runs a module on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.extra = torch.nn.Linear(16, 16)
        self.last = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = self.first(x)
        if torch.distributed.get_rank() == 0:
            x = self.extra(x)
        return self.last(x)


def _rank_branch(rank: int, options: dict) -> dict:
    import graphshard

    model = RankBranch()
    graphshard.shard(model)
    fn = torch.compile(model, backend="graphshard", options=options)  # Inductor by default
    start = time.perf_counter()
    try:
        fn(torch.randn(4, 16)).sum().backward()
    except Exception as exc:  # the test checks its type
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def worker(rank: int, world: int) -> dict:
    results = {name: _train(rank, world, name, args, steps) for name, args, steps in CONFIGS}
    for name, options in BRANCH_OPTIONS.items():
        results[f"rank-branch-{name}"] = _rank_branch(rank, options)
    return results


def reference(name: str, steps) -> list[dict[str, torch.Tensor]]:
    """One process, each step: the mean over ranks of each rank's mean loss on its rows."""
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = []
    for step, rows in enumerate(steps):
        losses = [_loss(model, _tokens(step, rows[rank], rank)) for rank in range(WORLD)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_local(worker, WORLD, timeout_s=1200)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow  # one launch of every configuration: cold Inductor compiles
@pytest.mark.parametrize("name,steps", [(name, steps) for name, _, steps in CONFIGS],
                         ids=[name for name, _, _ in CONFIGS])
def test_uneven_batches_train_as_ddp(runs, name, steps):
    expected = reference(name, steps)
    for rank in range(WORLD):
        assert runs[rank][name]["error"] is None, f"rank {rank}:\n{runs[rank][name]['error']}"
        assert len(runs[rank][name]["params"]) == len(steps)
        for step, params in enumerate(runs[rank][name]["params"]):
            diff = _max_diff(params, expected[step])
            assert diff < TOL, f"{name}, rank {rank}, after step {step}: {diff:.3g} off DDP"


@pytest.mark.slow  # the launch above
@pytest.mark.parametrize("transport", list(BRANCH_OPTIONS))
def test_a_rank_dependent_branch_fails_at_compile_time_on_every_rank(runs, transport):
    for rank in range(WORLD):
        result = runs[rank][f"rank-branch-{transport}"]
        assert result["error"] is not None, f"rank {rank} ran a mismatched schedule"
        message = result["error"]
        assert message.startswith("ScheduleMismatchError: "), message
        assert "different collective schedules for the forward graph" in message
        assert "extra.weight" in message  # the first collective that differs serves it
        assert "rank-dependent branch" in message
        # raised before Inductor compiles the graph; a hang would be the 300 s wait
        assert result["seconds"] < 60, result["seconds"]


class SwappedOnRankOne(torch.nn.Module):
    """Two layers of one shape, run in the other order on rank 1: their gathers pair with
    each other's, equal in size (without a check: wrong numbers, no error)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16, bias=False)
        self.b = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        first, second = (self.a, self.b) if torch.distributed.get_rank() == 0 else (self.b, self.a)
        return second(first(x))


def _eager_error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the test checks its type and message
        return f"{type(exc).__name__}: {exc}"
    return None


def eager_worker(rank: int, world: int) -> dict:
    import graphshard

    results = {}
    model = SwappedOnRankOne()
    graphshard.shard(model)
    results["swapped"] = _eager_error(lambda: model(torch.randn(4, 16)).sum().backward())
    # rank 0 alone reads one more parameter; rank 1 stays alive, in no collective
    extra = RankBranch()
    graphshard.shard(extra)
    start = time.perf_counter()
    if rank == 0:
        results["alone"] = _eager_error(lambda: extra.last(torch.randn(4, 16)))
    else:
        time.sleep(EAGER_TIMEOUT_S + 10)
        results["alone"] = None
    results["seconds"] = time.perf_counter() - start
    return results


EAGER_TIMEOUT_S = 10  # the process group's timeout


@pytest.fixture(scope="module")
def eager_runs() -> list[dict]:
    return run_local(eager_worker, WORLD, timeout_s=EAGER_TIMEOUT_S)


@pytest.mark.slow  # waits out the process group's timeout
def test_eager_ranks_running_different_code_get_an_error_naming_the_parameters(eager_runs):
    for rank in range(WORLD):
        message = eager_runs[rank]["swapped"]
        assert message is not None, f"rank {rank} paired the two layers' gathers silently"
        assert message.startswith("EagerCollectiveMismatchError: "), message
        mine, theirs = ("a", "b") if rank == 0 else ("b", "a")
        assert f"rank {rank} ran the all-gather of {mine}.weight" in message, message
        assert f"ran the all-gather of {theirs}.weight" in message, message
    message = eager_runs[0]["alone"]
    assert message is not None and message.startswith("EagerCollectiveMismatchError: "), message
    assert "the all-gather of last.weight" in message and "timeout" in message, message
    assert eager_runs[0]["seconds"] < EAGER_TIMEOUT_S + 30, eager_runs[0]["seconds"]


def cache_worker(rank: int, world: int) -> dict:
    """Rank 1 says it loaded a Dynamo graph's compile from the compile caches (no graph of
    ours ran, so it publishes no schedule); rank 0 compiles that graph and checks it. Then
    rank 1 loads a graph whose schedule no rank published."""
    from graphshard.compiler.schedule_check import check_schedule, record_served_from_cache
    from tests.pass_graphs import gather_graph

    gm = gather_graph(world, [("layers.0.a", (8, 4), torch.float32)], rank=rank)
    result = {}
    if rank == 1:
        record_served_from_cache("served")
        torch.distributed.barrier()
        record_served_from_cache("unknown")
    else:
        start = time.perf_counter()
        check_schedule(gm, "forward", dynamo_key="served", wait_s=60)
        result["served_s"] = time.perf_counter() - start
        torch.distributed.barrier()
        time.sleep(0.5)  # rank 1 records its second load
        start = time.perf_counter()
        result["other"] = _eager_error(
            lambda: check_schedule(gm, "forward", dynamo_key="another graph", wait_s=2))
        result["other_s"] = time.perf_counter() - start
    torch.distributed.barrier()  # rank 0's process holds the store
    return result


def test_the_schedule_check_accepts_a_peer_served_from_the_compile_cache():
    results = run_local(cache_worker, WORLD)
    assert results[0]["served_s"] < 10, results[0]  # not the wait for a schedule
    # a peer that loaded another graph from its cache is no answer
    assert results[0]["other"].startswith("ScheduleMismatchError: "), results[0]
    assert "compiled no forward graph" in results[0]["other"], results[0]


def loader_worker(rank: int, world: int) -> dict:
    """Three ranks of one host: rank 0 compiles graph A; ranks 1 and 2 run graph B (another
    place in a mesh: other code, the same schedule), which rank 2 compiles and rank 1 loads
    once rank 2 is done. Rank 1 publishes no schedule while it waits: rank 0 must take rank 2's
    as rank 1's, not wait for rank 1 (which waits for rank 2, which waits for rank 0)."""
    from graphshard.compiler.schedule_check import check_schedule, record_served_from_cache
    from tests.pass_graphs import gather_graph

    gm = gather_graph(world, [("layers.0.a", (9, 4), torch.float32)], rank=0)
    result = {}
    if rank == 1:
        record_served_from_cache("B")
    else:
        start = time.perf_counter()
        check_schedule(gm, "forward", dynamo_key="A" if rank == 0 else "B", wait_s=60)
        result["seconds"] = time.perf_counter() - start
    torch.distributed.barrier()  # rank 0's process holds the store
    return result


def test_the_schedule_check_takes_a_loading_peer_schedule_from_its_graph_compiler():
    results = run_local(loader_worker, 3)
    assert results[0]["seconds"] < 10 and results[2]["seconds"] < 10, results
