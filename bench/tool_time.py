"""`python -m graphshard.bench.tool_time`: how long `graphshard dump` and `graphshard plan` take
on this machine, beside a CPU reference a reader can scale them by.

    python -m graphshard.bench.tool_time --json bench/results/tool_time.json

Each command runs in a fresh interpreter, one after another, `--repeats` times: its wall time
and its CPU seconds (its own and its children's: the planner's capture processes). The
reference is the bench's compute-only step (the built-in transformer, sequence 64, world size 2,
each rank's unsharded model compiled, no communication: `python -m graphshard.bench --methods
compute_only`), measured in the same run; a machine whose compute-only step takes twice as long
takes about twice as long for the tools too (both are single-threaded work per process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from tabulate import tabulate

TOOLS = {
    "dump llama3-8b ws64": ["dump", "llama3-8b", "--world-size", "64", "--quiet"],
    "plan llama3-8b 64xh100": ["plan", "llama3-8b", "--devices", "64", "--cluster", "h100",
                               "--global-batch", "64", "--seq", "8192"],
}


def _timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def compute_only_ms() -> float:
    """The bench's compute-only step (median ms, the slower rank's), in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reference.json")
        subprocess.run([sys.executable, "-m", "graphshard.bench", "--model", "transformer",
                        "--seq", "64", "--methods", "compute_only", "--steps", "10",
                        "--repeats", "1", "--warmup", "3", "--json", out, "--plot", ""],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["methods"]["compute_only"]["step_ms"]["median"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphshard.bench.tool_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated: " + ", ".join(TOOLS))
    p.add_argument("--json", help="write the raw times and the reference here")
    args = p.parse_args(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        p.error(f"unknown tool(s) {unknown}; valid: {', '.join(TOOLS)}")

    reference = compute_only_ms()
    raw = {tool: [_timed([sys.executable, "-m", "graphshard", *TOOLS[tool]])
                  for _ in range(args.repeats)] for tool in tools}
    rows = [[tool, statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs),
             statistics.median(w for w, _ in runs) / (reference / 1e3)] for tool, runs in raw.items()]
    print(f"reference: the bench's compute-only step, {reference:.1f} ms")
    print(tabulate(rows, headers=["command", "wall s", "CPU s", "wall / compute-only step"],
                   floatfmt=".1f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compute_only_ms": reference, "commands": {t: TOOLS[t] for t in tools},
                       "raw": {t: [{"wall_s": w, "cpu_s": c} for w, c in runs]
                               for t, runs in raw.items()},
                       "cpu_count": os.cpu_count()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
