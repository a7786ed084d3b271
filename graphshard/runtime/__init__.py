"""The runtime behind `graphshard.shard`, one job per module (graphshard/sharding.py is the entry).

- parts: this rank's part of a full tensor, cut as shard() cuts it.
- local_shards: the plain autograd leaves a graph reads for each DTensor parameter.
- gathered_weight: what eager code reads as `module.weight`, whose in-place edits reach the shard.
- full_weights: full tensors assigned or loaded into a sharded module, as this rank's shards.
- sharded_class: the generated `Sharded<Class>` with a property per parameter, and its pickling.
"""
