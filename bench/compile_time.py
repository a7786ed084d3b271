"""`python -m graphshard.bench.compile_time`: time to the first training step, cold and warm caches.

    python -m graphshard.bench.compile_time --model transformer --nproc 2 --repeats 3

For each method, a fresh launch of `--nproc` local processes builds the model, compiles it and
runs one training step (forward, backward, fused AdamW); the time measured on each rank runs
from just before `torch.compile` to the end of that step (interpreter start, imports and model
construction excluded), and the slowest rank's counts. Cold: a new, empty Inductor cache
directory. Warm: the very same launch again on the cache the cold one filled (a job restart on
unchanged code). Methods:

- torch_compile: plain `torch.compile(model)` of the unsharded model, every rank alone (the
  bar graphshard is held to: at most 1.3x warm, 1.5x cold);
- graphshard: `graphshard.shard(model)` + `torch.compile(model, backend="graphshard")`.

Rounds interleave the methods (cold then warm for each), so load on a shared machine affects
each alike; the table shows the median and the range over rounds, and the warm run's hit and
miss counts of AOTAutograd's cache (the whole compiled step: traced, partitioned, graphshard's
passes run) and of Inductor's FX graph cache (each compiled graph), from Dynamo's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from graphshard.bench.workload import build_workload
from graphshard.tools.arguments import parse_model_args

METHODS = ("torch_compile", "graphshard")
CACHE_COUNTERS = (("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"),
                  ("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"))


@dataclass(frozen=True)
class CompileBenchConfig:
    model: str = "transformer"
    model_args: tuple[tuple[str, Any], ...] = ()
    batch: int = 8
    seq: int = 32


def first_step(rank: int, world: int, cfg: CompileBenchConfig, method: str, cache_dir: str) -> dict:
    """One rank: build, compile, one step; seconds from compile to the step's end."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # Inductor reads it at each compile
    import graphshard
    from graphshard._torch_compat import compile_counters

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    workload = build_workload(cfg.model, cfg.batch, cfg.seq, 0, dict(cfg.model_args))
    inputs = workload.local_inputs(rank, world)
    model = workload.model
    start = time.perf_counter()
    if method == "graphshard":
        model = torch.compile(graphshard.shard(model), backend="graphshard")
    else:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    workload.loss_fn(model(*inputs), *inputs).backward()
    optimizer.step()
    counters = compile_counters()
    return {"seconds": time.perf_counter() - start,
            "cache": tuple(counters[kind][key] for kind, key in CACHE_COUNTERS)}


def measure(cfg: CompileBenchConfig, nproc: int, repeats: int) -> dict[str, dict[str, list]]:
    from graphshard.tools.launch import run_local

    results: dict[str, dict[str, list]] = {m: {"cold": [], "warm": [], "warm_cache": []}
                                           for m in METHODS}
    for round_index in range(repeats):
        order = METHODS if round_index % 2 == 0 else tuple(reversed(METHODS))
        for method in order:
            with tempfile.TemporaryDirectory(prefix="graphshard-compile-bench-") as cache:
                for kind in ("cold", "warm"):
                    ranks = run_local(first_step, nproc, cfg, method, cache, timeout_s=900)
                    results[method][kind].append(max(r["seconds"] for r in ranks))
                    if kind == "warm":
                        results[method]["warm_cache"].append(ranks[0]["cache"])
    return results


def summarize(results: dict[str, dict[str, list]]) -> dict[str, dict[str, Any]]:
    summary = {}
    for method, by_kind in results.items():
        summary[method] = {kind: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
                           for kind, v in by_kind.items() if kind != "warm_cache"}
        summary[method]["warm_cache"] = dict(zip((key for _, key in CACHE_COUNTERS),
                                                 by_kind["warm_cache"][-1]))
    base = summary["torch_compile"]
    for method in METHODS:
        for kind in ("cold", "warm"):
            summary[method][kind]["vs_torch_compile"] = (
                summary[method][kind]["median_s"] / base[kind]["median_s"])
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphshard.bench.compile_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="transformer")
    p.add_argument("--model-args", type=parse_model_args, default=(), metavar="K=V,...")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the raw times and the summary here")
    args = p.parse_args(argv)
    cfg = CompileBenchConfig(args.model, args.model_args, args.batch, args.seq)
    results = measure(cfg, args.nproc, args.repeats)
    summary = summarize(results)
    print(f"time to first step: {cfg.model} at world size {args.nproc}, batch {cfg.batch}, "
          f"seq {cfg.seq}, median [min-max] of {args.repeats} rounds, slowest rank")
    print(f"{'method':<14} {'cold s':>20} {'warm s':>20} {'cold x':>7} {'warm x':>7} "
          f"{'warm AOT cache hit/miss':>24} {'warm FX cache hit/miss':>23}")
    for method in METHODS:
        row = summary[method]
        cells = [f"{row[k]['median_s']:6.1f} [{row[k]['min_s']:.1f}-{row[k]['max_s']:.1f}]"
                 for k in ("cold", "warm")]
        aot_hit, aot_miss, fx_hit, fx_miss = row["warm_cache"].values()
        print(f"{method:<14} {cells[0]:>20} {cells[1]:>20} {row['cold']['vs_torch_compile']:7.2f} "
              f"{row['warm']['vs_torch_compile']:7.2f} {f'{aot_hit}/{aot_miss}':>24} "
              f"{f'{fx_hit}/{fx_miss}':>23}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args) | {"model_args": dict(args.model_args)},
                       "raw": results, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
