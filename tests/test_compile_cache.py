"""A second run of the same program is served from the compile caches.

Two fresh processes, one after the other, sharing a private Inductor cache directory: the first
compiles (misses), the second must find the compiled step in AOTAutograd's cache (which skips
tracing the joint graph, partitioning it and graphshard's passes, and loads the forward and
backward from Inductor's FX graph cache), as a job restart on an unchanged program does. The
counters are Dynamo's (`torch._dynamo.utils.counters`). Options that change the compiled graphs
must miss.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from graphshard.tools.launch import run_local
from tests.workers import gpt_data
from tests.zoo import TinyGPT, zoo_loss


COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
            ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"),
            ("aot_autograd", "autograd_cache_bypass"))


def _compile_and_step(rank: int, world: int, cache_dir: str, option_sets: tuple = (None,)
                      ) -> list[dict[str, int]]:
    """Per option set, one after the other in this process: a fresh sharded model compiled and
    stepped once; its loss, gradients and the cache counters this compile moved."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read by Inductor at each compile
    import graphshard
    from torch._dynamo.utils import counters

    results = []
    for options in option_sets:
        torch._dynamo.reset()
        before = {key: counters[kind][key] for kind, key in COUNTERS}
        torch.manual_seed(0)
        model = graphshard.shard(TinyGPT("none"))
        compiled = torch.compile(model, backend="graphshard", fullgraph=True, options=options)
        (tokens,) = gpt_data(0, batch=4)
        loss = zoo_loss(compiled(tokens), tokens)
        loss.backward()
        grads = torch.stack([p.grad.to_local().square().sum() for p in model.parameters()
                             if p.grad is not None])
        results.append({"loss": loss.item(), "grads": grads}
                       | {key: counters[kind][key] - before[key] for kind, key in COUNTERS})
    return results


@pytest.mark.slow
def test_second_run_is_served_from_the_compile_caches(tmp_path):
    cache = str(tmp_path / "inductor")
    # Two ranks with shards of different sizes (TinyGPT's rows are odd): each rank's entry is
    # its own, and the cached step computes what the compiled one did. The second run then
    # compiles with other options, which schedule other graphs: AOTAutograd's key must tell
    # them apart.
    firsts = [runs[0] for runs in run_local(_compile_and_step, 2, cache)]
    seconds, others = zip(*run_local(_compile_and_step, 2, cache, (None, {"prefetch": 0})))
    for first, second in zip(firsts, seconds):
        assert first["fxgraph_cache_miss"] >= 2, first  # forward and backward compiled
        assert (first["autograd_cache_miss"], first["autograd_cache_bypass"]) == (1, 0), first
        # The whole step from AOTAutograd's cache; its forward and backward from the FX graph cache.
        assert (second["autograd_cache_hit"], second["autograd_cache_miss"]) == (1, 0), second
        assert second["fxgraph_cache_miss"] == 0, second
        assert second["loss"] == first["loss"]
        torch.testing.assert_close(second["grads"], first["grads"], atol=0, rtol=0)
    assert not torch.equal(firsts[0]["grads"], firsts[1]["grads"])  # the ranks' shards differ
    for other in others:
        assert (other["autograd_cache_hit"], other["autograd_cache_miss"]) == (0, 1), other
