"""Textbook per-step communication volume of each data-parallel strategy, as numbers or as
formulas in the world size: what `graphshard dump` sets beside the graph it measured."""

from __future__ import annotations

import sympy

from graphshard.compiler.cost_model import Sym, as_number_if_constant, check_world_size

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def theoretical_comm_bytes(strategy: str, param_bytes: Sym, world_size: Sym, *,
                           trainable_bytes: Sym | None = None,
                           shard_size: Sym | None = None) -> dict[str, Sym]:
    """Bytes each rank sends per training step under a data-parallel strategy.

    full_shard: all-gather params twice (forward, and backward recompute), reduce-scatter
    grads once; shard_grad_op: gather once; no_shard: all-reduce grads; hybrid_shard: FSDP
    inside shard groups of `shard_size`, all-reduce of the grad shards across the
    world_size/shard_size replicas. Gathers move all params; reductions only the trainable
    ones (`trainable_bytes`, default all). Numbers give floats; sympy symbols give formulas.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    check_world_size(world_size)
    p = sympy.sympify(param_bytes)
    t = p if trainable_bytes is None else sympy.sympify(trainable_bytes)
    n = sympy.sympify(world_size)
    ag = rs = ar = sympy.Integer(0)
    if strategy == "full_shard":
        ag, rs = 2 * p * (n - 1) / n, t * (n - 1) / n
    elif strategy == "shard_grad_op":
        ag, rs = p * (n - 1) / n, t * (n - 1) / n
    elif strategy == "no_shard":
        ar = 2 * t * (n - 1) / n
    else:
        if shard_size is None:
            raise ValueError("hybrid_shard needs shard_size (the size of each shard group)")
        s = sympy.sympify(shard_size)
        if s.is_number and n.is_number and (s < 1 or n % s != 0):
            raise ValueError(f"shard_size {shard_size} must be >= 1 and divide "
                             f"world_size {world_size}")
        r = n / s
        ag, rs, ar = 2 * p * (s - 1) / s, t * (s - 1) / s, 2 * (r - 1) / r * t / s
    out = {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar, "total": ag + rs + ar}
    return {k: as_number_if_constant(sympy.simplify(v)) for k, v in out.items()}
