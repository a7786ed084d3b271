"""A second run of the same program is served from the compile caches.

Two fresh processes, one after the other, sharing a private Inductor cache directory: the first
compiles (misses), the second must find the compiled step in AOTAutograd's cache (which skips
tracing the joint graph, partitioning it and graphshard's passes, and loads the forward and
backward from Inductor's FX graph cache), as a job restart on an unchanged program does. The
counters are Dynamo's (`torch._dynamo.utils.counters`). Options that change the compiled graphs
must miss.
"""

from __future__ import annotations

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
    # Two ranks with shards of different sizes (TinyGPT's rows are odd), padded to one shape:
    # one rank compiles, the other loads its step, and the cached step computes what the
    # compiled one did. The second run then compiles with other options, which schedule other
    # graphs: AOTAutograd's key must tell them apart.
    firsts = sorted((runs[0] for runs in run_local(_compile_and_step, 2, cache)),
                    key=lambda r: r["autograd_cache_hit"])
    seconds, others = zip(*run_local(_compile_and_step, 2, cache, (None, {"prefetch": 0})))
    assert firsts[0]["fxgraph_cache_miss"] >= 2, firsts[0]  # forward and backward compiled
    assert (firsts[0]["autograd_cache_miss"], firsts[0]["autograd_cache_bypass"]) == (1, 0), firsts[0]
    assert (firsts[1]["autograd_cache_hit"], firsts[1]["autograd_cache_miss"]) == (1, 0), firsts[1]
    for second in seconds:
        # The whole step from AOTAutograd's cache; its forward and backward from the FX graph cache.
        assert (second["autograd_cache_hit"], second["autograd_cache_miss"]) == (1, 0), second
        assert second["fxgraph_cache_miss"] == 0, second
    # each rank computes what it computed in the first run (ranks matched by their gradients)
    for second in seconds:
        first = next(f for f in firsts if torch.equal(f["grads"], second["grads"]))
        assert second["loss"] == first["loss"]
    assert not torch.equal(firsts[0]["grads"], firsts[1]["grads"])  # the ranks' shards differ
    # other options: not the first entry; one rank compiles them, the other loads its result
    others = sorted(others, key=lambda r: r["autograd_cache_hit"])
    assert (others[0]["autograd_cache_hit"], others[0]["autograd_cache_miss"]) == (0, 1), others[0]
    assert (others[1]["autograd_cache_hit"], others[1]["autograd_cache_miss"]) == (1, 0), others[1]


NATIVE = {"all_gather": "native", "reduce_scatter": "native"}  # the NCCL path's collectives


# the default options (on gloo, the all-to-all transports), the option off, the NCCL path's
HOST_RUNS = (("once", None), ("every_rank", {"compile_once_per_host": False}), ("native", NATIVE))


def _host_compiles(rank: int, world: int, cache_dir: str, runs=HOST_RUNS) -> list[dict]:
    """Per option set, in its own cache directory (cold unless an earlier launch filled it): a
    fresh model compiled and stepped twice (fused AdamW); the losses, the final parameters and
    the cache counters."""
    import graphshard
    from torch._dynamo.utils import counters

    results = []
    for name, options in runs:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, name)
        torch._dynamo.reset()
        before = {key: counters[kind][key] for kind, key in COUNTERS}
        torch.manual_seed(0)
        model = graphshard.shard(TinyGPT("none"))  # uneven shards: padded to one shape
        compiled = torch.compile(model, backend="graphshard", fullgraph=True, options=options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        tokens = torch.randint(0, 13, (4, 8), generator=torch.Generator().manual_seed(rank))
        losses = []
        for _ in range(2):
            logits = compiled(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        results.append({"name": name, "losses": losses, "params": params}
                       | {key: counters[kind][key] - before[key] for kind, key in COUNTERS})
    return results


@pytest.mark.slow
def test_one_rank_per_host_compiles_and_the_others_load_its_result(tmp_path):
    ranks = run_local(_host_compiles, 2, str(tmp_path))
    runs = {name: [results[i] for results in ranks] for i, (name, _) in enumerate(HOST_RUNS)}
    # One compile per host, on the all-to-all transports (each rank's own chunk left out, its
    # place looked up when the graph runs) as on the native collectives: one rank compiled the
    # step (AOTAutograd and Inductor missed), the other waited for it and loaded the whole
    # step from AOTAutograd's cache.
    for name in ("once", "native"):
        once = sorted(runs[name], key=lambda r: r["autograd_cache_hit"])
        assert (once[0]["autograd_cache_miss"], once[0]["autograd_cache_hit"]) == (1, 0), once[0]
        assert once[0]["fxgraph_cache_miss"] >= 2, once[0]  # forward and backward
        assert (once[1]["autograd_cache_hit"], once[1]["autograd_cache_miss"]) == (1, 0), once[1]
        assert once[1]["fxgraph_cache_miss"] == 0, once[1]
    # Compiling on every rank (the option off) misses on both ranks.
    for run in runs["every_rank"]:
        assert (run["autograd_cache_hit"], run["autograd_cache_miss"]) == (0, 1), run
    # What the loaded rank computes is what compiling on every rank computes, bit for bit.
    for loaded, own in zip(runs["once"], runs["every_rank"]):
        assert loaded["losses"] == own["losses"]
        for name, value in own["params"].items():
            torch.testing.assert_close(loaded["params"][name], value, atol=0, rtol=0)
    assert runs["once"][0]["losses"] != runs["once"][1]["losses"]  # the ranks' batches differ


AUTO = {"reshard_after_forward": "auto", "memory_budget_mb": 1000.0}
AUTO_RUNS = (("auto_once", AUTO), ("auto_every_rank", AUTO | {"compile_once_per_host": False}))


@pytest.mark.slow
def test_auto_reshard_compiles_once_per_host_and_its_choice_is_this_jobs(tmp_path):
    """"auto" agrees on its choice by a collective during the compile: the rank that loads
    joins it, so one rank compiles; a later job compiles again (its entry is salted with the
    job) with the kernels from the FX graph cache, the other rank loading it."""
    first = run_local(_host_compiles, 2, str(tmp_path), AUTO_RUNS)
    once = sorted((ranks[0] for ranks in first), key=lambda r: r["autograd_cache_hit"])
    assert (once[0]["autograd_cache_miss"], once[0]["autograd_cache_hit"]) == (1, 0), once[0]
    assert (once[1]["autograd_cache_hit"], once[1]["autograd_cache_miss"]) == (1, 0), once[1]
    for loaded, own in ((ranks[0], ranks[1]) for ranks in first):
        assert loaded["losses"] == own["losses"]
        for name, value in own["params"].items():
            torch.testing.assert_close(loaded["params"][name], value, atol=0, rtol=0)
    again = sorted((ranks[0] for ranks in run_local(_host_compiles, 2, str(tmp_path), AUTO_RUNS[:1])),
                   key=lambda r: r["autograd_cache_hit"])
    assert (again[0]["autograd_cache_miss"], again[0]["fxgraph_cache_miss"]) == (1, 0), again[0]
    assert (again[1]["autograd_cache_hit"], again[1]["autograd_cache_miss"]) == (1, 0), again[1]
    for rerun, run in zip(sorted(again, key=lambda r: r["losses"]), sorted(once, key=lambda r: r["losses"])):
        assert rerun["losses"] == run["losses"]


def _policy_without_cache_hash():
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])


_NO_CACHE_HASH = _policy_without_cache_hash()
# a cache_hash, but the key pickles the policy too, and a partial over a list of ops cannot be
# pickled
_UNPICKLABLE = _policy_without_cache_hash()
_UNPICKLABLE.cache_hash = "user-selective-mm"


class _UserSelectiveGPT(TinyGPT):
    """TinyGPT's blocks under a selective-AC policy of the user's (by default one that names
    no cache_hash)."""

    def __init__(self, policy=_NO_CACHE_HASH):
        super().__init__("none")
        self.policy = policy

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False, context_fn=self.policy)
        return self.head(self.norm(h))


@pytest.mark.parametrize("checkpointing, bypassed", [
    ("none", False), ("graphshard selective", False), ("user selective", True),
    ("user selective with a cache_hash", True), ("no_sync", False),
    ("no_sync replica_only", False)])
def test_a_graph_aotautograds_cache_cannot_store_is_compiled_by_every_rank(
        fake_pg, checkpointing, bypassed):
    """One compile per host only where AOTAutograd's cache stores the graph: a rank that waited
    for the claimant would otherwise compile after it, not instead. graphshard's selective
    policy carries a cache_hash, and the accumulating micro-batches' reads are an op (both
    stored); a user's policy without a cache_hash is not, nor one the key cannot pickle (a
    partial over a list of ops), and each rank compiles those at once."""
    import graphshard
    from graphshard.compiler.backend import GraphshardCompiler
    from graphshard.compiler.host_compile import per_rank_compile_reason
    from graphshard.compiler.options import GraphshardOptions

    torch.manual_seed(0)
    model = (_UserSelectiveGPT() if checkpointing == "user selective" else
             _UserSelectiveGPT(_UNPICKLABLE) if checkpointing.startswith("user selective with")
             else TinyGPT("none"))
    if checkpointing == "graphshard selective":
        graphshard.apply_activation_checkpointing(model, "selective")
    if checkpointing == "no_sync replica_only":  # the shard group's reduce-scatter, into a leaf
        from torch.distributed.device_mesh import init_device_mesh

        graphshard.shard(model, init_device_mesh("cpu", (2, 4)), strategy="hybrid_shard")
    else:
        graphshard.shard(model)
    options = GraphshardOptions.from_dict({"compiler": "eager"})
    compiler = GraphshardCompiler(options)
    (tokens,) = gpt_data(0, batch=2)
    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    if checkpointing.startswith("no_sync"):
        with graphshard.no_sync(model, replica_only=checkpointing.endswith("replica_only")):
            zoo_loss(compiled(tokens), tokens).backward()
    else:
        zoo_loss(compiled(tokens), tokens).backward()
    torch._dynamo.reset()
    assert (compiler.cache_bypass is not None) == bypassed, compiler.cache_bypass
    inductor = GraphshardOptions.from_dict({})
    reason = per_rank_compile_reason(inductor, cached=True, bypass=compiler.cache_bypass)
    assert (reason is not None) == bypassed
    if bypassed:
        assert reason.startswith("AOTAutograd's cache cannot store this graph ("), reason


@pytest.mark.parametrize("options, cached, bypass, takes_mesh, expected", [
    ({}, True, None, False, None),
    ({}, True, "a user's policy", True, "tensor parallelism"),
    ({"compile_once_per_host": False, "compiler": "eager"}, False, "x", True, "tensor parallelism"),
    ({"compile_once_per_host": False, "compiler": "eager"}, False, "x", False,
     "compile_once_per_host=False"),
    ({"compiler": "eager"}, False, "x", False, "compiler='eager'"),
    ({}, False, "x", False, "the compile caches"),
    ({}, True, "a user's policy", False, "AOTAutograd's cache cannot store this graph"),
])
def test_a_per_rank_compile_names_the_first_reason_that_applies(options, cached, bypass,
                                                                takes_mesh, expected):
    """A graph that takes a DeviceMesh compiles per rank whatever else holds (its cache key is
    the rank's own); otherwise the option, the compiler, the caches, then the cache's bypass."""
    from graphshard.compiler.host_compile import compile_sharing, per_rank_compile_reason
    from graphshard.compiler.options import GraphshardOptions

    reason = per_rank_compile_reason(GraphshardOptions.from_dict(options), cached=cached,
                                     bypass=bypass, takes_device_mesh=takes_mesh)
    if expected is None:
        assert reason is None
        assert compile_sharing(GraphshardOptions.from_dict(options)) == "once per host"
    else:
        assert reason is not None and reason.startswith(expected), reason


class _Doubled(torch.autograd.Function):
    """A user's autograd.Function: the cache key cannot stand for its code."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _WithUserFunction(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return _Doubled.apply(self.inner(x))


@pytest.mark.parametrize("model_kind, bypassed", [
    ("float8", False), ("float8 checkpointed", False), ("a user's autograd.Function", True),
    ("float8 and a user's autograd.Function", True)])
def test_float8s_autograd_functions_are_keyed_by_name_and_a_users_still_bypass_the_cache(
        fake_pg, model_kind, bypassed):
    """torchao's float8 Linear (its matmul Function and configs in the graph) and graphshard's
    float8 weight Functions: AOTAutograd's cache stores the graph (the key names each Function,
    the salt carries torchao's version), so a host compiles it once; a user's Function still
    keeps the graph from the cache, alone or beside float8's, and each rank compiles it."""
    import graphshard
    from graphshard.compiler.backend import GraphshardCompiler
    from graphshard.compiler.host_compile import per_rank_compile_reason
    from graphshard.compiler.options import GraphshardOptions
    from tests.test_float8 import Net, float8_net

    # checkpointed: the float8 Functions sit in the checkpointed region's subgraph
    model = (float8_net(ac=model_kind.endswith("checkpointed")) if model_kind.startswith("float8")
             else Net())
    if model_kind.endswith("autograd.Function"):
        model = _WithUserFunction(model)
    graphshard.shard(model)
    compiler = GraphshardCompiler(GraphshardOptions.from_dict({"compiler": "eager"}))
    torch.compile(model, backend=compiler, fullgraph=True)(torch.randn(8, 20)).sum().backward()
    torch._dynamo.reset()
    assert (compiler.cache_bypass is not None) == bypassed, compiler.cache_bypass
    reason = per_rank_compile_reason(GraphshardOptions.from_dict({}), cached=True,
                                     bypass=compiler.cache_bypass)
    assert (reason is not None) == bypassed, reason


def test_an_observer_turns_the_cache_off_unless_asked_and_then_keys_it_to_the_job(monkeypatch):
    """An observer wants the graphs themselves, so by default its compiles are not served from
    AOTAutograd's cache; with aot_cache=True they are, on the ranks of its host (the zoo's
    observed runs, the bench's profiled one), and the key names the job, so that one rank of
    each job compiles and observes however warm the cache. "eager" stores nothing."""
    import torch.fx as fx

    from graphshard import _torch_compat as compat
    from graphshard.compiler import compile_cache
    from graphshard.compiler.cost_model import ClusterSpec
    from graphshard.compiler.compile_cache import reuses_cache, salt_cache_key
    from graphshard.compiler.dynamo_graph import SplitContext
    from graphshard.compiler.options import GraphshardOptions

    inductor, eager = GraphshardOptions(), GraphshardOptions(compiler="eager")
    assert reuses_cache(inductor, aot_cache=None, observed=False)
    assert not reuses_cache(inductor, aot_cache=None, observed=True)
    assert reuses_cache(inductor, aot_cache=True, observed=True)
    assert not reuses_cache(inductor, aot_cache=False, observed=False)
    assert not reuses_cache(eager, aot_cache=True, observed=True)

    salts = {}
    for job in ("job-a", "job-b"):
        monkeypatch.setattr(compile_cache, "job_nonce", lambda job=job: job)
        for observed in (False, True):
            gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
            assert salt_cache_key(gm, inductor, ClusterSpec.default(), SplitContext(),
                                  observed=observed)
            salts[job, observed] = compat.cache_key_salt(gm)
    assert salts["job-a", False] == salts["job-b", False]  # a restart is served
    assert salts["job-a", True] != salts["job-b", True]  # another job compiles again
    assert salts["job-a", True] != salts["job-a", False]
