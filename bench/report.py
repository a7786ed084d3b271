"""Turns the ranks' raw measurements into one summary: the table, the JSON, the plot."""

from __future__ import annotations

import json
import os
import platform
import statistics

import torch
from tabulate import tabulate

from graphshard.bench.harness import OK, BenchConfig, RankResult
from graphshard.bench.measure import TimeStats
from graphshard.bench.methods import BASELINES, method

_MIB = 1024 * 1024
_MB = 1e6
LOSS_REFERENCE = "ddp_eager"


def _repeat_medians(per_step: list[float], steps: int) -> list[float]:
    """The median step of each repeat (the timed steps come in blocks of `steps` per repeat)."""
    return [statistics.median(per_step[i:i + steps]) for i in range(0, len(per_step), steps)]


def _method_summary(name: str, timing: list[RankResult], profile: list[RankResult],
                    steps: int) -> dict:
    """One method's numbers. A step lasts until its slowest rank finishes: max over ranks."""
    entry: dict = {"status": timing[0].status.get(name, "not run"),
                   "description": method(name).description}
    if entry["status"] != OK:
        return entry
    per_step = [max(steps) for steps in zip(*(r.step_s[name] for r in timing))]
    stats = TimeStats.of(per_step)
    entry["step_ms"] = {"median": stats.median_s * 1e3, "min": stats.min_s * 1e3,
                        "max": stats.max_s * 1e3, "n": stats.n}
    entry["repeat_median_ms"] = [t * 1e3 for t in _repeat_medians(per_step, steps)]
    entry["losses"] = [statistics.fmean(ls) for ls in zip(*(r.losses[name] for r in timing))]
    if method(name).compiled:
        entry["dynamo"] = timing[0].dynamo.get(name)  # during the cold warm-up
        entry["dynamo_warm"] = profile[0].dynamo.get(name)  # during the warm first step
        # Compile time = first step less a normal step.
        cold = max(r.first_step_s[name] for r in timing) - stats.median_s
        warm = [r.first_step_s[name] for r in profile if name in r.first_step_s]
        entry["compile_s"] = {"cold": cold,
                              "warm": max(warm) - stats.median_s if len(warm) == len(profile) else None}
    entry["profile_status"] = profile[0].status.get(name, "not run")
    if entry["profile_status"] == OK:
        step = profile[0].profile[name]  # every rank issues the same collectives
        entry["collectives_per_step"] = sum(step["collectives"].values())
        entry["collectives_by_kind"] = step["collectives"]
        entry["comm_mb_per_step"] = sum(step["comm_bytes"].values()) / _MB
        entry["comm_mb_by_kind"] = {k: v / _MB for k, v in step["comm_bytes"].items()}
        entry["peak_mib_per_rank"] = [r.profile[name]["peak_bytes"] / _MIB for r in profile]
        entry["peak_mib"] = max(entry["peak_mib_per_rank"])
        entry["breakdown_ms"] = step.get("breakdown_ms", {})  # rank 0's measured step
        # graphshard's memory model, as `graphshard dump` shows it: from the ranks that
        # compiled (one per host where the ranks' graphs are alike; the others load it)
        predicted = [r.predicted_peak_bytes[name] for r in profile
                     if name in r.predicted_peak_bytes]
        if predicted:
            entry["predicted_peak_mib"] = max(predicted) / _MIB
    return entry


# A run is flagged when, in some repeat, processes other than the bench's ranks used more than
# this share of the machine's CPUs, or the hypervisor stole more than that one (a rank's own
# gloo threads count as its own: a 2-rank run on 2 CPUs is busy, not loaded).
HEAVY_OTHER_SHARE, HEAVY_STEAL_SHARE = 0.25, 0.10


def other_cpu_shares(timing: list[RankResult], cpus: int) -> list[tuple[float, float]]:
    """Per timed repeat: (the share of the CPUs used by processes other than the ranks, the
    share stolen), from each rank's CpuSample; [] where the machine's counters are missing."""
    shares = []
    for samples in zip(*(rank.cpu for rank in timing)):
        first = samples[0]
        if first.machine_busy_s is None or first.wall_s <= 0:
            return []
        capacity = first.wall_s * cpus
        own = sum(sample.own_s for sample in samples)
        shares.append((max(0.0, first.machine_busy_s - own) / capacity,
                       first.machine_steal_s / capacity))
    return shares


def summarize(cfg: BenchConfig, timing: list[RankResult], profile: list[RankResult]) -> dict:
    methods = {name: _method_summary(name, timing, profile, cfg.steps) for name in cfg.methods}
    ok = [name for name, m in methods.items() if m["status"] == OK]

    reference = LOSS_REFERENCE if LOSS_REFERENCE in ok else (ok[0] if ok else None)
    for name in ok:
        m = methods[name]
        for base in BASELINES:
            if base in ok:
                m[f"ratio_vs_{base}"] = m["step_ms"]["median"] / methods[base]["step_ms"]["median"]
                # Paired in time: each repeat runs every method back to back, so the ratio of
                # their medians within a repeat cancels the machine's drift between repeats.
                paired = [a / b for a, b in zip(m["repeat_median_ms"],
                                                methods[base]["repeat_median_ms"])]
                m[f"repeat_ratios_vs_{base}"] = {"median": statistics.median(paired),
                                                  "min": min(paired), "max": max(paired)}
        ref = methods[reference]["losses"]
        m["loss_max_abs_diff"] = max((abs(a - b) for a, b in zip(m["losses"], ref)), default=0.0)

    cpus = os.cpu_count() or 1
    loadavg = timing[0].loadavg
    notes = []
    others = other_cpu_shares(timing, cpus)
    heavy = any(share > HEAVY_OTHER_SHARE or steal > HEAVY_STEAL_SHARE for share, steal in others)
    if heavy:
        notes.append("under heavy load: " + ", ".join(
            f"repeat {i + 1}: others {share:.0%}, stolen {steal:.0%}"
            for i, (share, steal) in enumerate(others)) + f" of the {cpus} CPUs while the methods "
            "ran; timings are unreliable")
    elif not others and any(load[0] > cpus + cfg.nproc for load in loadavg):
        heavy = True  # no /proc/stat: the load average beyond the ranks' own
        notes.append(f"under heavy load: 1-min load average above {cpus} CPUs + {cfg.nproc} ranks "
                     f"({', '.join(f'{l[0]:.2f}' for l in loadavg)}); timings are unreliable")
    if cfg.nproc > cpus:
        notes.append(f"{cfg.nproc} ranks on {cpus} CPUs oversubscribe the machine: "
                     "compare correctness and counts, not timings")
    for name in ok:
        breaks = (methods[name].get("dynamo") or {}).get("graph_breaks", 0)
        if breaks:
            notes.append(f"{name}: {breaks} graph break(s) while compiling")
    if cfg.steps * cfg.repeats < 20:
        notes.append(f"only {cfg.steps * cfg.repeats} timed steps per method (fewer than 20)")
    return {
        "config": {**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                   "model_args": dict(cfg.model_args), "threads_per_rank": cfg.threads_per_rank},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "cpu_count": cpus, "loadavg_per_repeat": loadavg,
                        "other_cpu_share_per_repeat": [share for share, _ in others],
                        "steal_share_per_repeat": [steal for _, steal in others],
                        "heavy_load": heavy, "oversubscribed": cfg.nproc > cpus},
        "loss_reference": reference,
        "methods": methods,
        "notes": notes,
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread(ratios: dict | None) -> str:
    return "-" if ratios is None else f"{ratios['median']:.2f} [{ratios['min']:.2f}-{ratios['max']:.2f}]"


def format_table(summary: dict) -> str:
    headers = ["method", "step ms median [min-max]", "x fsdp2_eager", "per repeat [min-max]",
               "x ddp_eager",
               "coll/step", "comm MB/step", "peak MiB/rank", "predicted MiB", "compile s cold/warm",
               f"loss max|d| vs {summary['loss_reference']}"]
    rows = []
    for name, m in summary["methods"].items():
        if m["status"] != OK:
            rows.append([name, m["status"]] + ["-"] * (len(headers) - 2))
            continue
        t = m["step_ms"]
        compile_s = m.get("compile_s")
        rows.append([
            name,
            f"{t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}]",
            _fmt(m.get("ratio_vs_fsdp2_eager"), ".2f"),
            _spread(m.get("repeat_ratios_vs_fsdp2_eager")),
            _fmt(m.get("ratio_vs_ddp_eager"), ".2f"),
            _fmt(m.get("collectives_per_step"), "d"),
            _fmt(m.get("comm_mb_per_step"), ".2f"),
            _fmt(m.get("peak_mib"), ".1f"),
            _fmt(m.get("predicted_peak_mib"), ".1f"),
            "-" if compile_s is None
            else f"{_fmt(compile_s['cold'], '.1f')} / {_fmt(compile_s['warm'], '.1f')}",
            f"{m['loss_max_abs_diff']:.2e}",
        ])
    return tabulate(rows, headers=headers, disable_numparse=True)


BREAKDOWN = ("step", "forward", "backward", "optimizer", "wait", "kernels", "issue", "copy_out",
             "host")


def format_breakdown(summary: dict) -> str:
    """Where a profiled step's time goes, per method (rank 0, main thread, ms, the average of
    the profile's measured steps): forward, backward and optimizer phases; and across them the
    compiled graphs' kernels, their collective calls, the time they block in wait_tensor on a
    collective (eager methods wait inside c10d, which this does not count), graphshard's copy
    out of gathered buckets, and the host's work outside graphs and optimizer
    (measure._main_thread_split). Under the profiler, so slower than the timed steps: compare
    methods, not absolute numbers."""
    rows = []
    for name, m in summary["methods"].items():
        b = m.get("breakdown_ms")
        if m["status"] != OK or not b:
            continue
        rows.append([name, *(f"{b.get(k, 0):.1f}" for k in BREAKDOWN)])
    return tabulate(rows, headers=["method (profiled step)", "step ms", "forward", "backward",
                                   "optimizer", "of which in wait_tensor", "graph kernels",
                                   "collective calls", "bucket copy-out", "host"],
                    disable_numparse=True)


def limit_breakdown(summary: dict, method: str) -> dict | None:
    """`method`'s time above compute-only (each rank's unsharded model compiled, no
    communication), in ms: the timed medians of the step, compute-only and the same
    collectives alone, then the profiled difference split into exposed communication (waits
    and collective calls), bucket copy-out, slower kernels (packing buckets, local sums and casts
    count there), the optimizer and the host; None where a method is missing."""
    methods = summary["methods"]
    ours, floor = methods.get(method), methods.get("compute_only")
    if not (ours and floor and ours["status"] == OK and floor["status"] == OK
            and ours.get("breakdown_ms") and floor.get("breakdown_ms")):
        return None
    b, f = ours["breakdown_ms"], floor["breakdown_ms"]
    alone = methods.get("collectives_only", {})
    return {
        "step_ms": ours["step_ms"]["median"], "compute_only_ms": floor["step_ms"]["median"],
        "collectives_only_ms": (alone["step_ms"]["median"] if alone.get("status") == OK else None),
        "above_ms": ours["step_ms"]["median"] - floor["step_ms"]["median"],
        "profiled_above_ms": b["step"] - f["step"],
        "exposed_comm_ms": b.get("wait", 0.0) + b.get("issue", 0.0),
        "copy_out_ms": b.get("copy_out", 0.0),
        "slower_kernels_ms": b.get("kernels", 0.0) - f.get("kernels", 0.0),
        "optimizer_ms": b.get("optimizer", 0.0) - f.get("optimizer", 0.0),
        "host_ms": b.get("host", 0.0) - f.get("host", 0.0),
    }


def format_limit(summary: dict) -> str:
    """limit_breakdown of each graphshard method of the run, one row each."""
    rows = []
    for name in summary["methods"]:
        limit = limit_breakdown(summary, name) if name.startswith("graphshard") else None
        if limit:
            rows.append([name, *(("-" if v is None else f"{v:.1f}") for v in limit.values())])
    return tabulate(rows, headers=["method, ms", "step", "compute only", "collectives only",
                                   "above compute only", "profiled above", "exposed comm",
                                   "bucket copy-out", "slower kernels", "optimizer", "host"],
                    disable_numparse=True) if rows else ""


def write_json(summary: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


def plot(summary: dict, path: str) -> str | None:
    """Bar charts of step time and peak memory per method; returns a note if skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    ok = {n: m for n, m in summary["methods"].items() if m["status"] == OK}
    if not ok:
        return "no method ran: no plot"
    names = list(ok)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    median = [ok[n]["step_ms"]["median"] for n in names]
    low = [median[i] - ok[n]["step_ms"]["min"] for i, n in enumerate(names)]
    high = [ok[n]["step_ms"]["max"] - median[i] for i, n in enumerate(names)]
    ax_t.bar(names, median, yerr=[low, high], capsize=4)
    ax_t.set_ylabel("step time, ms (median, min-max)")
    ax_m.bar(names, [ok[n].get("peak_mib", 0.0) for n in names], color="tab:orange")
    ax_m.set_ylabel("peak MiB per rank")
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", rotation=30)
    cfg = summary["config"]
    args = ", ".join(f"{k}={v}" for k, v in cfg["model_args"].items())
    fig.suptitle(f"{cfg['model']}{f' ({args})' if args else ''}, world size {cfg['nproc']}, "
                 f"global batch {cfg['batch']}, seq {cfg['seq']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
