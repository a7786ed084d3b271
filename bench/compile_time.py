"""`python -m graphshard.bench.compile_time`: time to the first training step, cold and warm caches.

    python -m graphshard.bench.compile_time --model transformer --nproc 1,2,4 --repeats 1

For each method and world size, a fresh launch of `--nproc` local processes builds the model,
compiles it and runs one training step (forward, backward, fused AdamW); the time measured on
each rank runs from just before `torch.compile` to the end of that step (interpreter start,
imports and model construction excluded): the slowest rank's wall time, and the CPU seconds of
all ranks together (each rank's own and its compile workers'). Cold: a new, empty Inductor
cache directory. Warm: the very same launch again on the cache the cold one filled (a job
restart on unchanged code). Methods:

- torch_compile: plain `torch.compile(model)` of the unsharded model, every rank alone (the
  bar graphshard is held to);
- graphshard: `graphshard.shard(model)` + `torch.compile(model, backend="graphshard")`, default
  options (on gloo, the all-to-all transports); one rank per host compiles and the others load
  its result from the compile caches;
- graphshard_native: the same with all_gather="native", reduce_scatter="native" (the NCCL
  path's collectives);
- graphshard_native_auto: the same with reshard_after_forward="auto" (its choice agreed by a
  collective during the compile, which the loading ranks join; a warm restart compiles again,
  its kernels from the FX graph cache).

Rounds interleave the methods (cold then warm for each), so load on a shared machine affects
each alike; the table shows the median and the range over rounds, and the warm run's hit and
miss counts of AOTAutograd's cache (the whole compiled step: traced, partitioned, graphshard's
passes run) and of Inductor's FX graph cache (each compiled graph), from Dynamo's counters, of
rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate

from graphshard.bench.workload import build_workload
from graphshard.tools.arguments import parse_model_args

NATIVE = {"all_gather": "native", "reduce_scatter": "native"}
METHODS = {"torch_compile": None, "graphshard": None, "graphshard_native": NATIVE,
           # "auto" agrees on its choice by a collective during the compile (a budget every
           # configuration fits: the compile's work, not the choice, is measured)
           "graphshard_native_auto": NATIVE | {"reshard_after_forward": "auto",
                                               "memory_budget_mb": 100_000.0}}
CACHE_COUNTERS = (("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"),
                  ("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"))


@dataclass(frozen=True)
class CompileBenchConfig:
    model: str = "transformer"
    model_args: tuple[tuple[str, Any], ...] = ()
    batch: int = 8
    seq: int = 32


def cpu_seconds() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (Inductor's
    compile workers live as long as the process)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    return total + sum(_process_cpu(pid) for pid in _descendants(os.getpid()))


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _process_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def first_step(rank: int, world: int, cfg: CompileBenchConfig, method: str, cache_dir: str) -> dict:
    """One rank: build, compile, one step; wall and CPU seconds from compile to the step's end."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # Inductor reads it at each compile
    import graphshard
    from graphshard._torch_compat import compile_counters

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    workload = build_workload(cfg.model, cfg.batch, cfg.seq, 0, dict(cfg.model_args))
    inputs = workload.local_inputs(rank, world)
    model = workload.model
    start, start_cpu = time.perf_counter(), cpu_seconds()
    if method == "torch_compile":
        model = torch.compile(model)
    else:
        model = torch.compile(graphshard.shard(model), backend="graphshard",
                              options=METHODS[method])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    workload.loss_fn(model(*inputs), *inputs).backward()
    optimizer.step()
    counters = compile_counters()
    return {"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - start_cpu,
            "cache": tuple(counters[kind][key] for kind, key in CACHE_COUNTERS)}


def measure(cfg: CompileBenchConfig, nprocs: list[int], repeats: int, methods: list[str]
            ) -> dict[str, dict[str, list]]:
    """{"method/world size": {"cold": [s], "cold_cpu": [s], "warm": ..., "warm_cache": ...}}"""
    from graphshard.tools.launch import run_local

    results: dict[str, dict[str, list]] = {}
    for round_index in range(repeats):
        order = methods if round_index % 2 == 0 else list(reversed(methods))
        for nproc in nprocs:
            for method in order:
                row = results.setdefault(f"{method}/{nproc}", {})
                with tempfile.TemporaryDirectory(prefix="graphshard-compile-bench-") as cache:
                    for kind in ("cold", "warm"):
                        ranks = run_local(first_step, nproc, cfg, method, cache, timeout_s=900)
                        row.setdefault(kind, []).append(max(r["seconds"] for r in ranks))
                        row.setdefault(f"{kind}_cpu", []).append(sum(r["cpu_seconds"] for r in ranks))
                        row.setdefault(f"{kind}_cache", []).append(ranks[0]["cache"])
    return results


def summarize(results: dict[str, dict[str, list]]) -> dict[str, dict[str, Any]]:
    summary = {}
    for row, by_kind in results.items():
        summary[row] = {kind: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
                        for kind, v in by_kind.items() if not kind.endswith("_cache")}
        summary[row]["warm_cache"] = dict(zip((key for _, key in CACHE_COUNTERS),
                                              by_kind["warm_cache"][-1]))
    for row in summary:  # CPU seconds against the same method at world size 1
        method = row.split("/")[0]
        alone = summary.get(f"{method}/1")
        for kind in ("cold_cpu", "warm_cpu"):
            summary[row][kind]["vs_world_1"] = (summary[row][kind]["median_s"]
                                                / alone[kind]["median_s"] if alone else None)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphshard.bench.compile_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="transformer")
    p.add_argument("--model-args", type=parse_model_args, default=(), metavar="K=V,...")
    p.add_argument("--nproc", default="1,2,4", help="world sizes, comma-separated")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", help="write the raw times and the summary here")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    nprocs = [int(n) for n in args.nproc.split(",")]
    cfg = CompileBenchConfig(args.model, args.model_args, args.batch, args.seq)
    summary = summarize(results := measure(cfg, nprocs, args.repeats, methods))
    print(f"time to first step: {cfg.model}, batch {cfg.batch}, seq {cfg.seq}, median [min-max] "
          f"of {args.repeats} round(s); wall: the slowest rank; CPU: all ranks together")
    rows = []
    for row, r in summary.items():
        method, nproc = row.split("/")
        cell = lambda k: f"{r[k]['median_s']:.1f} [{r[k]['min_s']:.1f}-{r[k]['max_s']:.1f}]"  # noqa: E731
        ratio = lambda k: "" if r[k]["vs_world_1"] is None else f"{r[k]['vs_world_1']:.2f}"  # noqa: E731
        aot_hit, aot_miss, fx_hit, fx_miss = r["warm_cache"].values()
        rows.append((method, nproc, cell("cold"), cell("cold_cpu"), ratio("cold_cpu"), cell("warm"),
                     cell("warm_cpu"), ratio("warm_cpu"), f"{aot_hit}/{aot_miss}", f"{fx_hit}/{fx_miss}"))
    print(tabulate(rows, headers=["method", "world", "cold wall s", "cold CPU s", "CPU x world 1",
                                  "warm wall s", "warm CPU s", "CPU x world 1",
                                  "warm AOT hit/miss", "warm FX hit/miss"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args) | {"model_args": dict(args.model_args)},
                       "raw": results, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
