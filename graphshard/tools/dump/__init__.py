"""`graphshard dump`: what the compiler does to a model, at any world size, on one laptop.

    graphshard dump TARGET [--world-size N] [--strategy S] [--shard-size S] [--stage STAGE]
                           [--option KEY=VALUE ...] [--param-dtype D] [--reduce-dtype D]
                           [--batch B] [--seq L] [--model-args K=V,...] [--no-meta]
                           [--cluster FILE] [--json FILE] [--trace FILE] [--quiet]

    graphshard dump llama3-8b --world-size 64 --param-dtype bf16 --trace step.json
    graphshard dump my_pkg.models:make_model -n 16 --option bucket_mb=25 --json dump.json

TARGET is a built-in model name (`graphshard.tools.models.BUILTIN_MODELS`: transformer,
transformer-large, llama, llama3-8b), or `package.module:factory`, or `path/to/file.py:factory`.
A factory returns `(model, example_inputs)` or `(model, example_inputs, loss_fn)`, where
example_inputs is a tuple, one tensor, or a dict of keyword inputs; `--batch`,
`--seq` and `--model-args` become its keyword arguments (built-ins: batch=1, seq_len=128 unless
given). `--stage` prints the FX graphs of a stage of `pipeline.STAGES` (merged: the Dynamo graph;
tagged: the joint graph; partitioned, lowered, bucketed, scheduled, transport, packed, freed: the
forward and backward graphs), or of `all`; default `none`: the summary only. Dtypes are
spelled either way (bf16 or bfloat16, fp16 or float16, fp32 or float32). Progress of the long
phases (capture, passes, estimate) goes to stderr, unless `--quiet`. Bad input exits with status
2 and one line on stderr; a model that fails to compile, with status 1. `--traceback` (or
GRAPHSHARD_TRACEBACK=1 in the environment, which covers argument errors too) raises the error
instead, with its traceback.

How it works. One process, a fake process group of world size N, and rank 0's view of it. The
factory runs under `torch.device("meta")` (unless `--no-meta`), so nothing is allocated; every
parameter, buffer and input then becomes a FakeTensor on the CPU, the model is sharded with
`graphshard.shard`, and the step is compiled by the very backend `torch.compile(model,
backend="graphshard")` uses (`GraphshardCompiler`, options as given) with an observer that
records every stage of `pipeline.PIPELINE`. Inductor itself is not run: it consumes the final
stage's graph unchanged. The backward graph is compiled eagerly together with the forward, and
the capture stops once it has been recorded, so no graph is ever executed: a Llama-3-8B-shaped
model dumps at world size 64 without its 32 GB of weights. (The loss runs outside the compiled
region under torch.compile, and the backward graph takes the gradient of every differentiable
output as an input, so the loss changes neither graph: a factory's loss_fn is only checked to be
callable, and a factory without one, whose loss would be a plain reduction of the output, gets
the very same graphs.)

Cost: almost all of it is Dynamo + AOTAutograd + partitioning (JSON `timing.stages_s`). The
Llama-3-8B shape (32 blocks, dim 4096; batch 1, seq 128) at world size 64 takes 34-35 s of
CPU time and as much wall time on a 2-core VM whose bench compute-only step is 67-72 ms
(`python -m graphshard.bench.tool_time`), full garbage collections paused while it captures.

Output: the graphs of the stage(s) asked for with `--stage`, as code; a table of every
collective, communication bytes per step beside the theory for the strategy (as formulas in N
and as numbers), and the cost model's estimates (`graphshard.compiler.cost_model`: alpha-beta
collectives, roofline compute, a two-lane simulation of each graph in node order) of per-rank
memory, step time and exposed communication. Memory: a graph's "own peak" is the most it holds
at one time beyond the model state and the batch (the forward's includes the activations it
saves; the backward starts with those, frees each after its last use, and produces the
gradients). The per-rank peak is model state (parameter shards, AdamW state) + inputs + the
larger own peak.

`--json FILE` writes the report (schema version 2): `report.DumpReport`, whose field comments
are the schema. `--trace FILE` writes a Chrome trace (chrome://tracing, https://ui.perfetto.dev)
of the simulated step: thread 0 is compute (one event per node, and "wait" events where compute
is blocked on a collective), thread 1 is communication (one event per collective); backward
follows forward.

The package: `loading` (targets -> Workload), `capture` (the backend's graphs, none run),
`analysis` (collectives, communication, memory; `dump` itself), `report` (the typed report and
its text), `cli`.
"""

from graphshard.tools.dump.analysis import (DumpResult, ParamInfo, collective_records,
                                            comm_summary, dump, memory_summary, param_infos)
from graphshard.tools.dump.capture import Capture, capture
from graphshard.tools.dump.cli import COMPILE_ERROR, TRACEBACK_ENV, USAGE_ERROR, main, run
from graphshard.tools.dump.loading import DumpError, Workload, load_workload
from graphshard.tools.dump.report import DumpReport, format_report, human_bytes

_human = human_bytes  # the name the tests use

__all__ = ["COMPILE_ERROR", "TRACEBACK_ENV", "USAGE_ERROR", "Capture", "DumpError", "DumpReport", "DumpResult",
           "ParamInfo", "Workload", "capture", "collective_records", "comm_summary", "dump",
           "format_report", "human_bytes", "load_workload", "main", "memory_summary",
           "param_infos", "run"]
