"""`graphshard dump` on the command line: arguments, exit statuses, output files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Sequence

from graphshard.tools.dump.analysis import dump
from graphshard.tools.dump.loading import DumpError, check_output_paths, load_workload, one_line
from graphshard.tools.dump.report import format_report

USAGE_ERROR = 2  # bad input: one line on stderr
COMPILE_ERROR = 1  # the model itself failed to compile
TRACEBACK_ENV = "GRAPHSHARD_TRACEBACK"  # =1: an error raises with its traceback, as --traceback


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + line
        raise DumpError(message)


def _parser() -> argparse.ArgumentParser:
    from graphshard.compiler.pipeline import STAGES
    from graphshard.tools.arguments import AC_HELP, parse_ac_mode, parse_model_args
    from graphshard.tools.cli import parse_dtype

    p = _Parser(prog="graphshard dump",
                description="Show what the graphshard compiler does to a model at any world "
                            "size: graphs per stage, every collective, bytes against theory, "
                            "and cost-model estimates. One process, fake process group, no "
                            "weights allocated. JSON schema: graphshard/tools/dump/report.py. "
                            "An error prints one line; --traceback (or the environment "
                            f"variable {TRACEBACK_ENV}=1) raises it with its traceback instead.")
    p.add_argument("target", help="built-in model (transformer, transformer-large, llama, "
                                  "llama3-8b, llama3-70b), package.module:factory or path/file.py:factory")
    p.add_argument("--world-size", "-n", type=int, default=8, help="ranks to simulate (default 8)")
    p.add_argument("--strategy", default="full_shard",
                   help="full_shard, shard_grad_op, no_shard or hybrid_shard")
    p.add_argument("--shard-size", type=int, help="hybrid_shard: ranks per shard group")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: apply the model's TP plan on an innermost mesh "
                        "dim of this many ranks, shard over the rest (default 1: no TP)")
    p.add_argument("--stage", default="none",
                   help=f"also print the FX graphs after a stage: {', '.join(STAGES)}, or all "
                        "(default none: the summary only)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option, as in torch.compile(options=...); repeatable")
    p.add_argument("--param-dtype", type=parse_dtype, metavar="DTYPE",
                   help="mixed precision: dtype of gathered parameters (bf16/bfloat16, "
                        "fp16/float16, fp32/float32)")
    p.add_argument("--reduce-dtype", type=parse_dtype, metavar="DTYPE",
                   help="mixed precision: dtype of gradient reduction (same spellings)")
    p.add_argument("--batch", type=int,
                   help="batch size (per rank) of the example inputs: factory kwarg batch=")
    p.add_argument("--seq", type=int,
                   help="sequence length of the example inputs: factory kwarg seq_len=")
    p.add_argument("--model-args", type=parse_model_args, action="append", default=[],
                   metavar="K=V,...",
                   help="factory keyword arguments, e.g. n_layers=2,dim=64 (built-ins: config)")
    p.add_argument("--ac", type=parse_ac_mode, default="none", metavar="MODE",
                   help=f"{AC_HELP} (default none)")
    p.add_argument("--no-meta", dest="meta", action="store_false",
                   help="call a factory as written instead of under torch.device('meta')")
    p.add_argument("--cluster", metavar="PRESET|FILE",
                   help="a preset (h100, a100, local: graphshard/compiler/clusters.py) or a "
                        "JSON file from `graphshard calibrate --out FILE`")
    p.add_argument("--json", metavar="FILE",
                   help="write the report as JSON (schema: graphshard/tools/dump/report.py)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the simulated step")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress messages on stderr")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, raise it with its full traceback instead of printing one "
                        f"line (also: {TRACEBACK_ENV}=1, which covers argument errors too)")
    return p


def _progress_printer(quiet: bool) -> Callable[[str], None]:
    if quiet:
        return lambda message: None
    started = time.perf_counter()

    def show(message: str) -> None:
        print(f"graphshard dump [{time.perf_counter() - started:5.1f} s]: {message}",
              file=sys.stderr, flush=True)

    return show


def run(argv: Sequence[str]) -> int:
    """The dump `argv` asks for: its exit status; bad input raises DumpError, and a compile
    failure too under --traceback."""
    from graphshard.activation_checkpointing import apply_activation_checkpointing
    from graphshard.compiler.options import parse_option_strings
    from graphshard.compiler.pipeline import STAGES
    from graphshard.policy import ShardingStrategy

    args = _parser().parse_args(list(argv))
    stage_choices = (*STAGES, "all", "none")
    if args.stage not in stage_choices:
        raise DumpError(f"unknown stage {args.stage!r}; valid: {', '.join(stage_choices)}")
    stages = STAGES if args.stage == "all" else () if args.stage == "none" else (args.stage,)
    if args.world_size < 1:
        raise DumpError(f"--world-size must be at least 1, got {args.world_size}")
    for flag in ("batch", "seq", "shard_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise DumpError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    try:
        strategy = ShardingStrategy.parse(args.strategy).value
        options = parse_option_strings(args.option)
    except ValueError as e:
        raise DumpError(str(e)) from None
    check_output_paths(json=args.json, trace=args.trace)
    cluster = None
    if args.cluster:
        from graphshard.compiler.clusters import resolve_cluster
        try:
            cluster = resolve_cluster(args.cluster)
        except (OSError, ValueError, TypeError) as e:
            raise DumpError(f"--cluster: {one_line(e)}") from None

    workload = load_workload(args.target, meta=args.meta, batch=args.batch, seq_len=args.seq,
                             model_args=dict(pair for pairs in args.model_args for pair in pairs))
    try:
        apply_activation_checkpointing(workload.model, args.ac)
    except ValueError as e:  # no repeated blocks to checkpoint
        raise DumpError(f"--ac {args.ac}: {e}") from e
    try:
        result = dump(workload, world_size=args.world_size, strategy=strategy, options=options,
                      stages=stages, shard_size=args.shard_size, param_dtype=args.param_dtype,
                      reduce_dtype=args.reduce_dtype, cluster=cluster, tp=args.tp,
                      progress=_progress_printer(args.quiet))
    except DumpError:
        raise
    except Exception as e:
        if args.traceback or _wants_traceback():
            raise
        print(f"graphshard dump: compiling {args.target!r} failed: {one_line(e)} (--traceback "
              "shows where)", file=sys.stderr)
        return COMPILE_ERROR
    print(format_report(result.report, result.texts, stages))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.report.to_json(), f, indent=1)
        print(f"wrote {args.json}")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(result.trace, f)
        print(f"wrote {args.trace}")
    return 0


def _wants_traceback() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(argv)
    except DumpError as e:
        # (the flag itself, even where the arguments around it are what is wrong)
        if _wants_traceback() or "--traceback" in argv:
            raise
        print(f"graphshard dump: {e}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as e:  # --help
        return int(e.code or 0)
