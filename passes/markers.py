"""The marker ops' arguments, typed: one description per op, used wherever a marker is built or read.

`graphshard::unshard(shard, *UnshardSpec.as_args())` marks a parameter read;
`graphshard::reduce_grad(grad, *ReduceSpec.as_args())` marks where a gradient is reduced;
`graphshard::float8_scale(shard, *UnshardSpec.as_args())` marks the float8 scale of a weight
gathered in float8 (from the amax of the whole weight).
The schemas in graphshard/compiler/ops.py list the same fields in the same order: a field added here is
added there, and nothing else reads a marker's arguments by position.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.fx as fx

UNSHARD_SCHEMA = (
    "(Tensor shard, SymInt full_dim0, str gather_group, int gather_size, "
    "ScalarType? compute_dtype, bool reshard_after_forward, str[] reduce_groups, "
    "int[] reduce_sizes, bool scatter, ScalarType? reduce_dtype, str name, int order, int model, "
    "str backend, bool grad_enabled, ScalarType? float8_dtype) -> Tensor"
)
REDUCE_SCHEMA = (
    "(Tensor grad, SymInt local_dim0, str[] group_names, int[] group_sizes, bool scatter, "
    "ScalarType? reduce_dtype, ScalarType out_dtype, str name) -> Tensor"
)


def dim0_chunk(full_dim0: int, group_size: int) -> int:
    """Rows per rank under torch.chunk semantics (what DTensor Shard(0) uses)."""
    return -(-full_dim0 // group_size) if full_dim0 else 0


def _as_args(spec) -> tuple:
    # Computed once per spec (specs are built at shard() time): parameter reads trace this.
    return tuple(list(v) if isinstance(v, tuple) else v
                 for v in (getattr(spec, f.name) for f in fields(spec)))


def _from_arg(value):
    return tuple(value) if isinstance(value, list) else value


class _MarkerArgs:
    """A marker's arguments after its tensor, in schema order."""

    def __post_init__(self):
        object.__setattr__(self, "_args", _as_args(self))

    def as_args(self) -> tuple:
        return self._args

    @classmethod
    def from_node(cls, node: fx.Node):
        return cls(*(_from_arg(a) for a in node.args[1:]))


@dataclass(frozen=True)
class UnshardSpec(_MarkerArgs):
    """Everything the lowering needs about one parameter, fixed at shard() time."""

    full_dim0: int
    gather_group: str  # "" when the parameter is not sharded (the gather is a copy)
    gather_size: int
    compute_dtype: torch.dtype | None  # cast before the gather (mixed precision)
    reshard_after_forward: bool  # full_shard: gather again in backward; else keep from forward
    reduce_groups: tuple[str, ...]  # shard group first, then replica groups
    reduce_sizes: tuple[int, ...]
    scatter: bool  # reduce-scatter on the first reduce group (else all-reduce)
    reduce_dtype: torch.dtype | None
    name: str  # fully qualified name of the parameter's first registration
    order: int  # registration index in the model: bucketing packs parameters in this order
    # the sharded model's index among those shard() made in this process, in program order
    # (alike on every rank): decisions agreed across ranks are keyed per model
    model: int
    backend: str  # the process group's backend ("gloo", "nccl", "fake"): the transport depends on it
    grad_enabled: bool  # grad mode at the read: a no_grad read never stands in for one needing grad
    float8_dtype: torch.dtype | None = None  # gathered in this float8 dtype (graphshard/float8.py)

    def __post_init__(self):
        super().__post_init__()
        at = [f.name for f in fields(self)].index("grad_enabled")
        object.__setattr__(self, "_args_by_grad_mode", {
            mode: self._args[:at] + (mode,) + self._args[at + 1:] for mode in (False, True)})

    def args_at_read(self) -> tuple:
        """as_args() with the grad mode of this read (Dynamo traces the mode as a constant)."""
        return self._args_by_grad_mode[torch.is_grad_enabled()]

    @property
    def graph_rows(self) -> int | None:
        """Rows of the shard a compiled graph reads: every rank's shard padded to the largest
        (torch.chunk's first), so uneven shards give every rank one graph; None where the
        parameter is not cut along dim 0."""
        if not self.scatter or self.gather_size == 1:
            return None
        return dim0_chunk(self.full_dim0, self.gather_size)

    def reduce_spec(self, local_dim0: int, out_dtype: torch.dtype, *,
                    shard_group_only: bool = False) -> "ReduceSpec":
        """The reduction of this parameter's gradient (the unshard's backward); with
        `shard_group_only`, within the shard group alone (hybrid_shard's accumulating
        micro-batches skip the replica groups)."""
        groups = slice(0, 1) if shard_group_only else slice(None)
        return ReduceSpec(local_dim0, tuple(self.reduce_groups[groups]),
                          tuple(self.reduce_sizes[groups]), self.scatter, self.reduce_dtype,
                          out_dtype, self.name)


@dataclass(frozen=True)
class ReduceSpec(_MarkerArgs):
    local_dim0: int  # rows of this rank's shard (the reduce-scatter's output)
    group_names: tuple[str, ...]
    group_sizes: tuple[int, ...]
    scatter: bool
    reduce_dtype: torch.dtype | None
    out_dtype: torch.dtype  # the sharded parameter's dtype
    name: str


assert [f.name for f in fields(UnshardSpec)] == [
    a.split()[-1] for a in UNSHARD_SCHEMA.split(")")[0][1:].split(", ")[1:]]
assert [f.name for f in fields(ReduceSpec)] == [
    a.split()[-1] for a in REDUCE_SCHEMA.split(")")[0][1:].split(", ")[1:]]
