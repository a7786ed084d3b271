"""The marker ops `graphshard::unshard`, `graphshard::reduce_grad` and `graphshard::float8_scale`,
the accumulating micro-batches' `graphshard::unshard_accumulating`, `graphshard::split_copy`,
the all-to-all transports' rank-invariant exchange ops, and the bucket packing and local sums
that ATen runs in place of a generated kernel.

Dynamo and AOTAutograd see these as opaque functional ops, one per parameter read and one per
gradient, carrying everything the lowering needs in their arguments (passes/markers.py types
them). The backend's insert_collectives pass replaces them with functional collectives; without
torch.compile their eager implementations run the very same lowering (passes/lowering.py) on real
tensors, so the eager path is the reference for the compiled one.
"""

from __future__ import annotations

import torch

from graphshard import _torch_compat as compat
from graphshard.runtime.collective_check import CheckedEagerEmitter
from graphshard.passes.lowering import lower_float8_scale, lower_reduce_grad, lower_unshard
from graphshard.passes.markers import REDUCE_SCHEMA, UNSHARD_SCHEMA, ReduceSpec, UnshardSpec


@torch.library.custom_op("graphshard::unshard", mutates_args=(), schema=UNSHARD_SCHEMA)
def unshard(shard: torch.Tensor, *args) -> torch.Tensor:
    """Full parameter from this rank's dim-0 shard (all-gather over the gather group)."""
    spec = UnshardSpec(*args)
    return lower_unshard(CheckedEagerEmitter(f"of {spec.name}"), shard, spec)


@unshard.register_fake
def _unshard_fake(shard, *args):
    spec = UnshardSpec(*args)
    shape = (spec.full_dim0, *shard.shape[1:]) if shard.dim() else ()
    return shard.new_empty(shape, dtype=spec.float8_dtype or spec.compute_dtype or shard.dtype)


@torch.library.custom_op("graphshard::float8_scale", mutates_args=(), schema=UNSHARD_SCHEMA)
def float8_scale(shard: torch.Tensor, *args) -> torch.Tensor:
    """The float8 scale of the full weight a shard belongs to (its amax, all-reduced MAX over
    the gather group): what every rank casts its shard with before the float8 gather."""
    return lower_float8_scale(CheckedEagerEmitter(f"of {UnshardSpec(*args).name}'s float8 scale"),
                              shard, UnshardSpec(*args))


@float8_scale.register_fake
def _float8_scale_fake(shard, *args):
    return shard.new_empty((), dtype=torch.float32)


@torch.library.custom_op("graphshard::reduce_grad", mutates_args=(), schema=REDUCE_SCHEMA)
def reduce_grad(grad: torch.Tensor, *args) -> torch.Tensor:
    """This rank's shard of the gradient averaged over data-parallel ranks."""
    spec = ReduceSpec(*args)
    return lower_reduce_grad(CheckedEagerEmitter(f"of {spec.name}'s gradient"), grad, spec)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, *args):
    spec = ReduceSpec(*args)
    shape = (spec.local_dim0, *grad.shape[1:]) if spec.scatter and grad.dim() else grad.shape
    return grad.new_empty(shape, dtype=spec.out_dtype)


@torch.library.custom_op("graphshard::split_copy", mutates_args=())
def split_copy(row_blocks: list[torch.Tensor], sizes: list[int],
               own_row_group: str | None = None) -> list[torch.Tensor]:
    """Contiguous copies of consecutive column slices of `sizes` of the (rows, S) matrix that
    `row_blocks` make stacked on dim 0: a bucket's copy-out in one call. Inductor runs it as is
    (FSDP2's split_with_sizes_copy), where slicing in the graph would make it generate and
    compile a kernel for every parameter: each differs in its offset into the bucket, so none
    is shared between parameters. With `own_row_group`, `row_blocks` is (the rows received from
    the peers, this rank's own row), and the own row goes in at this rank's place in that group,
    found when it runs: the graph is every rank's (an exchange that leaves the own row out)."""
    if own_row_group is not None:
        received, own = row_blocks
        rank = compat.process_group_rank(own_row_group)
        row_blocks = [block for block in (received[:rank], own, received[rank:]) if block.shape[0]]
    if len(row_blocks) == 1:
        return list(torch.split_with_sizes_copy(row_blocks[0], sizes, 1))  # contiguous copies
    outputs = _split_copy_fake(row_blocks, sizes)
    start = 0
    for block in row_blocks:
        stop = start + block.shape[0]
        torch.split_with_sizes_copy(block, sizes, 1, out=[out[start:stop] for out in outputs])
        start = stop
    return outputs


@split_copy.register_fake
def _split_copy_fake(row_blocks, sizes, own_row_group=None):
    rows = sum(block.shape[0] for block in row_blocks)
    return [row_blocks[0].new_empty((rows, size)) for size in sizes]


# The transports' and the buckets' ops run once per bucket per step: defined on a Library, not with
# custom_op, whose Python wrapper costs about 10 us a call against about 3 us.
_TRANSPORT_OPS = torch.library.Library("graphshard", "FRAGMENT")
_TRANSPORT_OPS.define("exchange_with_peers(Tensor buffer, int group_size, str group_name, "
                      "bool holds_own_chunk) -> Tensor")
_TRANSPORT_OPS.define("sum_received(Tensor received, int rows, Tensor? own_buffer, "
                      "str? group_name) -> Tensor")
_TRANSPORT_OPS.define("concat(Tensor[] pieces) -> Tensor")


def exchange_with_peers(buffer: torch.Tensor, group_size: int, group_name: str,
                        holds_own_chunk: bool) -> torch.Tensor:
    """An all-to-all that leaves this rank's own chunk out, in a graph every rank shares: the
    rank's place in the group, which decides the splits, is looked up when it runs. Returns
    the chunks received from the peers, in group order (an async functional collective: the
    graph waits on it with wait_tensor). `buffer` holds one dim-0 chunk per peer (the gather's
    copies of the shard), or, `holds_own_chunk`, one per rank at group size 2 (a reduction's
    buffer), the own chunk left out as a view.

    Inductor keeps a collective's input alive until its wait only for its own collective
    kernels; to it this op is a plain fallback. `buffer` stays alive anyway: both transports
    read the own chunk or row from it after the wait, Inductor's buffer reuse is off
    (_torch_compat.inductor_compile_graph), and free_collective_buffers frees it after its
    last reader, as a collective's."""
    send, splits = peer_exchange(buffer, group_size, holds_own_chunk,
                                 compat.process_group_rank(group_name))
    return torch.ops._c10d_functional.all_to_all_single(send, splits, splits, group_name)


def peer_exchange(buffer: torch.Tensor, group_size: int, holds_own_chunk: bool,
                  rank: int) -> tuple[torch.Tensor, list[int]]:
    """(what `exchange_with_peers` sends on `rank`, its splits: 0 for the rank itself)."""
    send, chunk = buffer, buffer.shape[0] // (group_size - 1)
    if holds_own_chunk:  # group size 2 (the fake refuses others): send the other rank's chunk
        chunk = buffer.shape[0] // 2
        send = buffer[chunk:] if rank == 0 else buffer[:chunk]
    return send, [0 if r == rank else chunk for r in range(group_size)]


def sum_received(received: torch.Tensor, rows: int, own_buffer: torch.Tensor | None,
                 group_name: str | None) -> torch.Tensor:
    """The all-to-all reduce-scatter's local sum: the `rows` chunks received, summed, plus,
    with `own_buffer` (group size 2: the exchange left the own chunk out), this rank's own chunk
    of the reduction's buffer, found at its place in the group when it runs (the graph is every
    rank's). ATen runs it: as a graph op, Inductor would generate and compile a kernel for each
    bucket size (a second or so each on CPU), for one add or sum over memory."""
    chunks = received.view(rows, -1)
    if own_buffer is None:
        return chunks.sum(0)
    own = own_buffer.view(-1, chunks.shape[1])[compat.process_group_rank(group_name)]
    return torch.add(chunks[0], own)  # one row received: the fake refuses more


def concat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat on dim 0, run by ATen, for the buckets whose packing is a plain copy: a gather's
    shards, graph inputs (passes/pack_graph_inputs.py), for which Inductor would generate and
    compile a kernel per bucket layout; and a gradient bucket all-reduced whole
    (passes/bucket_collectives.py), which Inductor would have the kernels computing the
    gradients write into, allocating the bucket with its first gradient: backward would hold it
    from there, at the activations' peak, instead of from where it is packed."""
    return torch.cat(pieces)


_TRANSPORT_OPS.impl("exchange_with_peers", exchange_with_peers, "CompositeExplicitAutograd")
_TRANSPORT_OPS.impl("sum_received", sum_received, "CompositeExplicitAutograd")
_TRANSPORT_OPS.impl("concat", concat, "CompositeExplicitAutograd")


@torch.library.register_fake("graphshard::exchange_with_peers")
def _exchange_with_peers_fake(buffer, group_size, group_name, holds_own_chunk):
    if holds_own_chunk and group_size != 2:  # refused on every rank while the graph is built
        raise ValueError(f"exchange_with_peers: a buffer that holds the own chunk needs a group "
                         f"of 2 (a middle rank's chunk is neither first nor last), got {group_size}")
    rows = buffer.shape[0] // group_size * (group_size - 1) if holds_own_chunk else buffer.shape[0]
    return buffer.new_empty((rows, *buffer.shape[1:]))


@torch.library.register_fake("graphshard::sum_received")
def _sum_received_fake(received, rows, own_buffer, group_name):
    if own_buffer is not None and rows != 1:  # refused on every rank while the graph is built
        raise ValueError(f"sum_received: the own chunk is added to one received row, got {rows}")
    return received.new_empty((received.numel() // rows,))


@torch.library.register_fake("graphshard::concat")
def _concat_fake(pieces):
    return torch.cat(pieces)


def call_unshard(shard: torch.Tensor, spec: UnshardSpec) -> torch.Tensor:
    return torch.ops.graphshard.unshard(shard, *spec.args_at_read())


def call_unshard_accumulating(shard: torch.Tensor, leaf: torch.Tensor, spec: UnshardSpec, *,
                              shard_group_only: bool) -> torch.Tensor:
    return torch.ops.graphshard.unshard_accumulating(shard, leaf, shard_group_only,
                                                     *spec.args_at_read())


def call_float8_scale(shard: torch.Tensor, spec: UnshardSpec) -> torch.Tensor:
    return torch.ops.graphshard.float8_scale(shard, *spec.as_args())


def call_reduce_grad(grad: torch.Tensor, spec: ReduceSpec) -> torch.Tensor:
    return torch.ops.graphshard.reduce_grad(grad, *spec.as_args())


def _unshard_setup_context(ctx, inputs, output):
    shard, *args = inputs
    ctx.reduce = UnshardSpec(*args).reduce_spec(shard.shape[0] if shard.dim() else 0, shard.dtype)


def _unshard_backward(ctx, grad):
    return (call_reduce_grad(grad, ctx.reduce),) + (None,) * (len(UnshardSpec.__dataclass_fields__))


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# --------------------------------------------------------------------------- accumulating reads
#
# A parameter read in an accumulating micro-batch (graphshard/grad_sync.py): its forward is the
# ordinary unshard marker; its backward hands the gradient to the accumulation leaf instead of
# the shard, unreduced or reduced within the shard group only. An op in the model's graph, not
# an autograd.Function: AOTAutograd's cache keys ops but refuses custom autograd.Functions, and
# a graph it cannot store is compiled by every rank (no compile per host, none on restart).
# Dynamo records the op; its Autograd kernel applies `_GatherIntoLeaf`, which AOTAutograd traces
# into the ordinary marker and, in backward, the cast or the shard group's reduction.
_ACCUMULATING_OPS = torch.library.Library("graphshard", "FRAGMENT")
_ACCUMULATING_OPS.define("unshard_accumulating" + UNSHARD_SCHEMA.replace(
    "(Tensor shard, ", "(Tensor shard, Tensor leaf, bool shard_group_only, ", 1))


class _GatherIntoLeaf(torch.autograd.Function):
    """Gather; backward: the gradient into the accumulation leaf (see the comment above)."""

    @staticmethod
    def forward(ctx, shard, leaf, shard_group_only, args):
        spec = UnshardSpec(*args)
        ctx.leaf_dtype = leaf.dtype
        ctx.reduce = (spec.reduce_spec(shard.shape[0] if shard.dim() else 0, leaf.dtype,
                                       shard_group_only=True) if shard_group_only else None)
        return torch.ops.graphshard.unshard(shard, *args)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce is None:  # no_sync: the full gradient, summed unreduced in the leaf
            return None, grad.to(ctx.leaf_dtype), None, None
        return None, call_reduce_grad(grad, ctx.reduce), None, None


def _unshard_accumulating_autograd(shard, leaf, shard_group_only, *args):
    return _GatherIntoLeaf.apply(shard, leaf, shard_group_only, args)


def _unshard_accumulating_below_autograd(shard, leaf, shard_group_only, *args):
    return torch.ops.graphshard.unshard(shard, *args)


_ACCUMULATING_OPS.impl("unshard_accumulating", _unshard_accumulating_autograd, "Autograd")
_ACCUMULATING_OPS.impl("unshard_accumulating", _unshard_accumulating_below_autograd,
                       "CompositeExplicitAutograd")


@torch.library.register_fake("graphshard::unshard_accumulating")
def _unshard_accumulating_fake(shard, leaf, shard_group_only, *args):
    return _unshard_fake(shard, *args)
