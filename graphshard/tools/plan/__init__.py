"""`graphshard plan`: the fastest configuration that fits, for a cluster you do not have.

    graphshard plan llama3-8b --devices 64 --cluster h100 --global-batch 64 --seq 8192
    graphshard plan my_pkg.models:make_model --devices 16 --cluster a100 --global-batch 32 \\
        --seq 2048 --json all.json --out best.json --trace best_step.json

TARGET is as for `graphshard dump` (a built-in name, package.module:factory or file.py:factory),
except that the planner varies the micro-batch and the sequence length: a factory must take
`factory(batch=, seq_len=)` and return example inputs of that shape. The planner captures the
training step the way dump does (one process, a fake process group of `--devices` ranks, fake
tensors: no weights, no GPU), then searches:

- layout (each needs its own capture): strategy (full_shard over all devices, hybrid_shard
  with every shard-group size that divides the device count and is whole nodes: one node or
  several, or no_shard: DDP's layout, every parameter whole on each device), activation
  checkpointing of the repeated blocks (`--ac`: none, full, selective, the
  values `graphshard dump --ac` takes), parameter dtype (bf16 with fp32 reduction, or fp32),
  micro-batch size (accumulating to the global batch);
- options (only the passes and the estimate run again): which units stay gathered from forward
  to backward (the last one: full_shard's default; all: shard_grad_op; "auto": as many blocks as
  the device memory allows), prefetch depth, bucket size (no_shard: the bucket size alone).

Each configuration's step is predicted by the cost model (graphshard.compiler.cost_model: roofline
compute with per-kernel overhead, alpha-beta collectives on the intra- or inter-node link each
process group spans, the optimizer step as a memory-bound pass over the shards) simulated on the
compiled forward and backward graphs, and its peak memory by the liveness model dump reports.
A model with more than five repeated blocks whose factory takes `n_layers` is captured with 4
and 5 blocks and extrapolated linearly to its depth (blocks repeat: so do their costs; see
`depth_probes` for why not fewer); others are captured whole.

Output: a ranked table (fitting configurations first, fastest first; memory in the unit that
fits, MiB below 1 GiB), the best configuration as JSON (`--out`), which graphshard.apply_plan
applies: {"shard": keyword arguments for graphshard.shard plus "mesh_shape", "mesh_dim_names"
and "tensor_parallel", "options": for torch.compile(..., backend="graphshard", options=...),
"activation_checkpointing": graphshard.apply_activation_checkpointing's mode, "micro_batch",
"accumulation_steps"}; `--json` every configuration tried (a list under
"configs", best first); `--trace` a Chrome trace of the best configuration's simulated step (of
the captured graphs: the 5-block probe when extrapolated). Bad input exits with status 2 and one
line on stderr.
"""

from graphshard.tools.plan.auto import auto_config
from graphshard.tools.plan.capture import capture_probes
from graphshard.tools.plan.cli import USAGE_ERROR, main
from graphshard.tools.plan.config import ADAMW_BYTES_PER_ELEMENT, Config, Probe, finish
from graphshard.tools.plan.report import PUBLISHED, budget_mb, published_figures, table
from graphshard.tools.plan.search import plan, predict
from graphshard.tools.plan.space import (KNOBS, Knobs, Layout, PlanError, layouts, micro_batches,
                                         shard_group_sizes)
from graphshard.tools.plan.target import depth_probes

__all__ = ["ADAMW_BYTES_PER_ELEMENT", "Config", "KNOBS", "Knobs", "Layout", "PUBLISHED", "PlanError",
           "Probe", "USAGE_ERROR", "auto_config", "budget_mb", "capture_probes", "depth_probes",
           "finish", "layouts", "main", "micro_batches", "plan", "predict", "published_figures",
           "shard_group_sizes", "table"]
