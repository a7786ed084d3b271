"""`graphshard train`: the demo job. A byte-level language model over the Python standard
library's source files (on every machine, offline), sharded over N local ranks and compiled by
the graphshard backend; some files are held out for validation. Prints training and validation
loss, tokens/s and per-rank memory, and saves the loss curve (PNG, or CSV without matplotlib).

    graphshard train                                    # launches 2 gloo processes itself
    graphshard train --steps 600 --plot loss.png        # longer, lower loss
    torchrun --nproc-per-node 2 -m graphshard train     # or under torchrun
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import graphshard
from graphshard.tools.cli import parse_dtype
from graphshard.tools.launch import DistributedRunError, init_from_env, launched_by_torchrun, run_local
from graphshard.tools.models import BUILTIN_MODELS, build_model
from graphshard.compiler.options import parse_option_strings
from graphshard.policy import ShardingStrategy

VOCAB = 256  # bytes
VAL_EVERY_NTH_FILE = 10  # files held out for validation: every 10th, by sorted name
# Measured on the 2-core development machine, 2 ranks, default demo model (README "Set up").
COMPILE_NOTE = ("usually takes about 20 s on 2 idle CPU cores (4 s when the compile caches are "
                "warm from an earlier run), longer on a busy machine")
TRAIN_MODELS = sorted(m for m in BUILTIN_MODELS if m != "llama3-8b")  # 8B: not on a laptop


def default_data_dir() -> str:
    return os.path.dirname(os.__file__)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="graphshard train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2,
                        help="local processes to launch (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    parser.add_argument("--strategy", default="full_shard",
                        choices=[s.value for s in ShardingStrategy if s is not ShardingStrategy.HYBRID_SHARD],
                        help="sharding strategy (default full_shard)")
    parser.add_argument("--no-compile", action="store_true", help="train eagerly (reference path)")
    parser.add_argument("--model", default="transformer", choices=TRAIN_MODELS,
                        help="built-in model, with a 256-byte vocabulary (default transformer: "
                             "4 blocks, dim 256)")
    parser.add_argument("--batch", type=int, default=16,
                        help="global batch in sequences, split over ranks (default 16)")
    parser.add_argument("--seq", type=int, default=64,
                        help="sequence length in bytes (default 64)")
    parser.add_argument("--lr", type=float, default=2e-3,
                        help="peak AdamW learning rate: linear warmup over the first 5%% of "
                             "steps, then cosine decay to a tenth (default 2e-3)")
    parser.add_argument("--param-dtype", type=parse_dtype, default=None, metavar="DTYPE",
                        help="mixed precision compute dtype: bf16/bfloat16, fp16/float16 or "
                             "fp32/float32 (master weights stay fp32; default: none)")
    parser.add_argument("--data", default=default_data_dir(), metavar="DIR",
                        help="directory whose *.py files are the text (default: the Python "
                             "standard library, %(default)s)")
    parser.add_argument("--log-every", type=int, default=None, metavar="N",
                        help="print losses and tokens/s every N steps (default: steps / 10)")
    parser.add_argument("--val-batches", type=int, default=4, metavar="N",
                        help="global batches of held-out text per validation (default 4)")
    parser.add_argument("--plot", default="graphshard-train-loss.png", metavar="FILE",
                        help="loss curve written at the end: a PNG, or FILE with .csv when "
                             "matplotlib is missing; '' for none (default %(default)s)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="graphshard backend option, e.g. --option bucket_mb=25")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for a peer before failing "
                             "(default 120)")
    args = parser.parse_args(argv)
    for flag in ("nproc", "steps", "batch", "seq", "val_batches"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.log_every is not None and args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.batch % args.nproc and not launched_by_torchrun():
        parser.error(f"--batch {args.batch} must be divisible by --nproc {args.nproc} "
                     "(each rank takes an equal slice of the global batch)")
    try:
        args.options = parse_option_strings(args.option)
        load_text(args.data, args.seq)  # bad data fails here, once, not on every rank
    except ValueError as exc:
        parser.error(str(exc))
    args.log_every = args.log_every or max(1, args.steps // 10)
    return args


# --------------------------------------------------------------------------- data


@dataclass
class Text:
    train: torch.Tensor  # uint8, the training files concatenated
    val: torch.Tensor  # uint8, the held-out files
    train_files: int
    val_files: int


def load_text(directory: str, seq: int) -> Text:
    """The *.py files of `directory` as bytes; every VAL_EVERY_NTH_FILE-th (sorted) held out."""
    files = sorted(glob.glob(os.path.join(directory, "*.py")))
    if len(files) < 2:
        raise ValueError(f"--data {directory!r}: needs at least 2 *.py files (one held out for "
                         f"validation), found {len(files)}")
    val_files = files[VAL_EVERY_NTH_FILE // 2::VAL_EVERY_NTH_FILE] or files[-1:]
    held_out = set(val_files)
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    for path in files:
        with open(path, "rb") as f:
            parts[path in held_out].append(f.read() + b"\n")
    train, val = (torch.frombuffer(bytearray(b"".join(parts[v])), dtype=torch.uint8)
                  for v in (False, True))
    for name, data in (("training", train), ("validation", val)):
        if data.numel() <= seq + 1:
            raise ValueError(f"--data {directory!r}: the {name} files hold {data.numel()} "
                             f"bytes, fewer than one sequence of --seq {seq} + 1")
    return Text(train, val, len(files) - len(val_files), len(val_files))


def global_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `seq` bytes; every rank draws the same ones (same generator)."""
    starts = torch.randint(0, data.numel() - seq, (batch,), generator=gen)
    return torch.stack([data[s:s + seq] for s in starts.tolist()]).long()


# --------------------------------------------------------------------------- training


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


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 0.1."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def _mean_over_ranks(value: float, world_size: int) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world_size


def train_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.batch % world_size:
        raise ValueError(f"--batch {args.batch} must be divisible by the {world_size} ranks")
    per_rank = args.batch // world_size
    text = load_text(args.data, args.seq)
    torch.manual_seed(0)
    model, _, loss_fn = build_model(args.model, vocab_size=VOCAB, max_seq_len=args.seq)
    full_bytes = _bytes(model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    graphshard.shard(model, strategy=args.strategy, param_dtype=args.param_dtype)
    # Fused AdamW runs on the DTensor shards (CPU too) and is the fastest configuration
    # measured: 3.3 ms/step against 18 ms for foreach on the 4-block model.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.steps))
    step_fn = model if args.no_compile else torch.compile(
        model, backend="graphshard", options=args.options, fullgraph=True)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    val_gen = torch.Generator().manual_seed(1)
    val_batches = [global_batch(text.val, args.batch, args.seq, val_gen)[mine]
                   for _ in range(args.val_batches)]

    def validate() -> float:
        # Same shapes and grad mode as training, so the compiled graph serves it (no_grad would
        # compile a second, inference graph); nothing calls backward, the graph is dropped.
        total = 0.0
        for tokens in val_batches:
            total += loss_fn(step_fn(tokens), tokens).item()
        return _mean_over_ranks(total / len(val_batches), world_size)

    say(f"data: {text.train.numel() / 2**20:.1f} MiB in {text.train_files} files for training, "
        f"{text.val.numel() / 2**20:.2f} MiB in {text.val_files} held out ({args.data})\n"
        f"model: {args.model}, {n_params / 1e6:.2f} M parameters, bytes as tokens; global batch "
        f"{args.batch} x {args.seq} bytes over {world_size} ranks, {args.strategy}", flush=True)
    compiler = args.options.get("compiler", "inductor")
    if not args.no_compile and compiler == "inductor":
        say(f"compiling (torch.compile, backend graphshard, then Inductor): the first step "
            f"{COMPILE_NOTE} ...", flush=True)
    elif not args.no_compile:
        say(f"compiling (torch.compile, backend graphshard, compiler={compiler}) ...", flush=True)
    gen = torch.Generator().manual_seed(0)
    tokens_per_step = args.batch * args.seq
    losses, step_times = [], []
    started = time.perf_counter()
    val_points = [(0, validate())]  # before any update; compiles the forward
    interval_start, interval_losses = 0, []
    for step in range(args.steps):
        local = global_batch(text.train, args.batch, args.seq, gen)[mine]
        start = time.perf_counter()
        loss = loss_fn(step_fn(local), local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        schedule.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        elapsed = time.perf_counter() - start
        step_times.append(elapsed)
        losses.append(loss.item() / world_size)
        interval_losses.append(losses[-1])
        if step == 0:
            first_s = time.perf_counter() - started
            note = "" if args.no_compile else f", compile included: {first_s:.1f} s"
            say(f"step {0:>5}/{args.steps}  val loss {val_points[0][1]:.3f}\n"
                f"step {1:>5}/{args.steps}  train loss {losses[0]:.3f}  (first step{note})",
                flush=True)
            interval_start, interval_losses = 1, []
        elif (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            times = step_times[interval_start:]
            val_points.append((step + 1, validate()))
            throughput = tokens_per_step * len(times) / sum(times)
            say(f"step {step + 1:>5}/{args.steps}  train loss "
                f"{statistics.fmean(interval_losses):.3f}  val loss {val_points[-1][1]:.3f}  "
                f"{throughput:7.0f} tok/s  {statistics.median(times) * 1000:6.1f} ms/step",
                flush=True)
            interval_start, interval_losses = step + 1, []
    memory = memory_report(model, optimizer)
    return {"losses": losses, "step_times": step_times, "first_s": first_s, "val": val_points,
            "memory": memory, "full_bytes": full_bytes, "tokens_per_step": tokens_per_step}


# --------------------------------------------------------------------------- report


def summarize(results: list[dict], args: argparse.Namespace) -> str:
    from tabulate import tabulate

    first = results[0]
    steady = first["step_times"][1:] or first["step_times"]
    median = statistics.median(steady)
    mib = 1 / 2**20
    (_, val_first), (_, val_last) = first["val"][0], first["val"][-1]
    lines = [
        f"\nmodel {args.model}, {len(results)} ranks, strategy {args.strategy}, "
        f"{'eager' if args.no_compile else 'torch.compile(backend=graphshard)'}",
        f"train loss {first['losses'][0]:.3f} -> {first['losses'][-1]:.3f}, "
        f"val loss {val_first:.3f} -> {val_last:.3f} (nats per byte; uniform guess "
        f"{math.log(VOCAB):.3f})",
        f"first step {first['first_s']:.1f} s"
        + ("" if args.no_compile else f" (compile ~{first['first_s'] - median:.1f} s)")
        + f", then median {median * 1000:.1f} ms/step, "
          f"{first['tokens_per_step'] * len(steady) / sum(steady):.0f} tokens/s",
        f"full model parameters: {first['full_bytes'] * mib:.2f} MiB",
    ]
    rows = [[rank, r["memory"]["params"] * mib, r["memory"]["grads"] * mib, r["memory"]["optimizer"] * mib]
            for rank, r in enumerate(results)]
    lines.append(tabulate(rows, headers=["rank", "params MiB", "grads MiB", "optimizer MiB"],
                          floatfmt=".2f"))
    return "\n".join(lines)


def save_curve(result: dict, path: str, title: str) -> str:
    """The loss curve as a PNG at `path`; without matplotlib, a CSV beside it. Returns a line
    saying what was written."""
    try:
        import matplotlib
    except ImportError:
        csv_path = os.path.splitext(path)[0] + ".csv"
        val = dict(result["val"])
        with open(csv_path, "w") as f:
            f.write("step,train_loss,val_loss\n")
            for step, loss in enumerate(result["losses"], 1):
                f.write(f"{step},{loss:.6f},{val[step]:.6f}\n" if step in val
                        else f"{step},{loss:.6f},\n")
        return (f"matplotlib is not installed (pip install matplotlib, or the [plot] extra): "
                f"wrote the loss curve as CSV to {csv_path}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(result["losses"]) + 1)
    window = max(1, len(result["losses"]) // 30)
    smooth = [statistics.fmean(result["losses"][max(0, i - window + 1):i + 1])
              for i in range(len(result["losses"]))]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, result["losses"], color="tab:blue", alpha=0.25, lw=0.8, label="train (step)")
    ax.plot(steps, smooth, color="tab:blue", lw=1.8, label=f"train ({window}-step mean)")
    vs, vl = zip(*result["val"])
    ax.plot(vs, vl, "o-", color="tab:orange", lw=1.5, ms=4, label="validation (held-out files)")
    ax.axhline(math.log(VOCAB), color="grey", ls=":", lw=1, label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"loss curve: {path}"


def _report(results: list[dict], args: argparse.Namespace) -> None:
    print(summarize(results, args))
    if args.plot:
        title = (f"graphshard train: byte-level {args.model} on Python stdlib sources, "
                 f"{len(results)} ranks, {args.strategy}")
        print(save_curve(results[0], args.plot, title))


def _torchrun_main(args: argparse.Namespace) -> int:
    init_from_env(args.timeout)
    try:
        result = train_worker(dist.get_rank(), dist.get_world_size(), args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            _report(gathered, args)
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
    _report(results, args)
    return 0


def _spawned_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    return train_worker(rank, world_size, args)


if __name__ == "__main__":
    sys.exit(main())
