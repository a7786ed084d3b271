"""Sharding strategy and mixed-precision policy: small frozen value types, validated once."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ShardingStrategy(enum.Enum):
    FULL_SHARD = "full_shard"  # ZeRO-3
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: gathered weights kept from forward to backward
    NO_SHARD = "no_shard"  # DDP
    HYBRID_SHARD = "hybrid_shard"  # ZeRO-3 inside a group, replicated across groups

    @classmethod
    def parse(cls, value: "str | ShardingStrategy") -> "ShardingStrategy":
        if isinstance(value, cls):
            return value
        valid = [s.value for s in cls]
        if not isinstance(value, str) or value.lower() not in valid:
            raise ValueError(f"unknown sharding strategy {value!r}; valid: {', '.join(valid)}")
        return cls(value.lower())

    @property
    def reshard_after_forward(self) -> bool:
        """Whether backward gathers again (True) or reuses the forward's gathered weights."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """param_dtype: dtype of gathered parameters and compute (the cast happens before the
    all-gather, so it moves fewer bytes). reduce_dtype: dtype of gradient reduction (default:
    the gradient's dtype). Sharded parameters and optimizer state keep their own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # As FSDP2: floating-point tensors passed to the sharded model's forward are cast to
    # param_dtype, so float inputs meet parameters of the compute dtype.
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"{field} must be a floating torch.dtype or None, got {value!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(f"cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}")


# Floating dtypes by name, spelled short (bf16) or as torch does (bfloat16): command-line flags
# and JSON configurations (`graphshard plan`) name dtypes this way.
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}


def dtype_from_name(name: str) -> torch.dtype:
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"{name!r} is not a floating torch dtype; accepted: bf16 or bfloat16, "
                         "fp16 or float16, fp32 or float32")
    return getattr(torch, DTYPE_NAMES[key])


def resolve_mixed_precision(policy: MixedPrecisionPolicy | None, param_dtype, reduce_dtype
                            ) -> MixedPrecisionPolicy:
    """param_dtype / reduce_dtype: torch dtypes or their names ("bfloat16", "bf16")."""
    if policy is not None and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError("pass either mixed_precision=MixedPrecisionPolicy(...) or "
                         "param_dtype/reduce_dtype, not both")
    param_dtype, reduce_dtype = (dtype_from_name(d) if isinstance(d, str) else d
                                 for d in (param_dtype, reduce_dtype))
    return policy or MixedPrecisionPolicy(param_dtype, reduce_dtype)
