"""`graphshard calibrate`: measure this machine's cost-model parameters into a ClusterSpec.

All-gathers timed on local gloo processes (graphshard.tools.launch.run_local), a matmul, a copy
and a tiny kernel; the JSON it writes is what ClusterSpec.from_json loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from graphshard.compiler.cost_model import ClusterSpec, collective_time, fit_alpha_beta
from graphshard.tools.launch import run_local

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)


def _median_time(fn: Any, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_all_gathers(rank: int, world_size: int, sizes: Sequence[int],
                      repeats: int) -> list[tuple[int, float]]:
    """On each rank: [(gathered bytes, median seconds)] of all-gathers of each size. The sizes
    take turns within each repetition, so a burst of load from elsewhere on a shared machine
    slows every size alike instead of inverting small against large."""
    buffers = []
    for size in sizes:
        shard = torch.ones(max(size // (4 * world_size), 1))
        buffers.append((shard, torch.empty(shard.numel() * world_size)))
    times: list[list[float]] = [[] for _ in sizes]
    for repetition in range(3 + repeats):  # the first three warm up
        for (shard, full), size_times in zip(buffers, times):
            dist.barrier()  # start together, so the timing is the collective alone
            start = time.perf_counter()
            dist.all_gather_single(full, shard)
            if repetition >= 3:
                size_times.append(time.perf_counter() - start)
    return [(full.numel() * 4, statistics.median(t)) for (_, full), t in zip(buffers, times)]


def _time_tiny_training_step(rank: int, world_size: int, repeats: int) -> float:
    """Median time of one compiled graphshard training step of a model too small to compute
    anything (2 blocks of width 32): what a step costs the host beyond its kernels."""
    import graphshard
    from graphshard.tools.models import build_model

    model, inputs, loss_fn = build_model("transformer", dim=32, n_layers=2, n_heads=2,
                                         vocab_size=64, batch=1, seq_len=8)
    compiled = torch.compile(graphshard.shard(model), backend="graphshard")
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)

    def step():
        loss_fn(compiled(*inputs), *inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _median_time(step, repeats, warmup=3)


def measure_step_overhead(world_size: int = 2, repeats: int = 10) -> float:
    per_rank = run_local(_time_tiny_training_step, world_size, repeats, timeout_s=300, threads=1)
    return float(max(per_rank))


def measure_all_gather(world_size: int = 2, sizes: Iterable[int] = (),
                       repeats: int = 10) -> list[tuple[int, float]]:
    """[(gathered bytes, median seconds)] of gloo all-gathers on `world_size` local processes."""
    if world_size < 2:
        raise ValueError(f"calibration needs world_size >= 2, got {world_size}")
    sizes = list(sizes) or list(DEFAULT_SIZES)
    # one thread each: the ranks share the cores, and the collective is what we time
    per_rank = run_local(_time_all_gathers, world_size, sizes, repeats, timeout_s=60, threads=1)
    return [(int(b), float(t)) for b, t in per_rank[0]]


def measure_compute(repeats: int = 10) -> dict[str, float]:
    """flops_per_s (1024^2 fp32 matmul), low_precision_flops_per_s (the same in bf16),
    memory_bandwidth_Bps (64 MiB copy), kernel_overhead_s."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a16, b16 = a.bfloat16(), b.bfloat16()
    src = torch.empty(16 << 20)
    dst = torch.empty_like(src)
    tiny = torch.ones(4)
    return {
        "flops_per_s": 2 * 1024 ** 3 / _median_time(lambda: a @ b, repeats),
        "low_precision_flops_per_s": 2 * 1024 ** 3 / _median_time(lambda: a16 @ b16, repeats),
        "memory_bandwidth_Bps": 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src),
                                                                    repeats),
        "kernel_overhead_s": _median_time(lambda: torch.add(tiny, tiny), 20 * repeats),
    }


def calibrate(world_size: int = 2, sizes: Iterable[int] = (), repeats: int = 10,
              samples: list | None = None) -> ClusterSpec:
    """Measure this machine. `samples`, if a list, receives the all-gather timings."""
    measured = measure_all_gather(world_size, sizes, repeats)
    if samples is not None:
        samples.extend(measured)
    alpha, bandwidth = fit_alpha_beta(measured, world_size)
    # The planner's memory limit: this machine's RAM, which every local rank shares.
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size
    # Compute as one rank sees it: the bench and `graphshard train` give each local rank its
    # share of the cores.
    cores = os.cpu_count() or 1
    rank_threads = max(1, cores // world_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads)
    try:
        compute = measure_compute(repeats)
    finally:
        torch.set_num_threads(threads)
    # Ranks fill the cores with compute, so gloo's threads take turns with it: no overlap.
    return ClusterSpec(latency_s=alpha, bandwidth_Bps=bandwidth, device_memory_bytes=memory,
                       step_overhead_s=measure_step_overhead(world_size, repeats),
                       comm_overlaps_compute=cores > world_size,
                       collective_backend="gloo", compute_slots_per_node=cores // rank_threads,
                       **compute)


def main(argv: Sequence[str] | None = None) -> int:
    from tabulate import tabulate
    parser = argparse.ArgumentParser(prog="graphshard calibrate",
                                     description="measure this machine's cost-model parameters")
    parser.add_argument("--world-size", type=int, default=2,
                        help="local gloo processes the all-gathers run on (default 2)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timings per measurement; the median is kept (default 10)")
    parser.add_argument("--out", help="write the ClusterSpec JSON here")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.world_size < 2 or args.repeats < 1:
        parser.error("--world-size must be >= 2 and --repeats >= 1")
    samples: list[tuple[int, float]] = []
    spec = calibrate(args.world_size, repeats=args.repeats, samples=samples)
    print(tabulate([(b, t * 1e3, collective_time("all_gather", b, args.world_size, spec) * 1e3)
                    for b, t in samples],
                   headers=["all_gather bytes", "measured ms", "model ms"], floatfmt=".3f"))
    print()
    print(tabulate([(k, "-" if v is None else v if isinstance(v, (bool, str)) else f"{v:.4g}")
                    for k, v in dataclasses.asdict(spec).items()],
                   headers=["parameter", "value"]))
    if args.out:
        spec.to_json(args.out)
        print(f"\nwrote {args.out}")
    return 0
