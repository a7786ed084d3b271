"""`python -m graphshard.bench.plan_fidelity`: can `graphshard plan`'s predictions be trusted here?

    graphshard calibrate --out local.json
    python -m graphshard.bench.plan_fidelity --cluster local.json --json fidelity.json

For each configuration below (two built-in models, world sizes 2 and 3, strategies (no_shard
among them), activation
checkpointing, dtypes, reshard and prefetch options, tensor parallelism on a 1x2 mesh) the
planner's prediction (`plan.predict`: the same capture, passes and cost model as
`graphshard plan`) is set beside the bench's
measurement (the configuration as a graphshard bench method, timed interleaved with the others
of its model and world size, in rounds that run every model and world size in turn; the median
step; peak memory counted by the allocator on every thread).
Reports per configuration the predicted and measured step time and peak memory and their
errors, then Spearman's rank correlation of the step times and the median absolute error, and,
with a calibration file, the machine's speed against the calibration's before the first round
and after each (a prediction holds for the machine its calibration saw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from graphshard.tools.plan import Knobs, Layout

SEQ = 64


@dataclass(frozen=True)
class Case:
    model: str
    world: int
    batch: int  # global
    strategy: str = "full_shard"
    ac: str = "none"
    param_dtype: str = "float32"
    keep: str = "last"  # "all": shard_grad_op
    prefetch: int = 1
    bucket_mb: float = 64.0
    tp: int = 1  # tensor-parallel degree: a (world / tp, tp) mesh, the model's own TP plan
    model_args: dict = field(default_factory=dict, hash=False)

    def method(self, cluster_file: str | None = None) -> str:
        """The bench method that runs this configuration; `cluster_file`: the cost model its
        compile schedules with, the one the planner priced it with (a preset: the built-in)."""
        parts = [f"strategy={'shard_grad_op' if self.keep == 'all' else self.strategy}",
                 f"ac={self.ac}", f"prefetch={self.prefetch}", f"bucket_mb={self.bucket_mb:g}"]
        if self.param_dtype != "float32":
            parts += [f"param_dtype={self.param_dtype}", "reduce_dtype=float32"]
        if self.tp > 1:
            parts.append("tp=true")
        if cluster_file is not None:
            parts.append(f"cluster={os.path.abspath(cluster_file)}")
        return "graphshard:" + "+".join(parts)

    @property
    def label(self) -> str:
        return (f"{self.model} ws{self.world} {'shard_grad_op' if self.keep == 'all' else self.strategy}"
                f" ac={self.ac} {'bf16' if self.param_dtype != 'float32' else 'fp32'} "
                f"prefetch={self.prefetch} bucket={self.bucket_mb:g}"
                + (f" tp={self.tp}" if self.tp > 1 else ""))


CASES = [
    Case("transformer", 2, 8),
    Case("transformer", 2, 8, keep="all"),
    Case("transformer", 2, 8, ac="full"),
    Case("transformer", 2, 8, prefetch=2, bucket_mb=1.0),
    Case("llama", 2, 8),
    Case("llama", 2, 8, keep="all"),
    Case("llama", 2, 8, ac="selective"),
    Case("llama", 2, 8, param_dtype="bfloat16"),
    Case("transformer", 3, 6),
    Case("llama", 3, 6, ac="full"),
    Case("llama", 2, 8, tp=2),
    Case("llama", 2, 8, tp=2, param_dtype="bfloat16"),
    Case("transformer", 2, 8, strategy="no_shard"),
    Case("llama", 2, 8, strategy="no_shard", param_dtype="bfloat16"),
    Case("llama", 3, 6, strategy="no_shard"),
]


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def machine_speed(cluster) -> float:
    """This machine's fp32 matmul rate now over its calibration's (`cluster.flops_per_s`), timed
    by the calibration's own probe at a rank's share of the cores: 1.0 is the machine the
    planner priced; 0.85 one computing 15% slower (load from elsewhere, another host's turn)."""
    import torch

    from graphshard.tools import calibrate

    with calibrate.threads_of_a_rank(cluster.compute_slots_per_node or 1):
        return calibrate.matmul_rate(torch.float32, repeats=10) / cluster.flops_per_s


def measure(cases: list[Case], steps: int, repeats: int, warmup: int,
            cluster_file: str | None = None, rounds: int = 3,
            speed: Callable[[], float] | None = None,
            speeds: list[float] | None = None) -> dict[Case, dict]:
    """Each configuration's median step and peak memory over `rounds` rounds. A round runs
    every group of configurations (one model, world size and TP degree: one bench launch, its
    methods interleaved over `repeats`) once, each round starting at the next group: the
    machine's drift over the run falls on every group alike, not on whichever group ran while
    the machine was slow. The rounds share one Inductor cache: later rounds load what the first
    compiled. `speed` (e.g. `machine_speed`), if given, is read before the first round and after
    each, between launches, into `speeds`."""
    from graphshard.bench.harness import BenchConfig, run
    from graphshard.bench.report import summarize

    groups: dict[tuple, list[Case]] = {}
    for case in cases:
        groups.setdefault((case.model, case.world, case.batch, case.tp), []).append(case)
    order = list(groups)
    samples: dict[Case, list[tuple[float, float]]] = {case: [] for case in cases}
    speeds = [] if speeds is None else speeds
    with tempfile.TemporaryDirectory(prefix="graphshard-fidelity-") as cache_dir:
        if speed is not None:
            speeds.append(speed())
        for round_index in range(rounds):
            shift = round_index % len(order)
            for model, world, batch, tp in order[shift:] + order[:shift]:
                group = groups[model, world, batch, tp]
                cfg = BenchConfig(model=model, nproc=world, tp=tp,
                                  methods=tuple(c.method(cluster_file) for c in group),
                                  batch=batch, seq=SEQ, steps=steps, repeats=repeats,
                                  warmup=warmup)
                summary = summarize(cfg, *run(cfg, cache_dir=cache_dir))
                for case in group:
                    entry = summary["methods"][case.method(cluster_file)]
                    if entry.get("status") != "ok" or entry.get("profile_status") != "ok":
                        raise RuntimeError(f"{case.label}: timing {entry.get('status')}, "
                                           f"profile {entry.get('profile_status')}")
                    samples[case].append((entry["step_ms"]["median"] / 1e3,
                                          entry["peak_mib"] * 2**20))
            if speed is not None:
                speeds.append(speed())
    return {case: {"step_s": statistics.median(step for step, _ in runs),
                   "peak_bytes": statistics.median(peak for _, peak in runs)}
            for case, runs in samples.items()}


def measured_before(cases: list[Case], path: str) -> dict[Case, dict]:
    """The measurements of an earlier run's JSON, by configuration."""
    with open(path) as f:
        rows = {row["config"]: row for row in json.load(f)["rows"]}
    missing = [case.label for case in cases if case.label not in rows]
    if missing:
        raise SystemExit(f"{path} has no measurement of {missing}: run without --measured")
    return {case: {"step_s": rows[case.label]["measured_ms"] / 1e3,
                   "peak_bytes": rows[case.label]["measured_mib"] * 2**20} for case in cases}


def predict_all(cases: list[Case], cluster) -> dict[Case, dict]:
    from graphshard.tools.plan import predict

    predicted = {}
    for case in cases:
        data_parallel = case.world // case.tp  # the TP ranks of a data-parallel rank share its rows
        shard_size = 1 if case.strategy == "no_shard" else data_parallel
        layout = Layout(case.strategy, shard_size, case.ac, case.param_dtype,
                        case.batch // data_parallel, case.tp)
        config = predict(case.model, case.world, cluster, case.batch, SEQ, layout,
                         Knobs(case.keep, case.prefetch, case.bucket_mb), case.model_args)
        predicted[case] = {"step_s": config.step_s, "peak_bytes": config.peak_memory_bytes}
    return predicted


def main(argv: list[str] | None = None) -> int:
    from graphshard.compiler.clusters import resolve_cluster

    p = argparse.ArgumentParser(prog="python -m graphshard.bench.plan_fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True,
                   help="this machine's JSON from `graphshard calibrate --out FILE` (or 'local')")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved repeats of a group's methods within each of its launches")
    p.add_argument("--rounds", type=int, default=3,
                   help="launches of every group, one round after another (the median is kept)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the table here")
    p.add_argument("--measured", metavar="JSON",
                   help="take the measurements from this earlier --json output instead of running "
                        "the bench (to re-predict after a change to the cost model)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        p.error(f"--rounds and --repeats must be at least 1, got {args.rounds} and {args.repeats}")
    cluster = resolve_cluster(args.cluster)
    predicted = predict_all(CASES, cluster)
    cluster_file = args.cluster if os.path.isfile(args.cluster) else None
    # A calibrated machine is checked for drift: a preset's rates are another machine's.
    speeds: list[float] = []
    measured = (measure(CASES, args.steps, args.repeats, args.warmup, cluster_file, args.rounds,
                        (lambda: machine_speed(cluster)) if cluster_file else None, speeds)
                if args.measured is None
                else measured_before(CASES, args.measured))
    rows = []
    for case in CASES:
        pred, meas = predicted[case], measured[case]
        rows.append({"config": case.label, "method": case.method(cluster_file),
                     "predicted_ms": pred["step_s"] * 1e3, "measured_ms": meas["step_s"] * 1e3,
                     "time_error": pred["step_s"] / meas["step_s"] - 1,
                     "predicted_mib": pred["peak_bytes"] / 2**20,
                     "measured_mib": meas["peak_bytes"] / 2**20,
                     "memory_error": pred["peak_bytes"] / meas["peak_bytes"] - 1})
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    median_time = statistics.median(abs(r["time_error"]) for r in rows)
    median_memory = statistics.median(abs(r["memory_error"]) for r in rows)
    print(f"{'configuration':<62} {'pred ms':>8} {'meas ms':>8} {'err':>6} "
          f"{'pred MiB':>9} {'meas MiB':>9} {'err':>6}")
    for r in rows:
        print(f"{r['config']:<62} {r['predicted_ms']:8.1f} {r['measured_ms']:8.1f} "
              f"{100 * r['time_error']:+5.0f}% {r['predicted_mib']:9.1f} {r['measured_mib']:9.1f} "
              f"{100 * r['memory_error']:+5.0f}%")
    print(f"step time: Spearman rank correlation {rho:.2f}, median |error| {100 * median_time:.0f}%; "
          f"peak memory: median |error| {100 * median_memory:.0f}%, "
          f"max {100 * max(abs(r['memory_error']) for r in rows):.0f}%")
    if speeds:
        print("machine speed against the calibration's (fp32 matmuls), before the first round and "
              f"after each: {', '.join(f'{s:.2f}' for s in speeds)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": args.cluster, "rows": rows, "spearman": rho,
                       "median_abs_time_error": median_time,
                       "median_abs_memory_error": median_memory,
                       "machine_speed": speeds or None}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
