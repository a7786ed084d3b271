"""graphshard: Fully Sharded Data Parallel (ZeRO-3) done by the compiler.

    graphshard.shard(model)                               # parameters -> DTensor shards
    model = torch.compile(model, backend="graphshard")    # collectives inserted as FX passes
"""

from graphshard.activation_checkpointing import apply_activation_checkpointing
from graphshard.grad_sync import no_sync, set_requires_all_reduce, set_requires_gradient_sync
from graphshard.init import materialize
from graphshard.policy import MixedPrecisionPolicy, ShardingStrategy
from graphshard.sharding import is_sharded, shard
from graphshard.tensor_parallel_plan import parallelize
from graphshard.tools.plan.apply import AppliedPlan, apply_plan

__all__ = [
    "shard", "is_sharded", "MixedPrecisionPolicy", "ShardingStrategy",
    "no_sync", "set_requires_gradient_sync", "set_requires_all_reduce", "materialize",
    "apply_activation_checkpointing", "parallelize", "apply_plan", "AppliedPlan",
]
