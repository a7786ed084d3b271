"""`graphshard train`: the demo job. Trains the built-in Transformer, sharded, on N local ranks.

    graphshard train --nproc 2 --steps 20               # launches 2 gloo processes itself
    torchrun --nproc-per-node 2 -m graphshard train     # or under torchrun
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import graphshard
from graphshard.launch import DistributedRunError, init_from_env, launched_by_torchrun, run_local
from graphshard.models import BUILTIN_MODELS, build_model, synthetic_tokens
from graphshard.options import parse_option_strings
from graphshard.policy import ShardingStrategy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="graphshard train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local processes to launch (default 2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", default="full_shard",
                        choices=[s.value for s in ShardingStrategy if s is not ShardingStrategy.HYBRID_SHARD])
    parser.add_argument("--no-compile", action="store_true", help="train eagerly (reference path)")
    parser.add_argument("--model", default="transformer", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), default=None,
                        help="mixed precision compute dtype (master weights stay fp32)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="graphshard backend option, e.g. --option bucket_mb=25")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for a peer before failing")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.steps < 1:
        parser.error("--nproc and --steps must be >= 1")
    if args.batch % args.nproc and not launched_by_torchrun():
        parser.error(f"--batch {args.batch} must be divisible by --nproc {args.nproc} "
                     "(each rank takes an equal slice of the global batch)")
    try:
        args.options = parse_option_strings(args.option)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def memory_report(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards)."""
    params = list(model.parameters())
    return {
        "params": _bytes(params),
        "grads": _bytes(p.grad for p in params),
        "optimizer": _bytes(v for state in optimizer.state.values() for v in state.values()),
    }


def train_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model, _, loss_fn = build_model(args.model, batch=args.batch, seq_len=args.seq)
    full_bytes = _bytes(model.parameters())
    param_dtype = DTYPES[args.param_dtype] if args.param_dtype else None
    graphshard.shard(model, strategy=args.strategy, param_dtype=param_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step_fn = model if args.no_compile else torch.compile(
        model, backend="graphshard", options=args.options, fullgraph=True)
    if args.batch % world_size:
        raise ValueError(f"--batch {args.batch} must be divisible by the {world_size} ranks")
    per_rank = args.batch // world_size
    seq = min(args.seq, model.config.max_seq_len)
    step_times, losses = [], []
    for step in range(args.steps):
        tokens = synthetic_tokens(model.config.vocab_size, args.batch, seq, seed=step)
        local = tokens[rank * per_rank:(rank + 1) * per_rank]
        start = time.perf_counter()
        loss = loss_fn(step_fn(local), local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        loss = loss.detach()
        dist.all_reduce(loss)
        elapsed = time.perf_counter() - start
        step_times.append(elapsed)
        losses.append(loss.item() / world_size)
        if rank == 0:
            note = "  (includes compile)" if step == 0 and not args.no_compile else ""
            print(f"step {step + 1:>4}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"time {elapsed * 1000:8.1f} ms{note}", flush=True)
    memory = memory_report(model, optimizer)
    return {"losses": losses, "step_times": step_times, "memory": memory, "full_bytes": full_bytes}


def summarize(results: list[dict], args: argparse.Namespace) -> str:
    from tabulate import tabulate

    first = results[0]
    steady = first["step_times"][1:] or first["step_times"]
    median = statistics.median(steady)
    mib = 1 / 2**20
    lines = [
        f"\nmodel {args.model}, {len(results)} ranks, strategy {args.strategy}, "
        f"{'eager' if args.no_compile else 'torch.compile(backend=graphshard)'}",
        f"loss {first['losses'][0]:.4f} -> {first['losses'][-1]:.4f}",
        f"first step {first['step_times'][0]:.2f} s"
        + ("" if args.no_compile else f" (compile ~{first['step_times'][0] - median:.2f} s)")
        + f", then median {median * 1000:.1f} ms/step",
        f"full model parameters: {first['full_bytes'] * mib:.2f} MiB",
    ]
    rows = [[rank, r["memory"]["params"] * mib, r["memory"]["grads"] * mib, r["memory"]["optimizer"] * mib]
            for rank, r in enumerate(results)]
    lines.append(tabulate(rows, headers=["rank", "params MiB", "grads MiB", "optimizer MiB"],
                          floatfmt=".2f"))
    return "\n".join(lines)


def _torchrun_main(args: argparse.Namespace) -> int:
    init_from_env(args.timeout)
    try:
        result = train_worker(dist.get_rank(), dist.get_world_size(), args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            print(summarize(gathered, args))
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if launched_by_torchrun():
        return _torchrun_main(args)
    print(f"launching {args.nproc} local processes (gloo, 127.0.0.1)", flush=True)
    try:
        results = run_local(_spawned_worker, args.nproc, args, timeout_s=args.timeout)
    except DistributedRunError as exc:
        print(f"graphshard train: {exc}", file=sys.stderr)
        return 1
    print(summarize(results, args))
    return 0


def _spawned_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    return train_worker(rank, world_size, args)


if __name__ == "__main__":
    sys.exit(main())
