"""What `graphshard plan` prints: the ranked table, and published measurements beside the
prediction where there are some."""

from __future__ import annotations

from typing import Sequence

from graphshard.tools.plan.config import Config, human_bytes

KEEP_LABELS = {"last": "tail", "all": "all"}
DTYPE_LABELS = {"bfloat16": "bf16", "float32": "fp32", "float8": "float8"}


def budget_mb(cluster) -> float | None:
    return None if cluster.device_memory_bytes is None else cluster.device_memory_bytes / 2**20


def table(configs: Sequence[Config], devices: int, cluster, top: int) -> str:
    from tabulate import tabulate

    limit = cluster.device_memory_bytes
    rows = []
    for rank, c in enumerate(configs[:top], 1):
        keep = KEEP_LABELS.get(c.knobs.keep) or f"{c.kept_blocks} blocks"
        prefetch = c.knobs.prefetch
        if c.layout.replicated:  # every parameter whole: nothing gathered
            keep = prefetch = "-"
        rows.append([
            rank, c.strategy_name, "x".join(map(str, c.mesh_shape(devices))), c.layout.tp,
            c.layout.ac,
            DTYPE_LABELS[c.layout.param_dtype],
            f"{c.layout.micro_batch}x{c.accumulation}", keep, prefetch, f"{c.knobs.bucket_mb:g}",
            f"{c.step_s * 1e3:.1f}", f"{c.tokens_per_s / devices:,.0f}", f"{100 * c.mfu:.1f}",
            human_bytes(c.peak_memory_bytes) + (f" / {human_bytes(limit)}" if limit else ""),
            human_bytes(c.comm_bytes), f"{c.exposed_comm_s * 1e3:.1f}",
            "yes" if c.fits else f"no: {c.why}"])
    return tabulate(rows, headers=[
        "#", "strategy", "mesh", "TP", "AC", "dtype", "micro x acc", "kept gathered", "prefetch",
        "bucket MiB", "step ms", "tokens/s/dev", "MFU %", "peak / device", "comm / device",
        "exposed ms", "fits"])


# Published measurements to print beside a prediction, as a sanity check (not a tuning target).
PUBLISHED = {
    ("llama3-8b", "h100", 8): (
        "torchtitan (github.com/pytorch/torchtitan/issues/1881): Llama-3-8B, 8x H100, FSDP over 8, local "
        "batch 1, bf16: about 7,200 tokens/s per GPU at about 41 GiB"),
}


def published_figures(target: str, devices: int, cluster: str, seq: int, configs) -> list[str]:
    figure = PUBLISHED.get((target, cluster, devices))
    if figure is None:
        return []
    fsdp = [c for c in configs if c.layout.strategy == "full_shard" and c.knobs.keep == "last"
            and c.layout.tp == 1
            and c.layout.param_dtype == "bfloat16" and c.layout.micro_batch == 1]
    lines = [f"published: {figure}"]
    for c in sorted(fsdp, key=lambda c: c.layout.ac):
        lines.append(f"  predicted, full_shard bf16 local batch 1 seq {seq} AC {c.layout.ac} "
                     f"prefetch {c.knobs.prefetch} bucket {c.knobs.bucket_mb:g}: "
                     f"{c.tokens_per_s / devices:,.0f} tokens/s per GPU, "
                     f"{human_bytes(c.peak_memory_bytes)}")
    return lines
