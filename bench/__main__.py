"""`python -m graphshard.bench` / `graphshard bench`: compare graphshard with DDP, FSDP2 and SimpleFSDP."""

from __future__ import annotations

import argparse
import sys

from graphshard.bench.methods import DEFAULT_METHODS, METHODS, method
from graphshard.bench.workload import MODEL_NAMES, ModelUnavailable, build_workload
from graphshard.tools.arguments import parse_model_args


def _known(name: str) -> bool:
    try:
        method(name)
        return True
    except (KeyError, ValueError):
        return False


def _methods(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if not _known(n)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; valid: {', '.join(METHODS)}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphshard bench",
        description="Step time, collectives, memory, compile time and loss agreement of "
                    "graphshard and its peers, interleaved in one run on N local gloo processes.",
    )
    p.add_argument("--model", default="transformer", choices=MODEL_NAMES)
    p.add_argument("--model-args", type=parse_model_args, default=(), metavar="K=V,...",
                   help="model config overrides, e.g. dim=32,n_layers=1")
    p.add_argument("--nproc", type=int, default=2, help="world size (local processes)")
    p.add_argument("--methods", type=_methods, default=DEFAULT_METHODS,
                   help=f"comma list from: {', '.join(METHODS)} (default: all); graphshard "
                        "with backend options as graphshard:KEY=VALUE+KEY=VALUE, e.g. "
                        "graphshard:prefetch=2+bucket_mb=25")
    p.add_argument("--tp", type=int, default=1,
                   help="TP degree of the tensor-parallel methods (graphshard_tp, fsdp2_tp, "
                        "fsdp2_tp_compile): a (nproc / tp, tp) mesh, the model's own TP plan")
    p.add_argument("--batch", type=int, default=8, help="global batch, split evenly over ranks")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--steps", type=int, default=10, help="timed steps per method per repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the methods")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1; the first compiles)")
    p.add_argument("--optimizer", choices=("fused_adamw", "adamw", "sgd"), default="fused_adamw",
                   help="the same for every method; adamw: the default for-loop implementation")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench_results.json", help="where to write the results")
    p.add_argument("--inductor-cache", metavar="DIR",
                   help="compile into this Inductor cache directory and keep it (a later run "
                        "loads what this one compiled: its first steps are warm); default: a "
                        "fresh directory each run, removed after it (first steps compile cold)")
    p.add_argument("--plot", default="bench_results.png",
                   help="PNG of step time and memory (needs matplotlib); '' for none")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag in ("nproc", "tp", "batch", "seq", "steps", "repeats", "warmup"):
        if getattr(args, flag) < 1:
            print(f"bench: --{flag} must be at least 1", file=sys.stderr)
            return 2
    if args.nproc % args.tp:
        print(f"bench: --tp {args.tp} does not divide --nproc {args.nproc}", file=sys.stderr)
        return 2
    if args.batch % args.nproc:
        print(f"bench: --batch {args.batch} does not split evenly over --nproc {args.nproc}",
              file=sys.stderr)
        return 2

    # Imported here so `--help` and argument errors stay fast.
    from graphshard.bench.harness import BenchConfig, run
    from graphshard.bench.report import (format_breakdown, format_limit, format_table, plot, summarize,
                                         write_json)

    cfg = BenchConfig(
        model=args.model, model_args=args.model_args, nproc=args.nproc, tp=args.tp,
        methods=args.methods,
        batch=args.batch, seq=args.seq, steps=args.steps, repeats=args.repeats,
        warmup=args.warmup, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
    )
    try:  # fail fast, in this process, on a missing package or a bad model option
        build_workload(cfg.model, cfg.batch, cfg.seq, cfg.seed, dict(cfg.model_args))
    except ModelUnavailable as exc:
        print(f"bench: skipping model {cfg.model}: {exc}")
        return 0
    except (TypeError, ValueError) as exc:
        print(f"bench: bad model options: {exc}", file=sys.stderr)
        return 2

    print(f"bench: {cfg.model} {dict(cfg.model_args) or ''} world size {cfg.nproc}"
          f"{f' (TP methods: {cfg.nproc // cfg.tp} x {cfg.tp})' if cfg.tp > 1 else ''}, "
          f"global batch {cfg.batch}, seq {cfg.seq}, {cfg.repeats} x {cfg.steps} timed steps, "
          f"methods {', '.join(cfg.methods)}", flush=True)
    timing, profile = run(cfg, cache_dir=args.inductor_cache)
    summary = summarize(cfg, timing, profile)
    print(format_table(summary))
    print()
    print(format_breakdown(summary))
    limit = format_limit(summary)
    if limit:
        print()
        print(limit)
    if args.plot:
        note = plot(summary, args.plot)
        summary["notes"].append(note or f"plot written to {args.plot}")
    write_json(summary, args.json)
    for note in summary["notes"]:
        print(f"note: {note}")
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
