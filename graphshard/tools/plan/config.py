"""A probe (one option set on one capture, per device and micro-batch) and the configuration
it predicts: the optimizer step, accumulation, throughput, MFU, and whether it fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from graphshard.policy import dtype_from_name
from graphshard.tools.dump.report import human_bytes  # the unit that fits, as dump prints it
from graphshard.tools.plan.space import Knobs, Layout

ADAMW_BYTES_PER_ELEMENT = 28  # fused AdamW on fp32 shards: reads p, g, m, v; writes p, m, v
# How a float8 configuration converts the model before graphshard.shard (its JSON says so).
FLOAT8_RECIPE = {
    "convert": "torchao.float8.convert_to_float8_training",
    "config": {"enable_fsdp_float8_all_gather": True},  # tensorwise scaling, torchao's default
    "module_filter": "nn.Linear whose in_features and out_features divide by 16",
}


def compute_dtype(param_dtype: str) -> str:
    """The dtype graphshard.shard's param_dtype takes for a layout's dtype (float8 layouts run
    their unconverted layers in bf16)."""
    return "bfloat16" if param_dtype == "float8" else param_dtype


@dataclass
class Probe:
    """One knob set on one capture (per device, one micro-batch step)."""

    step_s: float  # forward + backward
    model_compute_s: float  # of it, the model's own compute nodes (not graphshard's, no waits)
    flops: float  # forward + backward, on this device
    exposed_comm_s: float
    comm_bytes: float  # wire bytes this device sends
    # StepMemory's parts, extrapolated each on its own: the peak is their max, which need not
    # be linear in depth (it may move from the forward to the backward)
    forward_peak_bytes: float
    backward_peak_bytes: float
    state_bytes: float  # parameter shards, AdamW state, the batch
    gradient_bytes: float  # held between micro-batches under accumulation
    trainable_params: float  # full parameter count (for MFU)
    trainable_shard_elements: float  # this device's (for the optimizer step)
    estimates: Any = None  # {"forward", "backward": GraphEstimate}, for --trace

    @property
    def transient_bytes(self) -> float:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    def combine(self, other: "Probe", weight: float) -> "Probe":
        """self + weight * (other - self), field by field (linear extrapolation in depth)."""
        values = {f.name: getattr(self, f.name) + weight * (getattr(other, f.name) - getattr(self, f.name))
                  for f in dataclasses.fields(self) if f.name != "estimates"}
        return Probe(**values, estimates=other.estimates)


@dataclass
class Config:
    layout: Layout
    knobs: Knobs
    accumulation: int
    step_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: float
    comm_bytes: float
    exposed_comm_s: float
    fits: bool
    why: str = ""  # why it does not fit
    model_compute_s: float = 0.0  # the micro-batches' model compute nodes alone
    trainable_params: float = 0.0  # the model's, each counted once, whole
    kept_blocks: int | None = None  # "auto": blocks kept gathered
    estimates: Any = field(default=None, repr=False)

    @property
    def strategy_name(self) -> str:
        if self.knobs.keep == "all" and self.layout.strategy == "full_shard":
            return "shard_grad_op"
        return self.layout.strategy

    def mesh_shape(self, devices: int) -> list[int]:
        """Data-parallel dims ((replicate, shard) for hybrid_shard), then tp where tp > 1."""
        data_parallel, tp = devices // self.layout.tp, self.layout.tp
        shape = [data_parallel]
        if self.layout.strategy == "hybrid_shard":
            shape = [data_parallel // self.layout.shard_size, self.layout.shard_size]
        return shape + ([tp] if tp > 1 else [])

    def mesh_dim_names(self) -> list[str]:
        names = ["replicate", "shard"] if self.layout.strategy == "hybrid_shard" else ["dp"]
        return names + (["tp"] if self.layout.tp > 1 else [])

    def shard_kwargs(self, devices: int) -> dict:
        """graphshard.shard's keyword arguments, plus the mesh: build it with
        init_device_mesh(device, mesh_shape, mesh_dim_names=mesh_dim_names), apply the TP plan
        on mesh["tp"] (graphshard.parallelize) where tensor_parallel > 1, and shard over the
        other dims."""
        kwargs = {"strategy": self.strategy_name, "mesh_shape": self.mesh_shape(devices),
                  "mesh_dim_names": self.mesh_dim_names(), "tensor_parallel": self.layout.tp}
        if self.layout.param_dtype != "float32":
            kwargs |= {"param_dtype": compute_dtype(self.layout.param_dtype),
                       "reduce_dtype": "float32"}
        return kwargs

    def options(self, budget_mb: float | None) -> dict:
        if self.layout.replicated:  # nothing gathered: only the buckets to size
            return {"bucket_mb": self.knobs.bucket_mb}
        options: dict[str, Any] = {"prefetch": self.knobs.prefetch, "bucket_mb": self.knobs.bucket_mb}
        if self.knobs.keep == "all" and self.layout.strategy == "hybrid_shard":
            options["reshard_after_forward"] = False
        elif self.knobs.keep == "auto":
            options |= {"reshard_after_forward": "auto", "memory_budget_mb": budget_mb}
        return options

    def as_json(self, devices: int, budget_mb: float | None) -> dict:
        return {
            "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "peak_memory_bytes": int(self.peak_memory_bytes), "fits": self.fits, "why": self.why,
            "comm_bytes": int(self.comm_bytes), "exposed_comm_s": self.exposed_comm_s,
            "shard": self.shard_kwargs(devices), "options": self.options(budget_mb),
            **({"float8": FLOAT8_RECIPE} if self.layout.param_dtype == "float8" else {}),
            "activation_checkpointing": self.layout.ac, "micro_batch": self.layout.micro_batch,
            "accumulation_steps": self.accumulation,
            **({"kept_blocks": self.kept_blocks} if self.kept_blocks is not None else {}),
        }


def matmul_peak(layout: Layout, cluster) -> float:
    """The cluster's matmul peak for the layout's dtype (float8 layouts: the float8 peak)."""
    return cluster.peak_flops(torch.float8_e4m3fn if layout.param_dtype == "float8"
                              else dtype_from_name(layout.param_dtype))


def finish(layout: Layout, knobs: Knobs, probe: Probe, *, accumulation: int, cluster, devices: int,
           tokens: int) -> Config:
    """The configuration a probe predicts: `accumulation` micro-batch steps and one optimizer
    step, on `devices` devices training `tokens` tokens per step."""
    optimizer_s = (probe.trainable_shard_elements * ADAMW_BYTES_PER_ELEMENT / cluster.memory_bandwidth_Bps
                   + cluster.kernel_overhead_s)
    # no shorter than the model's compute (which a depth extrapolation need not respect)
    busy_s = max(probe.step_s, probe.model_compute_s)
    step = accumulation * (busy_s + cluster.step_overhead_s) + optimizer_s
    # Micro-batches after the first run with the earlier ones' gradients held.
    peak = probe.state_bytes + probe.transient_bytes + (probe.gradient_bytes if accumulation > 1 else 0)
    peak_flops = matmul_peak(layout, cluster)
    limit = cluster.device_memory_bytes
    fits = limit is None or peak <= limit
    why = "" if fits else f"needs {human_bytes(peak)} per device > {human_bytes(limit)}"
    return Config(layout, knobs, accumulation, step, tokens / step,
                  6 * probe.trainable_params * tokens / (step * devices * peak_flops), peak,
                  accumulation * probe.comm_bytes, accumulation * probe.exposed_comm_s, fits, why,
                  model_compute_s=accumulation * probe.model_compute_s,
                  trainable_params=probe.trainable_params,
                  estimates=probe.estimates)
