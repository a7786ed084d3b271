"""Smoke test of the benchmark harness: world size 2, a tiny model, the eager peers."""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main

METHODS = ("ddp_eager", "fsdp2_eager")


@pytest.mark.timeout(180)
def test_bench_smoke(tmp_path):
    out = tmp_path / "results.json"
    argv = ["--model", "transformer", "--model-args", "dim=32,n_layers=1", "--nproc", "2",
            "--methods", ",".join(METHODS), "--steps", "2", "--repeats", "1", "--warmup", "1",
            "--json", str(out), "--plot", str(tmp_path / "plot.png")]
    assert main(argv) == 0

    results = json.loads(out.read_text())
    assert {"config", "environment", "methods", "loss_reference", "notes"} <= set(results)
    assert {"cpu_count", "loadavg_per_repeat", "heavy_load"} <= set(results["environment"])
    assert results["loss_reference"] == "ddp_eager"
    assert list(results["methods"]) == list(METHODS)
    for name, method in results["methods"].items():
        assert method["status"] == "ok", (name, method["status"])
        assert {"median", "min", "max", "n"} <= set(method["step_ms"])
        assert method["step_ms"]["n"] == 2
        assert method["step_ms"]["min"] <= method["step_ms"]["median"] <= method["step_ms"]["max"]
        assert method["collectives_per_step"] > 0 and method["comm_mb_per_step"] > 0
        assert len(method["peak_mib_per_rank"]) == 2 and method["peak_mib"] > 0
        assert len(method["losses"]) == 3  # 1 warm-up + 2 timed steps
        assert method["loss_max_abs_diff"] <= 1e-4
        assert method["ratio_vs_ddp_eager"] > 0 and method["ratio_vs_fsdp2_eager"] > 0

    ddp, fsdp2 = results["methods"]["ddp_eager"], results["methods"]["fsdp2_eager"]
    assert max(abs(a - b) for a, b in zip(ddp["losses"], fsdp2["losses"])) <= 1e-4
    # DDP: one bucketed all-reduce for this small model; FSDP2 on 1 block + root: 3 all-gathers
    # (root, block forward, block backward) and 2 reduce-scatters (gloo runs them as all-reduce).
    assert ddp["collectives_by_kind"] == {"all_reduce": 1}
    assert fsdp2["collectives_by_kind"] == {"all_gather": 3, "all_reduce": 2}
