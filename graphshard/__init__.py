"""graphshard: Fully Sharded Data Parallel (ZeRO-3) done by the compiler.

    graphshard.shard(model)                               # parameters -> DTensor shards
    model = torch.compile(model, backend="graphshard")    # collectives inserted as FX passes
"""

from graphshard.policy import MixedPrecisionPolicy, ShardingStrategy
from graphshard.sharding import is_sharded, shard

__all__ = ["shard", "is_sharded", "MixedPrecisionPolicy", "ShardingStrategy"]
