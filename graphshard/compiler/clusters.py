"""Cluster presets for the planner: common GPU nodes, and this machine.

Every number is a vendor peak or a published measurement (sources inline); the cost model is a
roofline and alpha-beta model on these peaks, so it predicts what the hardware allows, not
what a given software stack reaches (README, "Where the planner is wrong").
"""

from __future__ import annotations

import os

from graphshard.compiler.cost_model import ClusterSpec

GB = 1e9
GiB = 2**30

PRESETS: dict[str, ClusterSpec] = {
    # 8x H100 SXM5 80 GB per node (DGX H100 / HGX H100).
    "h100": ClusterSpec(
        # NCCL all-gather within an NVLink/NVSwitch node: ~10 us small-message latency
        # (nccl-tests all_gather_perf on DGX H100, 8 GPUs).
        latency_s=10e-6,
        # NVLink 4: 900 GB/s per GPU, both directions together (NVIDIA H100 datasheet), so
        # 450 GB/s each way; nccl-tests reports ~360 GB/s bus bandwidth for large all-gathers.
        bandwidth_Bps=360 * GB,
        # H100 SXM: 67 TFLOP/s FP32 (non-tensor), 989 TFLOP/s dense BF16 tensor core
        # (NVIDIA H100 datasheet; PyTorch's fp32 matmuls do not use TF32 by default).
        flops_per_s=67e12,
        low_precision_flops_per_s=989e12,
        float8_flops_per_s=1979e12,  # dense FP8 tensor core (datasheet: 3,958 with sparsity)
        memory_bandwidth_Bps=3.35e12,  # HBM3, 3.35 TB/s (datasheet)
        kernel_overhead_s=4e-6,  # CUDA kernel launch + dispatch, a few microseconds
        devices_per_node=8,
        # 400 Gb/s InfiniBand NDR (ConnectX-7) per GPU = 50 GB/s (DGX H100 user guide);
        # ~20 us inter-node collective latency (nccl-tests, 2+ nodes).
        inter_node_latency_s=20e-6,
        inter_node_bandwidth_Bps=50 * GB,
        device_memory_bytes=80 * GB,  # HBM3 80 GB (datasheet)
    ),
    # 8x A100 SXM4 80 GB per node (DGX A100).
    "a100": ClusterSpec(
        latency_s=10e-6,  # NVSwitch node, nccl-tests small-message all-gather
        # NVLink 3: 600 GB/s per GPU both directions (A100 datasheet): 300 GB/s each way;
        # nccl-tests ~230 GB/s bus bandwidth for large all-gathers.
        bandwidth_Bps=230 * GB,
        flops_per_s=19.5e12,  # FP32 (datasheet)
        low_precision_flops_per_s=312e12,  # dense BF16 tensor core (datasheet)
        # no float8 tensor cores (Ampere): float8 matmuls are priced at the bf16 peak
        memory_bandwidth_Bps=2.039e12,  # HBM2e, 2,039 GB/s (A100 80GB SXM datasheet)
        kernel_overhead_s=4e-6,
        devices_per_node=8,
        # 8x 200 Gb/s HDR InfiniBand per DGX A100, one per GPU = 25 GB/s (DGX A100 user guide).
        inter_node_latency_s=20e-6,
        inter_node_bandwidth_Bps=25 * GB,
        device_memory_bytes=80 * GB,
    ),
}


def local_cluster() -> ClusterSpec:
    """This machine class (gloo on the 2-core CPU box, ClusterSpec.default()), with 24 GiB."""
    import dataclasses

    return dataclasses.replace(ClusterSpec.default(), device_memory_bytes=24 * GiB)


PRESET_NAMES = (*PRESETS, "local")


def resolve_cluster(name_or_path: str) -> ClusterSpec:
    """A preset name, or a JSON file (`graphshard calibrate --out FILE`)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path == "local":
        return local_cluster()
    if os.path.isfile(name_or_path):
        return ClusterSpec.from_json(name_or_path)
    raise ValueError(f"unknown cluster {name_or_path!r}: a preset ({', '.join(PRESET_NAMES)}) or "
                     "the path of a JSON file from `graphshard calibrate --out FILE`")
