"""`graphshard calibrate`: measure this machine's cost-model parameters into a ClusterSpec.

The collectives graphshard runs on gloo (all-to-all for all-gather and reduce-scatter,
all-reduce), back to back and after compute (how far the ranks drift apart), timed on local
gloo processes (graphshard.tools.launch.run_local); matmuls, a copy, a tiny kernel and a tiny
training step's host time; the JSON it writes is what ClusterSpec.from_json loads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from graphshard.compiler.cost_model import ClusterSpec, collective_time, fit_alpha_beta
from graphshard.tools.launch import run_local

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
BURST = 4  # collectives per timing
# Compute between collectives when measuring the ranks' skew: a training step's segments
# between collectives are 0.3-10 ms at the sizes this machine trains.
SKEW_CHUNKS_S = (0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3)


def _median_time(fn: Any, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_collectives(rank: int, world_size: int, sizes: Sequence[int],
                      repeats: int) -> dict[str, list[tuple[int, float]]]:
    """On each rank, {kind: [(bytes, median seconds)]} of the collectives graphshard runs on
    gloo: all-gather and reduce-scatter as an all-to-all (bytes: the gathered buffer; each
    rank sends (N-1)/N of it, as a ring all-gather), and all-reduce (tensor parallelism's).
    Back to back, as a step runs a bucket's collectives; the sizes take turns within each
    repetition, so a burst of load from elsewhere slows every size alike."""
    ops = {"all_gather": lambda x, y: dist.all_to_all_single(y, x),
           "all_reduce": lambda x, y: dist.all_reduce(x)}  # of zeros: no overflow, no denormals
    numels = [max(size // 4 // world_size, 1) * world_size for size in sizes]
    buffers = [(torch.zeros(n), torch.empty(n)) for n in numels]
    results = {}
    for kind, op in ops.items():
        times: list[list[float]] = [[] for _ in sizes]
        for repetition in range(3 + repeats):  # the first three warm up
            for (x, y), size_times in zip(buffers, times):
                dist.barrier()  # start together: the first of the burst pays no skew
                start = time.perf_counter()
                for _ in range(BURST):
                    op(x, y)
                if repetition >= 3:
                    size_times.append((time.perf_counter() - start) / BURST)
        results[kind] = [(x.numel() * 4, statistics.median(t)) for (x, _), t in zip(buffers, times)]
    return results


def _time_skew(rank: int, world_size: int, repeats: int) -> list[tuple[float, float]]:
    """[(compute seconds, extra seconds)]: what a small collective costs beyond its own time
    when it follows that much compute on every rank (the ranks drift apart while computing
    and meet at the collective), on rank 0's clock. The extra is the expected wait, the mean
    (a step adds up its collectives' waits, and a wait's distribution has a long tail), less
    the tenth of the samples at either end (a burst of load from elsewhere); the compute
    lengths take turns within each repetition, so the machine's drift falls on each alike."""
    a, b = torch.randn(128, 256), torch.randn(256, 256)
    one = _median_time(lambda: a @ b, 20)
    x, y = torch.ones(256 * world_size), torch.empty(256 * world_size)

    def exchange():
        dist.all_to_all_single(y, x)

    dist.barrier()
    alone = _median_time(exchange, 4 * repeats)

    def compute(matmuls: int):
        for _ in range(matmuls):
            a @ b

    matmuls = [max(1, round(chunk / one)) for chunk in SKEW_CHUNKS_S]
    extras: list[list[float]] = [[] for _ in matmuls]
    for _ in range(3 * repeats):  # the ranks' drift is noisy: more samples than elsewhere
        for count, chunk_extras in zip(matmuls, extras):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(8):
                compute(count)
            computed = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            for _ in range(8):
                compute(count)
                exchange()
            chunk_extras.append((time.perf_counter() - start - computed) / 8 - alone)
    return [(count * one, max(_trimmed_mean(chunk_extras), 0.0))
            for count, chunk_extras in zip(matmuls, extras)]


def _trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    """The mean of `values` without the `cut` fraction at either end."""
    ordered = sorted(values)
    drop = int(len(ordered) * cut)
    return statistics.mean(ordered[drop:len(ordered) - drop])


def fit_skew(samples: Sequence[tuple[float, float]]) -> float:
    """ClusterSpec.skew_after_1ms_s: least squares of wait = s * sqrt(compute / 1 ms)."""
    xs = [math.sqrt(c / 1e-3) for c, _ in samples]
    return max(sum(x * w for x, (_, w) in zip(xs, samples)) / sum(x * x for x in xs), 0.0)


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


def measure_step_overhead(repeats: int = 10) -> float:
    """The host's time per step beyond its kernels, on one process: no collective (the cost
    model prices those on their own)."""
    return float(run_local(_time_tiny_training_step, 1, repeats, timeout_s=300, threads=1)[0])


def measure_collectives(world_size: int = 2, sizes: Iterable[int] = (),
                        repeats: int = 10) -> dict[str, list[tuple[int, float]]]:
    """{kind: [(bytes, median seconds)]} of gloo's collectives on `world_size` local processes."""
    if world_size < 2:
        raise ValueError(f"calibration needs world_size >= 2, got {world_size}")
    sizes = list(sizes) or list(DEFAULT_SIZES)
    # one thread each: the ranks share the cores, and the collective is what we time
    per_rank = run_local(_time_collectives, world_size, sizes, repeats, timeout_s=120, threads=1)
    return {kind: [(int(b), float(t)) for b, t in samples] for kind, samples in per_rank[0].items()}


def measure_skew(world_size: int = 2, repeats: int = 10) -> list[tuple[float, float]]:
    return run_local(_time_skew, world_size, repeats, timeout_s=120, threads=1)[0]


# (batch, heads, sequence, head_dim) of the attention calibration: sequence x head_dim
# 2,048 to 32,768, where a CPU's attention rate climbs most.
ATTENTION_SHAPES = ((4, 8, 64, 32), (4, 4, 64, 64), (2, 8, 128, 64), (1, 8, 512, 64))
# (tokens, in, out) of the matmul calibration: a training step's sizes, not a square peak.
MATMUL_SHAPES = ((256, 256, 1024), (256, 1024, 256), (512, 512, 512))
_COLD_COPIES = 16  # operand sets rotated, so each matmul reads operands out of cache, as in a step


def matmul_rate(dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of a training step's matmuls in `dtype`: forward (x @ w.T) and backward's two
    (g @ w, g.T @ x) on operands out of cache."""
    flops = seconds = 0.0
    for tokens, d_in, d_out in MATMUL_SHAPES:
        sets = [(torch.randn(tokens, d_in, dtype=dtype), torch.randn(d_out, d_in, dtype=dtype),
                 torch.randn(tokens, d_out, dtype=dtype)) for _ in range(_COLD_COPIES)]

        def layouts():
            for x, w, g in sets:
                x @ w.t()
                g @ w
                g.t() @ x

        seconds += _median_time(layouts, repeats)
        flops += 3 * 2 * tokens * d_in * d_out * _COLD_COPIES
    return flops / seconds


def attention_rates(repeats: int) -> tuple[tuple[float, float, float], ...]:
    """ClusterSpec.attention_flops: causal attention forward + backward FLOP/s, fp32 and
    bf16, at each of ATTENTION_SHAPES."""
    from torch.nn.functional import scaled_dot_product_attention
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    rows = []
    for shape in ATTENTION_SHAPES:
        rates = []
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.ones(shape, dtype=dtype)

            def forward_backward():
                scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
            rates.append(flops / _median_time(forward_backward, repeats))
        rows.append((shape[-2] * shape[-1], *rates))
    return tuple(rows)


# One step of each family's chain (elementwise_cost.FAMILIES), kept in a bounded range so a
# long chain stays finite; "arith" is a multiply-add, counted as two evaluations.
_ELEMENTWISE_CHAINS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "arith": (lambda y: y * 0.999 + 0.001, 2),
    "exp": (lambda y: torch.exp(-y), 1),
    "log": (lambda y: torch.log1p(y), 1),
    "trig": (torch.sin, 1),
    "tanh": (torch.tanh, 1),
    "erf": (torch.erf, 1),
    "pow": (lambda y: 0.5 ** y, 1),
    "sqrt": (lambda y: torch.rsqrt(y + 1.0), 1),
}
_CHAIN_LENGTH = 16


def elementwise_costs(repeats: int) -> tuple[tuple[str, float], ...]:
    """ClusterSpec.elementwise_s: seconds per evaluation of each op family in Inductor's fused
    code, from a chain of _CHAIN_LENGTH evaluations per element over a cache-sized tensor (the
    memory traffic, one read and one write, is a few percent of it)."""
    x = torch.rand(1 << 16)
    rows = []
    for family, (link, evaluations) in _ELEMENTWISE_CHAINS.items():
        def chain(y, link=link):
            for _ in range(_CHAIN_LENGTH):
                y = link(y)
            return y

        compiled = torch.compile(chain, dynamic=False)
        seconds = _median_time(lambda: compiled(x), repeats)
        rows.append((family, seconds / (_CHAIN_LENGTH * evaluations * x.numel())))
    return tuple(rows)


def measure_compute(repeats: int = 10) -> dict[str, Any]:
    """flops_per_s and low_precision_flops_per_s (a step's matmuls, fp32 and bf16),
    attention_flops, elementwise_s, memory_bandwidth_Bps (64 MiB copy), kernel_overhead_s."""
    src = torch.empty(16 << 20)
    dst = torch.empty_like(src)
    tiny = torch.ones(4)
    return {
        "flops_per_s": matmul_rate(torch.float32, repeats),
        "low_precision_flops_per_s": matmul_rate(torch.bfloat16, repeats),
        "attention_flops": attention_rates(repeats),
        "elementwise_s": elementwise_costs(repeats),
        "memory_bandwidth_Bps": 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src),
                                                                    repeats),
        "kernel_overhead_s": _median_time(lambda: torch.add(tiny, tiny), 20 * repeats),
    }


@contextlib.contextmanager
def threads_of_a_rank(ranks_per_node: int) -> Iterator[int]:
    """This process at one local rank's share of the cores (as the bench and `graphshard train`
    give each rank), which it yields; its thread count restored after."""
    threads = torch.get_num_threads()
    rank_threads = max(1, (os.cpu_count() or 1) // ranks_per_node)
    torch.set_num_threads(rank_threads)
    try:
        yield rank_threads
    finally:
        torch.set_num_threads(threads)


def calibrate(world_size: int = 2, sizes: Iterable[int] = (), repeats: int = 10,
              samples: list | None = None, rounds: int = 1) -> ClusterSpec:
    """Measure this machine `rounds` times, one whole round after another, and keep each
    parameter's median over the rounds (`median_spec`): on a shared machine one round's
    collective latencies move by up to 2.5x, and its rates by 10-30%, from one minute to the
    next. `samples`, if a list, receives the all-gather timings of every round."""
    sizes = tuple(sizes)
    return median_spec([_calibrate_once(world_size, sizes, repeats, samples)
                        for _ in range(rounds)])


def median_spec(specs: Sequence[ClusterSpec]) -> ClusterSpec:
    """Each measured number's median over `specs` (rounds of one machine's calibration;
    attention rates row by row); what is not measured (flags, counts) is the first's."""
    values = {}
    for field in dataclasses.fields(ClusterSpec):
        measured = [getattr(spec, field.name) for spec in specs]
        if field.name == "attention_flops":
            values[field.name] = tuple(
                (rows[0][0], statistics.median(r[1] for r in rows),
                 statistics.median(r[2] for r in rows)) for rows in zip(*measured))
        elif field.name == "elementwise_s":
            rounds = [dict(rows) for rows in measured]
            if any(set(r) != set(rounds[0]) for r in rounds):
                raise ValueError("calibration rounds timed different elementwise families: "
                                 f"{[sorted(r) for r in rounds]}")
            values[field.name] = tuple((name, statistics.median(r[name] for r in rounds))
                                       for name in sorted(rounds[0]))
        elif all(isinstance(v, float) for v in measured):
            values[field.name] = statistics.median(measured)
        else:
            values[field.name] = measured[0]
    return ClusterSpec(**values)


def _calibrate_once(world_size: int, sizes: Sequence[int], repeats: int,
                    samples: list | None) -> ClusterSpec:
    measured = measure_collectives(world_size, sizes, repeats)
    if samples is not None:
        samples.extend(measured["all_gather"])
    alpha, bandwidth = fit_alpha_beta(measured["all_gather"], world_size)
    reduce_alpha, reduce_bandwidth = fit_alpha_beta(measured["all_reduce"], world_size, "all_reduce")
    # The planner's memory limit: this machine's RAM, which every local rank shares.
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size
    # Compute as one rank sees it: the bench and `graphshard train` give each local rank its
    # share of the cores.
    cores = os.cpu_count() or 1
    with threads_of_a_rank(world_size) as rank_threads:
        compute = measure_compute(repeats)
    # Ranks fill the cores with compute, so gloo's threads take turns with it: no overlap.
    return ClusterSpec(latency_s=alpha, bandwidth_Bps=bandwidth, device_memory_bytes=memory,
                       all_reduce_latency_s=reduce_alpha, all_reduce_bandwidth_Bps=reduce_bandwidth,
                       skew_after_1ms_s=fit_skew(measure_skew(world_size, repeats)),
                       # one rank more than the cores' slots: how far ranks that take turns drift
                       shared_core_skew_after_1ms_s=fit_skew(measure_skew(cores // rank_threads + 1,
                                                                          repeats)),
                       step_overhead_s=measure_step_overhead(repeats),
                       comm_overlaps_compute=cores > world_size,
                       collective_backend="gloo", compute_slots_per_node=cores // rank_threads,
                       **compute)


def _short(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:.3g}"


def main(argv: Sequence[str] | None = None) -> int:
    from tabulate import tabulate
    parser = argparse.ArgumentParser(prog="graphshard calibrate",
                                     description="measure this machine's cost-model parameters")
    parser.add_argument("--world-size", type=int, default=2,
                        help="local gloo processes the all-gathers run on (default 2)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timings per measurement; the median is kept (default 10)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="whole measurements, one after another; each parameter's median "
                             "over them is kept (default 3)")
    parser.add_argument("--out", help="write the ClusterSpec JSON here")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.world_size < 2 or args.repeats < 1 or args.rounds < 1:
        parser.error("--world-size must be >= 2, --repeats and --rounds >= 1")
    samples: list[tuple[int, float]] = []
    spec = calibrate(args.world_size, repeats=args.repeats, samples=samples, rounds=args.rounds)
    if args.out:  # first: the measurement is kept whatever the printing does
        spec.to_json(args.out)
    print(tabulate([(b, t * 1e3, collective_time("all_gather", b, args.world_size, spec) * 1e3)
                    for b, t in samples],
                   headers=["all_gather bytes", "measured ms", "model ms"], floatfmt=".3f"))
    print()
    print(tabulate([(k, "-" if v is None or v == () else v if isinstance(v, (bool, str))
                     else ", ".join(f"({', '.join(_short(x) for x in row)})" for row in v)
                     if isinstance(v, tuple) else f"{v:.4g}")
                    for k, v in dataclasses.asdict(spec).items()],
                   headers=["parameter", "value"]))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0
