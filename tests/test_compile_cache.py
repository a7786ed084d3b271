"""A second run of the same program hits Inductor's FX graph cache for graphshard's graphs.

Two fresh processes, one after the other, sharing a private Inductor cache directory: the first
compiles (misses), the second must find every graph in the cache (hits, no miss), as a job
restart on an unchanged program does. The counters are Dynamo's (`torch._dynamo.utils.counters`).
AOTAutograd's own cache only serves torch.compile's Inductor backend, not a custom backend that
calls AOTAutograd itself, so it is not reachable here; the FX graph cache holds the Inductor
compilation, which is most of the cost.
"""

from __future__ import annotations

import functools
import os

import torch

from graphshard.tools.launch import run_local
from tests.workers import gpt_data
from tests.zoo import TinyGPT, zoo_loss


def _compile_and_step(rank: int, world: int, cache_dir: str) -> dict[str, int]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read by Inductor at each compile
    import graphshard
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = graphshard.shard(TinyGPT("none"))
    compiled = torch.compile(model, backend="graphshard", fullgraph=True)
    (tokens,) = gpt_data(0, batch=4)
    zoo_loss(compiled(tokens), tokens).backward()
    return {key: counters["inductor"][key] for key in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


def test_second_run_hits_the_fx_graph_cache(tmp_path):
    cache = str(tmp_path / "inductor")
    # One rank is enough: the cache key is per graph, and every rank compiles the same graphs.
    first = run_local(_compile_and_step, 1, cache)
    second = run_local(_compile_and_step, 1, cache)
    for rank in range(1):
        assert first[rank]["fxgraph_cache_miss"] >= 2, first  # forward and backward compiled
        assert second[rank] == {"fxgraph_cache_hit": first[rank]["fxgraph_cache_miss"],
                                "fxgraph_cache_miss": 0}, (first, second)
