"""`graphshard plan` on the command line: arguments, the output files, exit statuses."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Sequence

from graphshard.tools.plan.capture import capture_probes
from graphshard.tools.plan.config import human_bytes
from graphshard.tools.plan.report import budget_mb, published_figures, table
from graphshard.tools.plan.search import plan
from graphshard.tools.plan.space import PlanError
from graphshard.tools.plan.target import depth_probes

USAGE_ERROR = 2
PLANNED_DTYPES = ("bfloat16", "float32", "float8")


def _parser() -> argparse.ArgumentParser:
    import graphshard.tools.plan as package
    from graphshard.compiler.clusters import PRESET_NAMES
    from graphshard.tools.arguments import AC_HELP

    p = argparse.ArgumentParser(prog="graphshard plan", description=package.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="built-in model name, package.module:factory or file.py:factory")
    p.add_argument("--devices", "-n", type=int, required=True, help="devices (ranks) to plan for")
    p.add_argument("--cluster", required=True,
                   help=f"a preset ({', '.join(PRESET_NAMES)}; sources in "
                        "graphshard/compiler/clusters.py) or a JSON file from `graphshard "
                        "calibrate --out FILE`")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--model-args", default="", metavar="K=V,...",
                   help="keyword arguments for the model factory")
    p.add_argument("--ac", default="none,full,selective", metavar="MODE[,MODE...]",
                   help=f"{AC_HELP}; the modes to try, comma-separated (default: all three)")
    p.add_argument("--dtypes", default="bf16,fp32",
                   help="parameter dtypes to try: bf16, fp32, float8 (torchao's float8 training "
                        "with float8 all-gather; needs the float8 extra)")
    p.add_argument("--tp", default="1,2,4,8", metavar="N[,N...]",
                   help="tensor-parallel degrees to try, within a node (default 1,2,4,8: those "
                        "that fit a node and the model's heads)")
    p.add_argument("--strategies", default="full_shard,hybrid_shard,no_shard",
                   metavar="S[,S...]",
                   help="strategies to try: full_shard (and shard_grad_op, its option to keep "
                        "every unit gathered), hybrid_shard, no_shard (DDP's layout); default: all")
    p.add_argument("--exhaustive", action="store_true",
                   help="capture every layout: hybrid shard groups and no_shard with every "
                        "layout, not only with the best three full_shard ones, and a slower "
                        "dtype's layouts even where their matmuls alone outlast the best step "
                        "found (several times slower on clusters of many nodes)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--out", default="graphshard_plan.json", help="the best configuration (JSON)")
    p.add_argument("--json", help="every configuration tried, best first")
    p.add_argument("--trace", help="Chrome trace of the best configuration's simulated step")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes capturing in parallel (default: up to 2)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _parsed(flag: str, parse, text: str):
    """A shared argument parser's value (graphshard.tools.arguments), its error as one line."""
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise PlanError(f"{flag}: {e}") from e


def _dtypes(text: str) -> list[str]:
    """'bf16,fp32,fp8' -> ['bfloat16', 'float32', 'float8']: the parameter dtypes the planner
    searches (float8: torchao's float8 Linears, gathered in float8; the rest bf16)."""
    from graphshard.policy import dtype_from_name

    accepted = "--dtypes takes bf16, fp32 and/or float8 (fp8), comma-separated"
    names = []
    for name in text.split(","):
        if name.strip().lower() in ("float8", "fp8"):
            names.append("float8")
            continue
        try:
            names.append(str(dtype_from_name(name)).removeprefix("torch."))
        except ValueError as e:
            raise PlanError(f"{accepted}; got {text!r}") from e
    if not all(name in PLANNED_DTYPES for name in names):
        raise PlanError(f"{accepted}; got {text!r}")
    return names


def _tp_sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(t < 1 for t in sizes):
        raise PlanError(f"--tp takes positive integers, comma-separated (e.g. 1,2,4,8); got {text!r}")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    from graphshard.compiler.clusters import resolve_cluster
    from graphshard.tools.arguments import parse_ac_modes, parse_model_args
    from graphshard.tools.dump.loading import DumpError, check_output_paths

    args = _parser().parse_args(argv)
    try:
        check_output_paths(out=args.out, json=args.json, trace=args.trace)
        cluster = resolve_cluster(args.cluster)
        model_args = dict(_parsed("--model-args", parse_model_args, args.model_args))
        ac_modes = _parsed("--ac", parse_ac_modes, args.ac)
        dtypes = _dtypes(args.dtypes)
        tp_sizes = _tp_sizes(args.tp)
        progress = (lambda m: None) if args.quiet else (lambda m: print(f"graphshard plan {m}",
                                                                        file=sys.stderr, flush=True))
        started = time.perf_counter()
        strategies = [name.strip() for name in args.strategies.split(",")]
        configs = plan(args.target, args.devices, cluster, args.global_batch, args.seq,
                       model_args=model_args, ac_modes=ac_modes, dtypes=dtypes,
                       tp_sizes=tp_sizes, strategies=strategies,
                       workers=args.jobs, progress=progress,
                       exhaustive=args.exhaustive)
        took = time.perf_counter() - started
        if not configs[0].fits:
            smallest = min(configs, key=lambda c: c.peak_memory_bytes)
            raise PlanError(
                f"{args.target} fits in no configuration on {args.devices} devices of "
                f"{human_bytes(cluster.device_memory_bytes)}: the smallest peak is "
                f"{human_bytes(smallest.peak_memory_bytes)} per device "
                f"({human_bytes(smallest.peak_memory_bytes - cluster.device_memory_bytes)} too "
                "much); use more devices or a smaller micro-batch"
                + ("" if "full_shard" in strategies
                   else ", or let --strategies include full_shard"))
    except (PlanError, DumpError, ValueError) as e:
        print(f"graphshard plan: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    budget = budget_mb(cluster)
    print(f"{args.target} on {args.devices} devices ({args.cluster}), global batch "
          f"{args.global_batch} x seq {args.seq}: {len(configs)} configurations in {took:.0f} s")
    print(table(configs, args.devices, cluster, args.top))
    best = configs[0]
    with open(args.out, "w") as f:
        json.dump(best.as_json(args.devices, budget), f, indent=2)
    print(f"best configuration written to {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "devices": args.devices, "cluster": args.cluster,
                       "global_batch": args.global_batch, "seq": args.seq, "seconds": took,
                       "configs": [c.as_json(args.devices, budget) for c in configs]}, f, indent=2)
        print(f"all configurations written to {args.json}")
    for line in published_figures(args.target, args.devices, args.cluster, args.seq, configs):
        print(line)
    if args.trace:
        _write_trace(args, best, cluster, model_args)
    return 0


def _write_trace(args, best, cluster, model_args: dict) -> None:
    """The best configuration's simulated step (of the captured graphs: the deeper probe when
    extrapolated), captured again in this process (the pool's workers drop their events)."""
    from graphshard.compiler.simulator import chrome_trace
    from graphshard.tools.plan.search import as_ranks_see_it

    _, probe_sizes = depth_probes(args.target, model_args)
    knob = dataclasses.replace(best.knobs, keep="last") if best.knobs.keep == "auto" else best.knobs
    probes = capture_probes(args.target, best.layout, args.devices, args.seq, probe_sizes[-1],
                            (knob,), as_ranks_see_it(cluster, args.devices), model_args)
    with open(args.trace, "w") as f:
        json.dump(chrome_trace(probes[knob].estimates,
                               process_name=f"graphshard plan {args.target} (simulated)"), f)
    print(f"trace of the best configuration written to {args.trace}")
