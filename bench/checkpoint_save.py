"""`python -m graphshard.bench.checkpoint_save`: step time with a checkpoint every few steps, sync vs async.

    python -m graphshard.bench.checkpoint_save --nproc 2 --steps 30 --every 5

Trains a built-in model sharded with graphshard (eager unless --compile) on N local gloo
processes, AdamW, and times every step in three modes, interleaved over `--repeats` rounds
(the order rotating) so that load on a shared machine affects each alike:

- none:  no checkpoint;
- sync:  graphshard.checkpoint.save every `--every` steps, inside the step it follows;
- async: the same with asynchronous=True; the step pays for staging a copy of the state, the
         write and commit run in the background. The wait for the last save is reported apart.

A step's time is the slowest rank's. Saves go to one path (each replaces the previous
checkpoint, as a training run's `latest` would) in a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphshard.tools.arguments import parse_model_args

MODES = ("none", "sync", "async")


@dataclass(frozen=True)
class SaveBenchConfig:
    model: str = "transformer"
    model_args: tuple[tuple[str, Any], ...] = ()
    batch: int = 8
    seq: int = 32
    steps: int = 30
    every: int = 5
    repeats: int = 2
    warmup: int = 2
    compile: bool = False


def measure(rank: int, world: int, cfg: SaveBenchConfig, directory: str) -> dict[str, Any]:
    """Per mode: every step's time (slowest rank), and the async mode's final wait (s)."""
    import graphshard
    from graphshard import checkpoint
    from graphshard.tools.models import build_model

    torch.manual_seed(0)
    model, inputs, loss_fn = build_model(cfg.model, batch=cfg.batch, seq_len=cfg.seq,
                                         **dict(cfg.model_args))
    graphshard.shard(model)
    runner = torch.compile(model, backend="graphshard") if cfg.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = tuple(t.chunk(world)[rank].contiguous() for t in inputs)
    path = Path(directory) / "ckpt"

    def step() -> None:
        loss = loss_fn(runner(*local), *local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(cfg.warmup):
        step()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    saved_at: dict[str, list[bool]] = {mode: [] for mode in MODES}
    drain: list[float] = []
    for repeat in range(cfg.repeats):
        order = MODES[repeat % len(MODES):] + MODES[:repeat % len(MODES)]
        for mode in order:
            handle = None
            dist.barrier()
            for i in range(cfg.steps):
                saves = mode != "none" and (i + 1) % cfg.every == 0
                start = time.perf_counter()
                step()
                if saves:
                    handle = checkpoint.save(path, model, optimizer, step=i,
                                             asynchronous=mode == "async")
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[mode].append(elapsed.item())
                saved_at[mode].append(saves)
            if mode == "async" and handle is not None:
                start = time.perf_counter()
                handle.result()  # raises if any save failed
                drain.append(time.perf_counter() - start)
    return {"times": times, "saved": saved_at, "drain": drain,
            "bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters())}


def summarize(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Mean ms per mode: all steps, the steps with a save, the others."""
    summary = {}
    for mode in MODES:
        times, saved = result["times"][mode], result["saved"][mode]
        with_save = [t for t, s in zip(times, saved) if s]
        without = [t for t, s in zip(times, saved) if not s]
        summary[mode] = {
            "step_ms": 1e3 * statistics.mean(times),
            "save_step_ms": 1e3 * statistics.mean(with_save) if with_save else float("nan"),
            "other_step_ms": 1e3 * statistics.mean(without) if without else float("nan"),
        }
    summary["async"]["final_wait_ms"] = 1e3 * statistics.mean(result["drain"]) \
        if result["drain"] else float("nan")
    return summary


def main(argv: list[str] | None = None) -> int:
    from graphshard.tools.launch import run_local

    p = argparse.ArgumentParser(prog="python -m graphshard.bench.checkpoint_save", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="transformer")
    p.add_argument("--model-args", type=parse_model_args, default=(), metavar="K=V,...")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode per round")
    p.add_argument("--every", type=int, default=5, help="save after every N-th step")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds over the modes")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile(backend='graphshard')")
    args = p.parse_args(argv)
    if args.every < 1 or args.steps < args.every:
        p.error("need 1 <= --every <= --steps")
    cfg = SaveBenchConfig(args.model, args.model_args, args.batch, args.seq, args.steps,
                          args.every, args.repeats, args.warmup, args.compile)
    with tempfile.TemporaryDirectory(prefix="graphshard-save-bench-") as directory:
        results = run_local(measure, args.nproc, cfg, directory, timeout_s=600)
    summary = summarize(results[0])
    state_mib = 3 * results[0]["bytes"] / 2**20  # weights + AdamW's two moments, per rank
    print(f"checkpoint every {cfg.every} steps: {cfg.model} at world size {args.nproc}, "
          f"{'compiled' if cfg.compile else 'eager'} graphshard, {cfg.steps} steps x "
          f"{cfg.repeats} rounds per mode, {state_mib:.1f} MiB saved per rank")
    print(f"{'mode':<6} {'step ms':>9} {'save steps ms':>14} {'other steps ms':>15} "
          f"{'final wait ms':>14}")
    for mode in MODES:
        row = summary[mode]
        wait = f"{row['final_wait_ms']:14.1f}" if "final_wait_ms" in row else f"{'':>14}"
        save = f"{row['save_step_ms']:14.1f}" if mode != "none" else f"{'':>14}"
        print(f"{mode:<6} {row['step_ms']:9.1f} {save} {row['other_step_ms']:15.1f} {wait}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
