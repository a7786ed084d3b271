"""Smoke test of the benchmark harness: world size 2, a tiny model, the eager peers; and its
collective counter on graphshard's step."""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
from dataclasses import asdict

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from graphshard.bench.__main__ import main
from graphshard.bench.harness import BenchConfig, RankResult, set_up
from graphshard.bench.measure import (analyze, count_frees_on_every_thread, measured_step,
                                      memory_profile)
from graphshard.bench.workload import build_workload, transformer_blocks
from graphshard.tools.launch import run_local

METHODS = ("ddp_eager", "fsdp2_eager")
MODEL_ARGS = {"dim": 32, "n_layers": 1}
# The end-to-end runs compile into the suite's Inductor cache (kernels and host probes other
# tests built), not each into a fresh one: no test here reads a cold first step.
SUITE_CACHE = ("--inductor-cache", os.environ["TORCHINDUCTOR_CACHE_DIR"])


@pytest.mark.slow  # the bench end to end
@pytest.mark.timeout(180)
def test_bench_smoke(tmp_path):
    out = tmp_path / "results.json"
    model_args = ",".join(f"{k}={v}" for k, v in MODEL_ARGS.items())
    argv = ["--model", "transformer", "--model-args", model_args, "--nproc", "2",
            "--methods", ",".join(METHODS), "--steps", "2", "--repeats", "1", "--warmup", "1",
            *SUITE_CACHE, "--json", str(out), "--plot", str(tmp_path / "plot.png")]
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
        assert len(method["repeat_median_ms"]) == 1
        paired = method["repeat_ratios_vs_fsdp2_eager"]
        assert paired["min"] == paired["median"] == paired["max"] > 0  # one repeat: one ratio

    ddp, fsdp2 = results["methods"]["ddp_eager"], results["methods"]["fsdp2_eager"]
    assert max(abs(a - b) for a, b in zip(ddp["losses"], fsdp2["losses"])) <= 1e-4
    # DDP: one bucketed all-reduce for this small model; FSDP2 on 1 block + root: 3 all-gathers
    # (root, block forward, block backward) and 2 reduce-scatters (gloo runs them as all-reduce).
    assert ddp["collectives_by_kind"] == {"all_reduce": 1}
    assert fsdp2["collectives_by_kind"] == {"all_gather": 3, "all_reduce": 2}


def test_ratio_per_repeat_pairs_the_methods_timed_back_to_back():
    """Each repeat times every method back to back: the ratio of their medians within a repeat
    (its median, min and max over repeats) is the spread the machine's drift leaves."""
    from graphshard.bench.report import summarize

    cfg = BenchConfig(methods=("ddp_eager", "fsdp2_eager"), steps=2, repeats=3)
    rank = RankResult(status={"ddp_eager": "ok", "fsdp2_eager": "ok"},
                      step_s={"ddp_eager": [1.0, 1.0, 3.0, 3.0, 2.0, 2.0],
                              "fsdp2_eager": [2.0, 2.0, 4.0, 4.0, 8.0, 8.0]},
                      losses={"ddp_eager": [1.0], "fsdp2_eager": [1.0]})
    ddp = summarize(cfg, [rank, rank], [RankResult(), RankResult()])["methods"]["ddp_eager"]
    assert ddp["repeat_median_ms"] == [1000.0, 3000.0, 2000.0]
    assert ddp["repeat_ratios_vs_fsdp2_eager"] == {"median": 0.5, "min": 0.25, "max": 0.75}
    assert ddp["ratio_vs_fsdp2_eager"] == 0.5  # overall medians: 2 s against 4 s


def test_heavy_load_is_what_other_processes_used_beside_the_ranks():
    """Two ranks keeping 2 CPUs busy are the bench, not load; CPU that the machine used beyond
    the ranks' own, or that the hypervisor stole, is."""
    from graphshard.bench.harness import CpuSample
    from graphshard.bench.report import summarize

    cfg = BenchConfig(methods=("ddp_eager",), steps=2, repeats=2)

    def ranks(machine_busy: list[float], steal: list[float], own: float = 9.5) -> list[RankResult]:
        return [RankResult(status={"ddp_eager": "ok"}, step_s={"ddp_eager": [1.0] * 4},
                           losses={"ddp_eager": [1.0]},
                           cpu=[CpuSample(10.0, own, busy, stolen)
                                for busy, stolen in zip(machine_busy, steal)])
                for _ in range(2)]

    def environment(rank_results):
        return summarize(cfg, rank_results, [RankResult()] * 2)

    busy = environment(ranks([19.0, 20.0], [0.0, 0.0]))
    assert busy["environment"]["heavy_load"] is False, busy["notes"]
    assert busy["environment"]["other_cpu_share_per_repeat"] == [0.0, 0.05]
    loaded = environment(ranks([19.0, 20.0], [0.0, 4.0]))  # 20% of 2 CPUs x 10 s stolen
    assert loaded["environment"]["heavy_load"] is True
    assert any("stolen 20%" in note for note in loaded["notes"]), loaded["notes"]
    shared = environment(ranks([20.0, 20.0], [0.0, 0.0], own=5.0))  # the ranks used half of it
    assert shared["environment"]["other_cpu_share_per_repeat"] == [0.5, 0.5]
    assert shared["environment"]["heavy_load"] is True


def _fake_spawn(failures: list[str | None]):
    """mp.spawn stand-in: raises for each entry of `failures` (a signal name, or None for a
    plain non-zero exit), then writes one empty result per rank."""
    calls = []

    def spawn(fn, args, nprocs, join):
        calls.append(args)
        if len(calls) <= len(failures):
            signal = failures[len(calls) - 1]
            raise torch.multiprocessing.ProcessExitedException(
                "rank died", 0, 1234, -11 if signal else 1, signal)
        with open(args[-1], "w") as f:
            json.dump([asdict(RankResult())] * nprocs, f)

    return spawn, calls


def test_a_phase_whose_rank_a_signal_kills_runs_once_more(tmp_path, monkeypatch):
    import graphshard.bench.harness as harness

    spawn, calls = _fake_spawn(["SIGSEGV"])
    monkeypatch.setattr(harness.mp, "spawn", spawn)
    assert len(harness.launch(BenchConfig(), "profile", str(tmp_path))) == 2
    assert len(calls) == 2

    spawn, calls = _fake_spawn(["SIGSEGV", "SIGSEGV"])  # twice: a real fault, reported
    monkeypatch.setattr(harness.mp, "spawn", spawn)
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        harness.launch(BenchConfig(), "profile", str(tmp_path))
    assert len(calls) == 2

    spawn, calls = _fake_spawn([None])  # a rank that exited with an error: not run again
    monkeypatch.setattr(harness.mp, "spawn", spawn)
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        harness.launch(BenchConfig(), "timing", str(tmp_path))
    assert len(calls) == 1


# graphshard without Inductor (the same collectives, a much cheaper compile); its all-gathers
# native, so the gloo counter tells them from its reductions (which run as all-to-all on gloo).
GRAPHSHARD = "graphshard:compiler=eager+all_gather=native"


def _profiled_graphshard_step(rank: int, world: int) -> dict:
    """The bench's profile phase for one method, without the harness's timing launch (whose
    Inductor warm-up a method without Inductor does not need): set up, two steps, one measured."""
    cfg = BenchConfig(model_args=tuple(MODEL_ARGS.items()), nproc=world, methods=(GRAPHSHARD,))
    workload = build_workload(cfg.model, cfg.batch, cfg.seq, cfg.seed, MODEL_ARGS)
    inputs = workload.local_inputs(rank, world)
    with memory_profile() as prof:
        step = set_up(GRAPHSHARD, cfg, workload, init_device_mesh("cpu", (world,)), inputs)
        step(), step()
        with measured_step():
            step()
    predicted = step.module.graphshard_compiler.predicted_peak_bytes
    return asdict(analyze(prof, world)) | {"predicted_peak_bytes": predicted}


@pytest.mark.slow
def test_collectives_counted_per_step_for_graphshard_match_its_units():
    model = build_workload("transformer", 8, 32, 0, MODEL_ARGS).model
    # One unit per block, plus the embeddings before and norm + head after. Per step: a gather
    # per unit in forward, and in backward per unit but the embeddings (an embedding's gradient
    # needs no weight) and the tail forward kept (the last block, norm + head); one reduction
    # per unit, carrying every gradient once (fp32, no padding at dim 32 over 2 ranks).
    units = len(transformer_blocks(model)) + 2
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    for profile in run_local(_profiled_graphshard_step, 2):
        assert profile["collectives"] == {"all_gather": units + units - 3, "all_to_all": units}
        assert profile["comm_bytes"]["all_to_all"] == param_bytes
        # The compiler records its predicted peak for the bench to print beside the measured
        # one (how close they are at realistic sizes, under Inductor: the fidelity bench).
        assert 0 < profile["predicted_peak_bytes"] < 2 * profile["peak_bytes"]
        # The step's time by phase: each phase inside the step, the graphs' waits inside them.
        phases = profile["breakdown_ms"]
        assert all(phases[p] > 0 for p in ("forward", "backward", "optimizer", "wait"))
        assert phases["forward"] + phases["backward"] + phases["optimizer"] <= phases["step"]
        assert phases["wait"] <= phases["forward"] + phases["backward"]
        # ... and across them, on the main thread: the graphs' kernels, their collective calls
        # and bucket copy-outs (a unit's parameters gathered in one bucket), the host's work
        in_graphs = phases["kernels"] + phases["issue"] + phases["copy_out"] + phases["wait"]
        assert all(phases[p] > 0 for p in ("kernels", "issue", "copy_out", "host"))
        assert in_graphs + phases["host"] + phases["optimizer"] == pytest.approx(phases["step"])


def test_the_limit_breakdown_splits_the_time_above_compute_only():
    from graphshard.bench.report import format_limit, limit_breakdown

    def entry(step_ms, **parts):
        return {"status": "ok", "step_ms": {"median": step_ms}, "breakdown_ms": parts}

    summary = {"methods": {
        "compute_only": entry(60.0, step=62.0, kernels=50.0, optimizer=3.0, host=9.0),
        "collectives_only": entry(17.0, step=20.0),
        "graphshard": entry(90.0, step=95.0, kernels=55.0, wait=10.0, issue=2.0, copy_out=3.0,
                            optimizer=4.0, host=11.0),
    }}
    assert limit_breakdown(summary, "graphshard") == pytest.approx({
        "step_ms": 90.0, "compute_only_ms": 60.0, "collectives_only_ms": 17.0,
        "above_ms": 30.0, "profiled_above_ms": 33.0, "exposed_comm_ms": 12.0, "copy_out_ms": 3.0,
        "slower_kernels_ms": 5.0, "optimizer_ms": 1.0, "host_ms": 2.0})
    assert "graphshard" in format_limit(summary) and "33.0" in format_limit(summary)
    del summary["methods"]["compute_only"]
    assert limit_breakdown(summary, "graphshard") is None and format_limit(summary) == ""


def test_peak_memory_sees_frees_made_on_other_threads():
    """A known pattern: 4 MiB held entering the step and freed on another thread (as gloo's
    threads free collective buffers), then 4 + 2 MiB allocated: the peak is 6 MiB, not the 10
    MiB a count that misses the free would report."""
    count_frees_on_every_thread()
    mib = 2**20
    held = {}
    with memory_profile() as prof:
        held["a"] = torch.empty(4 * mib, dtype=torch.uint8)
        with measured_step():
            thread = threading.Thread(target=held.pop, args=("a",))
            thread.start()
            thread.join()
            b = torch.empty(4 * mib, dtype=torch.uint8)
            c = torch.empty(2 * mib, dtype=torch.uint8)
            del b, c
    assert analyze(prof, world_size=1).peak_bytes == 6 * mib


def test_a_graphshard_variant_sets_strategy_dtype_checkpointing_and_options(fake_pg):
    """`graphshard:KEY=VALUE+...` (what the fidelity bench runs): shard() arguments, activation
    checkpointing and backend options each reach the model."""
    from graphshard.bench.methods import method
    from graphshard.state import shard_state

    variant = method("graphshard:strategy=shard_grad_op+ac=full+param_dtype=bfloat16"
                     "+reduce_dtype=float32+prefetch=2+bucket_mb=25")
    workload = build_workload("transformer", 2, 8, 0, {"dim": 32, "n_layers": 2})
    compiled = variant.setup(workload.model, init_device_mesh("cpu", (8,)))
    state = shard_state(workload.model)
    assert state.strategy.value == "shard_grad_op"
    assert state.mixed_precision.param_dtype == torch.bfloat16
    assert all(isinstance(block.forward, __import__("functools").partial)
               for block in transformer_blocks(workload.model))  # checkpointed
    assert "'prefetch': 2" in variant.description and "'bucket_mb': 25.0" in variant.description
    assert compiled is not workload.model  # torch.compile's wrapper
    assert not variant.tensor_parallel
    # tp=true: trained on the (dp, tp) mesh, the model's TP plan first (the fidelity's TP rows)
    assert method("graphshard:tp=true+prefetch=2").tensor_parallel
    with pytest.raises(ValueError, match="prefetch"):
        method("graphshard:prefetch=soon")


def test_the_fidelity_bench_compiles_with_the_cluster_the_planner_priced(tmp_path):
    """The scheduler orders collectives by the cost model: the measured configuration compiles
    with the calibration the prediction used, so both see one schedule."""
    from graphshard.bench.methods import method
    from graphshard.bench.plan_fidelity import CASES
    from graphshard.compiler.cost_model import ClusterSpec

    cluster = tmp_path / "machine.json"
    ClusterSpec.default().to_json(cluster)
    name = CASES[0].method(str(cluster))
    assert name.endswith(f"+cluster={cluster}")
    assert f"'cluster': '{cluster}'" in method(name).description
    assert "cluster=" not in CASES[0].method()  # a preset: the built-in model


def test_the_fidelity_bench_reads_the_machines_speed_against_its_calibration(monkeypatch):
    """The calibration's own fp32 matmul probe, at a rank's share of the cores, over the
    calibration's rate; the process's thread count is left as it was."""
    import dataclasses

    import torch

    from graphshard.bench import plan_fidelity
    from graphshard.compiler.cost_model import ClusterSpec
    from graphshard.tools import calibrate

    seen = []

    def rate(dtype, repeats):
        seen.append((dtype, torch.get_num_threads()))
        return 6e10

    monkeypatch.setattr(calibrate, "matmul_rate", rate)
    cluster = dataclasses.replace(ClusterSpec.default(), flops_per_s=8e10,
                                  compute_slots_per_node=os.cpu_count() or 1)
    threads = torch.get_num_threads()
    assert plan_fidelity.machine_speed(cluster) == pytest.approx(0.75)
    assert seen == [(torch.float32, 1)] and torch.get_num_threads() == threads


def test_the_fidelity_bench_runs_every_group_once_a_round_and_keeps_each_configurations_median(
        monkeypatch):
    """Rounds run every (model, world size, TP) group once, each round starting one group later,
    all compiling into one cache directory (removed at the end); a configuration's step and peak
    are the medians over its rounds; the machine's speed is read before the rounds and after
    each, never during a launch."""
    from graphshard.bench import harness, plan_fidelity, report
    from graphshard.bench.plan_fidelity import Case

    launches = []

    def fake_run(cfg, cache_dir=None):
        launches.append(((cfg.model, cfg.nproc, cfg.tp), cache_dir))
        return [], [len(launches)]

    def fake_summarize(cfg, _timing, profile):
        n = profile[0]  # the launch's position in the run: every launch measures differently
        return {"methods": {name: {"status": "ok", "profile_status": "ok",
                                   "step_ms": {"median": 100.0 * n}, "peak_mib": float(n)}
                            for name in cfg.methods}}

    monkeypatch.setattr(harness, "run", fake_run)
    monkeypatch.setattr(report, "summarize", fake_summarize)
    cases = [Case("transformer", 2, 8), Case("transformer", 2, 8, keep="all"),
             Case("llama", 2, 8), Case("llama", 3, 6)]
    speeds = []
    measured = plan_fidelity.measure(cases, steps=2, repeats=1, warmup=1, rounds=3,
                                     speed=lambda: float(len(launches)), speeds=speeds)

    t2, l2, l3 = ("transformer", 2, 1), ("llama", 2, 1), ("llama", 3, 1)
    assert [group for group, _ in launches] == [t2, l2, l3, l2, l3, t2, l3, t2, l2]
    assert speeds == [0.0, 3.0, 6.0, 9.0]  # the machine's speed before the rounds and after each
    cache_dirs = {cache_dir for _, cache_dir in launches}
    assert len(cache_dirs) == 1 and None not in cache_dirs
    assert not os.path.exists(cache_dirs.pop())
    # transformer ws2 ran as launches 1, 6 and 8: the median of 100, 600 and 800 ms is 600 ms
    assert measured[cases[0]] == measured[cases[1]] == {"step_s": 0.6, "peak_bytes": 6 * 2**20}
    assert measured[cases[2]]["step_s"] == 0.4 and measured[cases[3]]["step_s"] == 0.5


def test_a_bench_run_given_a_cache_directory_compiles_into_it_and_keeps_it(monkeypatch, tmp_path):
    from graphshard.bench import harness

    seen = []
    monkeypatch.setattr(harness, "launch", lambda cfg, phase, workdir: seen.append(
        (phase, os.environ["TORCHINDUCTOR_CACHE_DIR"])) or [])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "the caller's")
    cache = tmp_path / "shared"
    cache.mkdir()
    harness.run(BenchConfig(), cache_dir=str(cache))
    harness.run(BenchConfig())
    assert seen[:2] == [("timing", str(cache)), ("profile", str(cache))] and cache.is_dir()
    fresh = seen[2][1]
    assert seen[3][1] == fresh and fresh not in (str(cache), "the caller's")
    assert not os.path.exists(fresh)  # a fresh one is removed with the run
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "the caller's"


def test_bench_and_the_tools_share_one_workload_and_one_model_args_parser(capsys):
    """The bench parses --model-args as dump and plan do and trains the library's Workload;
    a malformed pair is refused with the same message."""
    from graphshard.tools.arguments import parse_model_args
    from graphshard.tools.dump.loading import Workload as DumpWorkload
    from graphshard.tools.workload import Workload

    assert parse_model_args("dim=32, name=gpt2,tied=True,") == (
        ("dim", 32), ("name", "gpt2"), ("tied", True))
    workload = build_workload("transformer", 4, 8, 0, MODEL_ARGS)
    assert isinstance(workload, Workload) and Workload is DumpWorkload
    assert [t.shape[0] for t in workload.local_inputs(1, 2)] == [2]
    assert workload.run(workload.model).shape[:2] == (4, 8)
    with pytest.raises(SystemExit):
        main(["--model-args", "dim"])
    assert "argument --model-args: expected KEY=VALUE, got 'dim'" in capsys.readouterr().err


# --------------------------------------------------------------------------- torchtitan's SimpleFSDP

from graphshard.bench import torchtitan_simple_fsdp as titan  # noqa: E402


def _torchtitan_or_skip():
    try:
        titan.torchtitan_modules()
    except titan.TorchtitanUnavailable as exc:
        pytest.skip(str(exc))


def test_simplefsdp_is_unavailable_without_torchtitan(monkeypatch):
    """Without the package the method says how to install it (no-deps) and the bench goes on."""
    import sys

    from graphshard.bench.methods import MethodUnavailable, method

    for name in ("torchtitan.experiments.graph_trainer.simple_fsdp",
                 "torchtitan.experiments.graph_trainer.jit_backend"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(titan.importlib.util, "find_spec", lambda name: None)
    workload = build_workload("transformer", 2, 8, 0, MODEL_ARGS)
    with pytest.raises(MethodUnavailable, match="--no-deps torchtitan==0.3.0"):
        method("simplefsdp_full").setup(workload.model, None)


def test_simplefsdp_bucket_plan_is_torchtitans_embeddings_tail_and_blocks():
    model = build_workload("transformer", 2, 8, 0, {"dim": 32, "n_layers": 2}).model
    assert titan.bucket_plan(titan.GlobalTokenLoss(model, 2)) == [
        ["model.tok_embeddings", "model.pos_embeddings"], ["model.norm", "model.output"],
        "model.layers.0", "model.layers.1"]


def test_simplefsdp_compile_options_are_torchtitans_and_leave_the_global_config_alone():
    """torchtitan's JIT recipe sets Inductor's global config; the bench hands the changes to
    the method's own compile and puts the global config back."""
    _torchtitan_or_skip()
    model = build_workload("transformer", 2, 8, 0, MODEL_ARGS).model
    manual = titan.compile_options(model, "transformer_block_bucketing")
    auto = titan.compile_options(model, "auto_bucketing")
    # Had the first call's changes stayed global, the same call again would change nothing.
    assert titan.compile_options(model, "transformer_block_bucketing").keys() == manual.keys()
    assert callable(manual["post_grad_custom_post_pass"]) and manual["allow_buffer_reuse"] is False
    assert auto["aten_distributed_optimizations.collective_bucketing"] is True
    assert titan.compile_options(model, "none") == {"reorder_for_peak_memory": False}
    with pytest.raises(ValueError, match="valid: transformer_block_bucketing"):
        titan.compile_options(model, "bucket_everything")


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_simplefsdp_shards_keeps_ties_and_each_setup_gets_its_own_mesh(fake_pg):
    """torchtitan's data_parallel on the bench's mesh: every parameter a DTensor, the tied
    embedding/output weight one parameter, and a hybrid_shard set up after a fully_shard in the
    same process gathers over its own 2-D mesh (not the first call's)."""
    from torch.distributed.tensor import DTensor

    _torchtitan_or_skip()
    mesh = init_device_mesh("cpu", (4,))
    tied = MODEL_ARGS | {"weight_tying": True}
    full = titan.data_parallel(build_workload("transformer", 2, 8, 0, tied).model, mesh,
                               "fully_shard")
    hybrid = titan.data_parallel(build_workload("transformer", 2, 8, 0, tied).model, mesh,
                                 "hybrid_shard")
    for model, placements in ((full, "(Shard(dim=0),)"), (hybrid, "(Replicate(), Shard(dim=0))")):
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"]
        assert str(model.output._parameters["weight"].placements) == placements
    assert type(full.layers[0]) is not type(hybrid.layers[0])
    assert hybrid.layers[0].attention.wq.weight.shape == (32, 32)  # gathered for compute
    with pytest.raises(ValueError, match="valid: fully_shard, hybrid_shard"):
        titan.data_parallel(full, mesh, "replicate")


def test_simplefsdp_scales_the_output_gradient_by_the_world_size():
    """Partial('sum') gradients over a per-rank mean loss: 1 / world size makes them DDP's."""
    x = torch.ones(3, requires_grad=True)
    titan.GlobalTokenLoss(torch.nn.Identity(), 4)(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 0.25))


COMPILED_PEERS = ("ddp_eager", "ddp_compile", "fsdp2_compile", "simplefsdp_full",
                  "simplefsdp_hybrid")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.slow
def test_bench_runs_the_compiled_peers_and_they_train_as_ddp(tmp_path):
    """DDP and FSDP2 compiled and torchtitan's SimpleFSDP (both modes) run in one bench launch,
    their losses DDP's; SimpleFSDP's all-gathers unbucketed (torchtitan's passes need Triton)."""
    _torchtitan_or_skip()
    out = tmp_path / "results.json"
    model_args = ",".join(f"{k}={v}" for k, v in MODEL_ARGS.items())
    assert main(["--model", "transformer", "--model-args", model_args, "--nproc", "2",
                 "--methods", ",".join(COMPILED_PEERS), "--steps", "2", "--repeats", "1",
                 "--warmup", "1", *SUITE_CACHE, "--json", str(out)]) == 0
    methods = json.loads(out.read_text())["methods"]
    for name in COMPILED_PEERS:
        assert methods[name]["status"] == "ok", (name, methods[name]["status"])
        assert methods[name]["loss_max_abs_diff"] <= 1e-4, name
    params = len(list(build_workload("transformer", 8, 32, 0, MODEL_ARGS).model.parameters()))
    full = methods["simplefsdp_full"]["collectives_by_kind"]
    assert full["all_gather"] >= params  # one per parameter, at least once
    assert "all_gather" not in methods["simplefsdp_hybrid"]["collectives_by_kind"]


def _profiled_replay(rank: int, world: int) -> tuple[dict, dict]:
    """graphshard's real step and its collectives replayed alone, each profiled like the bench."""
    from graphshard.bench.collectives_only import CollectivesOnly
    from graphshard.bench.harness import make_optimizer, make_train_step

    cfg = BenchConfig(model_args=tuple(MODEL_ARGS.items()), nproc=world)
    workload = build_workload(cfg.model, cfg.batch, cfg.seq, cfg.seed, MODEL_ARGS)
    inputs, mesh = workload.local_inputs(rank, world), init_device_mesh("cpu", (world,))
    profiles = []
    for setup in (lambda m: set_up(GRAPHSHARD, cfg, workload, mesh, inputs),
                  lambda m: make_train_step(
                      module := CollectivesOnly(m, mesh, {"compiler": "eager",
                                                          "all_gather": "native"}),
                      workload.loss_fn, inputs, make_optimizer(cfg, module.parameters()))):
        step = setup(__import__("copy").deepcopy(workload.model))
        step(), step()
        with memory_profile() as prof:
            with measured_step():
                step()
        profiles.append(asdict(analyze(prof, world)))
    return tuple(profiles)


@pytest.mark.timeout(300)
def test_collectives_only_replays_graphshards_collectives_without_its_compute():
    """The replayed step issues what graphshard's step issues, kind by kind and byte by byte,
    and trains nothing: its one parameter is a scalar."""
    for real, replay in run_local(_profiled_replay, 2):
        assert replay["collectives"] == real["collectives"]
        assert replay["comm_bytes"] == real["comm_bytes"]
        assert replay["peak_bytes"] < real["peak_bytes"]


TP_METHODS = ("graphshard_tp", "fsdp2_tp", "fsdp2_tp_compile")


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_tensor_parallel_methods_split_the_batch_by_data_parallel_rank_and_keep_their_plans(fake_pg):
    """At 2 x 2 the two ranks of a TP group train the same rows, their data-parallel rank's;
    each TP method parallelises on "tp" and shards on "dp"; a model without a TP plan is
    reported unavailable."""
    from torch.distributed.tensor import DTensor, Shard

    from graphshard.bench.harness import rank_placements
    from graphshard.bench.methods import MethodUnavailable, method

    model_args = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64}
    cfg = BenchConfig(model="llama", nproc=4, tp=2, methods=("ddp_eager", *TP_METHODS))
    workload = build_workload("llama", 8, 16, 0, model_args)
    rows = [rank_placements(cfg, workload, rank)[True].inputs[0] for rank in range(4)]
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[2], rows[3])
    assert torch.equal(torch.cat([rows[0], rows[2]]), workload.inputs[0])  # the global batch
    placements = rank_placements(cfg, workload, 0)
    assert placements[True].mesh.mesh_dim_names == ("dp", "tp")
    assert placements[False].inputs[0].shape[0] == 2  # the data-parallel methods: 1/4 each

    for name in TP_METHODS:
        model = copy.deepcopy(workload.model)
        trained = method(name).setup(model, placements[True].mesh)
        # what the optimizer steps; a compiled module's names carry "_orig_mod."
        wq = {n.replace("_orig_mod.", ""): p for n, p in trained.named_parameters()}[
            "layers.0.attention.wq.weight"]
        assert isinstance(wq, DTensor) and wq.device_mesh.ndim == 2, name  # (dp, tp)
        assert wq.placements[1] == Shard(0), name  # colwise on tp
    no_plan = build_workload("transformer", 8, 16, 0, MODEL_ARGS).model
    for name in TP_METHODS:
        with pytest.raises(MethodUnavailable, match="the model has no TP plan"):
            method(name).setup(copy.deepcopy(no_plan), placements[True].mesh)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.slow
def test_bench_tensor_parallel_methods_train_as_ddp(tmp_path):
    """graphshard + TP and FSDP2 + TP at world size 2 (1 x 2) on the Hugging Face Llama: their
    losses DDP's at the same global batch."""
    out = tmp_path / "results.json"
    model_args = "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=4,num_key_value_heads=2"
    names = ("ddp_eager", "graphshard_tp", "fsdp2_tp")
    assert main(["--model", "hf-llama", "--model-args", model_args, "--nproc", "2", "--tp", "2",
                 "--methods", ",".join(names), "--steps", "2", "--repeats", "1",
                 "--warmup", "1", *SUITE_CACHE, "--json", str(out), "--plot", ""]) == 0
    results = json.loads(out.read_text())
    assert results["config"]["tp"] == 2
    for name in names:
        method = results["methods"][name]
        assert method["status"] == "ok", (name, method["status"])
        assert method["loss_max_abs_diff"] <= 1e-4, name
        assert method["peak_mib"] > 0 and method["step_ms"]["n"] == 2
    # TP's collectives beside the data-parallel ones: more than DDP's one all-reduce bucket
    assert results["methods"]["graphshard_tp"]["collectives_per_step"] > 1


def test_bench_refuses_a_tp_degree_that_does_not_divide_the_world(capsys):
    assert main(["--nproc", "2", "--tp", "3", "--methods", "fsdp2_tp"]) == 2
    assert "--tp 3 does not divide --nproc 2" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_float8_methods_gather_fewer_bytes_and_train_like_fsdp2_with_torchao(tmp_path):
    """graphshard with torchao's float8 Linears against graphshard bf16 (every unit resharded
    in both, so they gather the same weights) and FSDP2 + torchao float8 at world size 2 on the
    built-in Llama: float8 gathers move fewer bytes than bf16 ones, and graphshard's losses
    are FSDP2 + torchao's (same float8 math, bf16 rounding)."""
    out = tmp_path / "results.json"
    bf16 = "graphshard:param_dtype=bfloat16+reduce_dtype=float32+reshard_after_forward=true"
    names = (bf16, bf16 + "+float8=true", "fsdp2_float8")
    assert main(["--model", "llama", "--model-args", "dim=64,n_layers=1,n_heads=4,n_kv_heads=2",
                 "--nproc", "2", "--methods", ",".join(names), "--steps", "2", "--repeats", "1",
                 "--warmup", "1", *SUITE_CACHE, "--json", str(out), "--plot", ""]) == 0
    methods = json.loads(out.read_text())["methods"]
    for name in names:
        assert methods[name]["status"] == "ok", (name, methods[name]["status"])
    # gathers and reduce-scatters (fp32 in both) travel by all-to-all on gloo: the 7 float8
    # weights' gathers shrink to half, the rest stays (measured 0.79)
    moved = {name: methods[name]["comm_mb_per_step"] for name in names}
    assert moved[names[1]] < 0.9 * moved[names[0]], moved
    for ours, theirs in zip(methods[names[1]]["losses"], methods["fsdp2_float8"]["losses"]):
        assert abs(ours - theirs) <= 1e-2, (methods[names[1]]["losses"],
                                            methods["fsdp2_float8"]["losses"])


def test_tool_time_counts_the_cpu_of_the_command_and_its_children():
    # the planner's captures run in child processes: their CPU seconds count too
    from graphshard.bench.tool_time import _timed

    spin = "import time; t = time.process_time(); exec('while time.process_time() - t < 0.3: pass')"
    wall, cpu = _timed([sys.executable, "-c",
                        f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"])
    assert cpu >= 0.3 and wall >= 0.3, (wall, cpu)
