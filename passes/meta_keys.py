"""The keys graphshard writes into FX metadata, named once.

Node keys (`node.meta[...]`) are provenance on every node a pass inserts: later passes, the cost
model and `graphshard dump` read them instead of guessing from op patterns. Graph keys
(`gm.meta[...]`) record what has been done to a graph module.
"""

PREFIX = "graphshard_"  # every key below starts with it: a rewrite carries them all over

# node.meta
ROLE = "graphshard_role"  # "unshard" | "reduce_grad": which marker a collective implements
PARAMS = "graphshard_params"  # names of the parameters a collective (or bucket) moves
MARKER = "graphshard_marker"  # name of the marker node the lowering replaced
BUCKET = "graphshard_bucket"  # the unit a bucketed collective belongs to ("layers.3", "<other 1>")
LOWERED_FROM = "graphshard_lowered_from"  # the collective an all-to-all carries ("all_gather", ...)
GROUP_SIZE = "graphshard_group_size"  # ranks of an all-reduce's group (its args carry none)
PAYLOAD_DTYPE = "graphshard_payload_dtype"  # what a collective's bytes are (float8 sent as uint8)

# gm.meta
STAGES = "graphshard_stages"  # names of the pipeline stages run on this graph, in order
JOINT_PASSES_RUN = "graphshard_joint_passes_run"  # Inductor's joint-graph rewrites have run
