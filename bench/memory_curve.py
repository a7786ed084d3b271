"""`python -m graphshard.bench.memory_curve`: step time against peak memory, under a budget.

    python -m graphshard.bench.memory_curve --model transformer --seq 64 --points 4

DDP keeps every parameter gathered (fast, the most memory); FSDP2 keeps none (the least, slow).
graphshard's reshard_after_forward="auto" keeps, under `memory_budget_mb`, the units whose
gathered weights save the most communication time per byte (the cost model's choice). This
bench measures DDP's and FSDP2's peaks first (eager, one short launch), then times, interleaved
in one run: DDP, FSDP2, graphshard's default, and graphshard "auto" at `--points` budgets spread
evenly from FSDP2's measured peak to DDP's. It reports each method's median step time and
measured (and, for graphshard, predicted) peak memory, whether each graphshard point lies below
the straight line from FSDP2's (memory, time) to DDP's, and plots the curve (PNG, matplotlib
if installed) beside a JSON of the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys

from graphshard.tools.arguments import parse_model_args

FIXED = ("ddp_eager", "fsdp2_eager")


def auto_method(budget_mb: float) -> str:
    return f"graphshard:reshard_after_forward=auto+memory_budget_mb={budget_mb:.1f}"


def line_between(points: dict[str, tuple[float, float]], memory: float) -> float:
    """Step time on the straight line from FSDP2's (memory, time) to DDP's, at `memory`."""
    (m0, t0), (m1, t1) = points["fsdp2_eager"], points["ddp_eager"]
    return t0 + (memory - m0) * (t1 - t0) / (m1 - m0)


def plot(rows: list[dict], title: str, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fixed = [r for r in rows if r["method"] in FIXED]
    ax.plot([r["peak_mib"] for r in fixed], [r["step_ms"] for r in fixed], "k--",
            label="straight line FSDP2 - DDP")
    for r in fixed:
        ax.annotate(r["method"], (r["peak_mib"], r["step_ms"]))
    curve = sorted((r for r in rows if r["method"].startswith("graphshard:")),
                   key=lambda r: r["peak_mib"])
    ax.plot([r["peak_mib"] for r in curve], [r["step_ms"] for r in curve], "o-",
            label='graphshard "auto" under a budget')
    default = next(r for r in rows if r["method"] == "graphshard")
    ax.plot([default["peak_mib"]], [default["step_ms"]], "s", label="graphshard default")
    ax.set_xlabel("measured peak MiB per rank")
    ax.set_ylabel("step time, ms (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    from graphshard.bench.harness import BenchConfig, run
    from graphshard.bench.report import format_breakdown, summarize

    p = argparse.ArgumentParser(prog="python -m graphshard.bench.memory_curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="transformer")
    p.add_argument("--model-args", type=parse_model_args, default=(), metavar="K=V,...")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--points", type=int, default=4, help="budgets from FSDP2's peak to DDP's")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="memory_curve.json")
    p.add_argument("--plot", default="memory_curve.png")
    args = p.parse_args(argv)
    if args.points < 2:
        p.error("--points must be at least 2")

    def bench(methods, steps, repeats):
        cfg = BenchConfig(model=args.model, model_args=args.model_args, nproc=args.nproc,
                          methods=tuple(methods), batch=args.batch, seq=args.seq, steps=steps,
                          repeats=repeats, warmup=args.warmup)
        summary = summarize(cfg, *run(cfg))
        failed = {n: m["status"] for n, m in summary["methods"].items() if m["status"] != "ok"}
        if failed:
            raise SystemExit(f"memory_curve: methods failed: {failed}")
        return summary["methods"]

    print("measuring DDP's and FSDP2's peaks", file=sys.stderr, flush=True)
    peaks = {name: m["peak_mib"] for name, m in bench(FIXED, 2, 1).items()}
    low, high = peaks["fsdp2_eager"], peaks["ddp_eager"]
    budgets = [low + i * (high - low) / (args.points - 1) for i in range(args.points)]
    methods = [*FIXED, "graphshard", *dict.fromkeys(auto_method(b) for b in budgets)]
    print(f"budgets (MiB): {', '.join(f'{b:.1f}' for b in budgets)}", file=sys.stderr, flush=True)
    measured = bench(methods, args.steps, args.repeats)

    points = {n: (measured[n]["peak_mib"], measured[n]["step_ms"]["median"]) for n in FIXED}
    rows = []
    for name in methods:
        m = measured[name]
        memory, time_ms = m["peak_mib"], m["step_ms"]["median"]
        row = {"method": name, "step_ms": time_ms, "step_ms_min": m["step_ms"]["min"],
               "step_ms_max": m["step_ms"]["max"], "peak_mib": memory,
               "predicted_peak_mib": m.get("predicted_peak_mib"),
               "breakdown_ms": m.get("breakdown_ms", {})}
        if name not in FIXED:
            row["line_ms"] = line_between(points, memory)
            row["below_line"] = time_ms < row["line_ms"]
        rows.append(row)

    from tabulate import tabulate
    print(tabulate([[r["method"], f"{r['step_ms']:.1f} [{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}]",
                     f"{r['peak_mib']:.1f}",
                     "-" if r["predicted_peak_mib"] is None else f"{r['predicted_peak_mib']:.1f}",
                     "-" if "line_ms" not in r else f"{r['line_ms']:.1f}",
                     "-" if "below_line" not in r else ("yes" if r["below_line"] else "no")]
                    for r in rows],
                   headers=["method", "step ms median [min-max]", "peak MiB", "predicted MiB",
                            "line ms at that peak", "below the line"], disable_numparse=True))
    print()
    print(format_breakdown({"methods": measured}))
    title = (f"{args.model}, world size {args.nproc}, global batch {args.batch}, seq {args.seq}")
    print(plot(rows, title, args.plot))
    with open(args.json, "w") as f:
        json.dump({"config": vars(args) | {"model_args": dict(args.model_args)},
                   "budgets_mib": budgets, "rows": rows}, f, indent=2)
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
