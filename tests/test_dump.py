"""`graphshard dump`: the CLI end to end, its JSON schema and consistency, the trace, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from graphshard.tools import dump
from graphshard.compiler.pipeline import STAGES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join("tests", "dump_targets", "tiny.py")
SMALL_TRANSFORMER = ["transformer", "--model-args", "n_layers=1,dim=32", "--batch", "1",
                     "--seq", "8"]
KINDS = {"all_gather", "reduce_scatter", "all_reduce"}


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # targets are given relative to the repository


def _main(capsys, *argv):
    code = dump.main(list(argv))
    out, err = capsys.readouterr()
    assert not dist.is_initialized(), "dump must tear its fake process group down"
    return code, out, err


def _json_report(capsys, tmp_path, *argv) -> dict:
    """Run the dump with --json into tmp_path; it must succeed. Returns the report."""
    out_json = tmp_path / "dump.json"
    code, _, err = _main(capsys, *argv, "--json", str(out_json))
    assert code == 0, err
    return json.loads(out_json.read_text())


def _check_schema(report: dict) -> None:
    for key in ("world_size", "strategy", "options", "params", "collectives", "estimate", "graphs"):
        assert key in report, key
    assert isinstance(report["params"]["count"], int) and report["params"]["bytes"] > 0
    for c in report["collectives"]:
        assert c["graph"] in ("forward", "backward")
        assert c["op"] in KINDS
        assert isinstance(c["params"], list) and all(isinstance(n, str) for n in c["params"])
        assert isinstance(c["bytes"], int) and c["bytes"] > 0
        assert isinstance(c["dtype"], str)
        assert isinstance(c["start"], int) and isinstance(c["wait"], int)
        assert c["start"] < c["wait"]
        assert c["hidden_s"] >= 0 and c["exposed_s"] >= 0
        assert abs(c["hidden_s"] + c["exposed_s"] - c["duration_s"]) < 1e-9
    for key in ("comm_bytes", "peak_memory_bytes", "step_s", "exposed_comm_s"):
        assert report["estimate"][key] >= 0, key
    assert report["estimate"]["comm_bytes"] == pytest.approx(
        sum(c["wire_bytes"] for c in report["collectives"]))
    for kind in ("forward", "backward"):
        assert "def forward" in report["graphs"][kind]


def _bytes(report, graph, op):
    return sum(c["bytes"] for c in report["collectives"] if c["graph"] == graph and c["op"] == op)


def test_builtin_end_to_end_through_the_cli(tmp_path):
    out_json, out_trace = tmp_path / "dump.json", tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "graphshard", "dump", *SMALL_TRANSFORMER, "--world-size", "4",
         "--json", str(out_json), "--trace", str(out_trace)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "rank 0's view" in out and "world size 4" in out
    for heading in ("collectives", "communication per step", "estimate", "peak memory per rank"):
        assert heading in out
    assert "graph after stage" not in out and "def forward" not in out  # summary only by default
    assert "2*P*(N - 1)/N" in out  # theory as a formula in N
    # Progress of the long phases on stderr, the report alone on stdout.
    assert "capturing the training step" in proc.stderr and "backward graph captured" in proc.stderr

    report = json.loads(out_json.read_text())
    _check_schema(report)
    assert report["world_size"] == 4 and report["strategy"] == "full_shard"
    # One number per memory concept: the backward's own peak in the table is the one in the
    # peak line; it starts with the saved activations (freed as it goes) and produces the
    # gradients, which the model state therefore leaves out.
    est, mem = report["estimate"], report["estimate"]["memory"]
    own_peak = est["per_graph"]["backward"]["peak_transient_bytes"]
    assert mem["backward_peak_bytes"] == own_peak and mem["peak_graph"] == "backward"
    assert mem["model_state_bytes"] == mem["param_bytes"] + mem["optimizer_bytes"]
    assert mem["peak_bytes"] == mem["model_state_bytes"] + mem["input_bytes"] + own_peak
    table_row = next(line for line in out.splitlines() if line.startswith("backward "))
    peak_line = next(line for line in out.splitlines() if line.startswith("peak memory per rank"))
    own = dump._human(own_peak)
    assert table_row.endswith(own) and f"its own peak {own}" in peak_line
    assert f"with {dump._human(mem['backward_saved_bytes'])} of saved activations" in peak_line
    params = report["params"]
    # Every parameter is used in forward and trainable, all fp32: the forward gathers exactly
    # the parameters, and the backward reduce-scatters exactly their gradients.
    assert _bytes(report, "forward", "all_gather") == params["bytes"]
    assert _bytes(report, "backward", "reduce_scatter") == params["trainable_bytes"] == params["bytes"]
    comm = report["comm"]
    assert comm["reduce_scatter"]["wire_bytes"] == pytest.approx(params["bytes"] * 3 / 4)
    assert comm["reduce_scatter"]["difference"] == pytest.approx(0)

    trace = json.loads(out_trace.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = {e["tid"] for e in events}
    assert lanes == {0, 1}
    comm_events = [e for e in events if e["tid"] == 1]
    assert len(comm_events) == len(report["collectives"])
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in events)


def test_file_target_without_loss_fn_json_is_consistent(capsys, tmp_path):
    report = _json_report(capsys, tmp_path, f"{TINY}:make", "--world-size", "4", "--stage", "none")
    _check_schema(report)
    params = {p["name"]: p for p in report["params"]["list"]}
    assert report["params"]["count"] == len(params) == 6
    trainable = sum(p["bytes"] for p in params.values() if p["requires_grad"])
    assert _bytes(report, "forward", "all_gather") == report["params"]["bytes"]
    assert _bytes(report, "backward", "reduce_scatter") == trainable == report["params"]["trainable_bytes"]
    assert not any("frozen" in n for c in report["collectives"] if c["op"] == "reduce_scatter"
                   for n in c["params"])
    # out.weight has 5 rows: padded to 8 at world size 4, reported beside the exact bytes
    notes = " ".join(report["comm"]["notes"])
    assert "padding" in notes
    # the input does not require grad: inp.weight is never needed again in backward
    regathered = {n for c in report["collectives"] if c["graph"] == "backward"
                  and c["op"] == "all_gather" for n in c["params"]}
    assert "inp.weight" not in regathered and "frozen.weight" in regathered
    assert "not re-gathered in backward" in notes and "inp.weight" in notes
    # out.weight, of the last unit of forward, is kept gathered from forward for backward (the
    # default reshard policy): the note says so, not that backward does not need its values
    kept = next(n for n in report["comm"]["notes"] if "kept gathered from forward" in n)
    unneeded = next(n for n in report["comm"]["notes"] if "not needed to compute" in n)
    assert "out.weight" in kept and "out.weight" not in unneeded and "inp.weight" in unneeded


def test_module_target_and_every_stage_printed(capsys):
    code, out, err = _main(capsys, "tests.dump_targets.tiny:make_with_loss", "-n", "2",
                           "--stage", "all")
    assert code == 0, err
    kinds = {"merged": ("dynamo",), "tagged": ("joint",)}
    for stage in STAGES:
        for kind in kinds.get(stage, ("forward", "backward")):
            assert f"==== {kind} graph after stage {stage!r} ====" in out
    # the Dynamo graph reads each parameter through a marker; the joint graph tags them ...
    def graph_after(stage):
        return out.split(f"after stage {stage!r} ====")[1].split("\n==== ")[0]

    assert "graphshard.unshard" in graph_after("merged")
    assert "MUST_RECOMPUTE" in graph_after("tagged")  # full_shard: gathered again in backward
    assert "graphshard.unshard" in out.split("after stage 'partitioned'")[1]  # markers, then...
    assert "all_gather_into_tensor" in out.split(f"after stage {STAGES[-1]!r}")[1]  # collectives


@pytest.mark.parametrize("strategy, extra, fwd_ops, bwd_ops", [
    ("shard_grad_op", [], {"all_gather"}, {"reduce_scatter"}),
    ("no_shard", [], set(), {"all_reduce"}),
    ("hybrid_shard", ["--shard-size", "2"], {"all_gather"}, {"all_gather", "reduce_scatter",
                                                            "all_reduce"}),
])
def test_strategies_match_their_theory(capsys, tmp_path, strategy, extra, fwd_ops, bwd_ops):
    report = _json_report(capsys, tmp_path, f"{TINY}:make", "--model-args", "dim=8", "-n", "4",
                          "--strategy", strategy, *extra, "--stage", "none")
    _check_schema(report)
    ops = {g: {c["op"] for c in report["collectives"] if c["graph"] == g}
           for g in ("forward", "backward")}
    assert ops == {"forward": fwd_ops, "backward": bwd_ops}
    comm = report["comm"]
    if strategy == "no_shard":  # no padding, nothing re-gathered: exactly the theory
        assert comm["total"]["wire_bytes"] == pytest.approx(comm["total"]["theory_wire_bytes"])
    if strategy == "hybrid_shard":
        assert report["mesh"] == [2, 2]
        assert "S" in comm["total"]["theory_formula"]


@pytest.mark.parametrize("spelling", ["bfloat16", "bf16"])
def test_mixed_precision_gathers_in_param_dtype(capsys, tmp_path, spelling):
    report = _json_report(capsys, tmp_path, f"{TINY}:make", "-n", "2", "--param-dtype", spelling,
                          "--reduce-dtype", "fp32", "--stage", "none")
    gathers = [c for c in report["collectives"] if c["op"] == "all_gather"]
    assert gathers and all(c["dtype"] == "bfloat16" for c in gathers)
    assert _bytes(report, "forward", "all_gather") == report["params"]["bytes"] // 2


BAD_INPUTS = [
    (["no_such_package_xyz.models:make"], "cannot import 'no_such_package_xyz.models'"),
    (["missing_file.py:make"], "no such file"),
    ([f"{TINY}:nope"], "has no attribute 'nope'"),
    ([f"{TINY}:NOT_CALLABLE"], "is not callable"),
    ([f"{TINY}:raises"], "raised RuntimeError: boom: the factory failed"),
    ([f"{TINY}:wrong_shape"], "must return (model, example_inputs) or"),
    ([f"{TINY}:wrong_model"], "not an nn.Module"),
    (["gpt5"], "unknown target 'gpt5'"),
    ([f"{TINY}:make", "--strategy", "zero9"], "unknown sharding strategy 'zero9'"),
    ([f"{TINY}:make", "--option", "bucket_size=3"], "unknown graphshard option 'bucket_size'"),
    ([f"{TINY}:make", "--option", "prefetch=two"], "prefetch"),
    ([f"{TINY}:make", "--stage", "optimized"], "unknown stage 'optimized'"),
    ([f"{TINY}:make", "--world-size", "0"], "--world-size must be at least 1"),
    ([f"{TINY}:make", "--strategy", "hybrid_shard", "-n", "4"], "needs --shard-size"),
    ([f"{TINY}:make", "--param-dtype", "int8"], "not a floating torch dtype"),
    ([f"{TINY}:make", "--json", "/no_such_dir/x.json"], "--json '/no_such_dir/x.json': folder"),
    ([f"{TINY}:make", "--trace", "."], "--trace '.': is a directory"),
    ([f"{TINY}:make", "--cluster", "tpu"], "unknown cluster 'tpu': a preset (h100, a100, local)"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_exits_nonzero_with_one_clear_line(capsys, argv, message):
    code, out, err = _main(capsys, "--stage", "none", *argv)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("graphshard dump: ") and message in lines[0], lines[0]


def test_bad_input_through_the_cli_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "graphshard", "dump", "llama", "--stage", "x"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"graphshard dump: unknown stage 'x'; valid: {', '.join((*STAGES, 'all', 'none'))}"]


def test_refuses_to_replace_an_existing_process_group(capsys, fake_pg):
    code = dump.main([f"{TINY}:make", "--stage", "none"])
    assert code == 2
    assert "already initialised" in capsys.readouterr().err


def test_frozen_model_dumps_its_inference_graph(capsys, tmp_path):
    report = _json_report(capsys, tmp_path, f"{TINY}:frozen_model", "-n", "2", "--stage", "none")
    assert report["graphs"]["backward"] is None and "def forward" in report["graphs"]["forward"]
    assert {c["graph"] for c in report["collectives"]} == {"forward"}
    assert "no backward graph" in " ".join(report["comm"]["notes"])


def test_llama3_8b_shapes_dump_at_world_size_64_without_allocating_weights(tmp_path):
    # One block of the 8B shape: 4.7 GiB of fp32 parameters (embedding and output 1.96 GiB
    # each), dumped in a process that never holds them. The full 32-block model takes ~50 s
    # of CPU here, too slow for the suite (see the dump module docstring).
    out_json = tmp_path / "8b.json"
    script = ("import resource, sys; from graphshard.tools.dump import main; "
              f"rc = main(['llama3-8b', '--model-args', 'n_layers=1', '-n', '64', "
              f"'--stage', 'none', '--json', {str(out_json)!r}]); "
              "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); "
              "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    maxrss = int(proc.stdout.rsplit("maxrss_kb", 1)[1]) * 1024  # Linux: kilobytes
    report = json.loads(out_json.read_text())
    assert report["world_size"] == 64
    assert report["params"]["bytes"] > 4.5 * 2**30
    assert maxrss < 1.5 * 2**30, f"peak RSS {maxrss / 2**30:.2f} GiB: weights were allocated?"
    gathered = _bytes(report, "forward", "all_gather")
    assert gathered == report["params"]["bytes"]
    assert all(c["group_size"] == 64 for c in report["collectives"])


def test_collectives_carried_by_all_to_all_are_reported_as_what_they_do(capsys, tmp_path):
    # The transport stage may exchange gathers and reductions by all-to-all; the report still
    # counts them as all-gathers and reduce-scatters, with the same bytes.
    native, exchanged = (
        _json_report(capsys, tmp_path, *SMALL_TRANSFORMER, "--world-size", "4", "--stage", "none",
                     "-o", f"all_gather={transport}", "-o", f"reduce_scatter={transport}")
        for transport in ("native", "all_to_all"))
    # gathers leave the rank's own row out (its place found when the graph runs), reductions
    # at world size 4 exchange every chunk
    assert "exchange_with_peers" in exchanged["graphs"]["forward"]
    assert "all_to_all_single" in exchanged["graphs"]["backward"]
    assert "all_gather_into_tensor" not in exchanged["graphs"]["forward"]
    assert "reduce_scatter_tensor" not in exchanged["graphs"]["backward"]
    summary = [(c["graph"], c["op"], c["params"], c["bytes"], c["group_size"]) for c in native["collectives"]]
    assert [(c["graph"], c["op"], c["params"], c["bytes"], c["group_size"])
            for c in exchanged["collectives"]] == summary
    _check_schema(exchanged)
    # Both are every rank's graphs: a host compiles them once.
    assert native["compile"] == exchanged["compile"] == "once per host"


def test_a_cnn_dumps_in_a_fresh_interpreter():
    # Fresh process: nothing has imported Inductor's lowerings, which its max-pool
    # decomposition consults (the backend must import them even when Inductor does not run).
    proc = subprocess.run(
        [sys.executable, "-m", "graphshard", "dump", f"{TINY}:make_cnn", "--world-size", "4",
         "--stage", "none"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all_gather" in proc.stdout and "reduce_scatter" in proc.stdout


def test_a_tied_weight_is_one_parameter_gathered_and_reduced_once(capsys, tmp_path):
    # The factory runs on the meta device; materialising it for tracing must keep the tie.
    report = _json_report(capsys, tmp_path, "tests/dump_targets/tiny.py:make_tied",
                          "--world-size", "2", "-o", "bucket_mb=0")
    names = [p["name"] for p in report["params"]["list"]]
    assert "emb.weight" in names and "head.weight" not in names
    from tests.zoo import TinyGPT

    unique = list(TinyGPT().parameters())
    assert report["params"]["count"] == len(unique)
    assert report["params"]["bytes"] == sum(p.numel() * p.element_size() for p in unique)
    gathered = [c for c in report["collectives"] if c["op"] == "all_gather"
                and "emb.weight" in c["params"] and c["graph"] == "forward"]
    assert len(gathered) == 1


def test_cluster_presets_are_accepted_like_plans(capsys, tmp_path):
    # `--cluster h100` prices the same graphs for an H100 node: the same bytes, a faster step.
    steps = {}
    for cluster in (None, "h100"):
        out = tmp_path / f"{cluster}.json"
        argv = [*SMALL_TRANSFORMER, "--world-size", "8", "--quiet", "--json", str(out)]
        code, _, err = _main(capsys, *argv, *(["--cluster", cluster] if cluster else []))
        assert code == 0, err
        steps[cluster] = json.loads(out.read_text())["estimate"]
    assert steps["h100"]["comm_bytes"] == steps[None]["comm_bytes"]
    assert steps["h100"]["step_s"] < steps[None]["step_s"] / 2


def test_keyword_inputs_and_a_loss_computed_by_the_model(capsys, tmp_path):
    # A Hugging Face model called as model(input_ids=..., labels=...): the factory returns its
    # example inputs as a dict; the loss is the model's own (ModelOutput.loss).
    report = _json_report(capsys, tmp_path, "tests.dump_targets.zoo:causal_lm_with_labels",
                          "--no-meta", "-n", "4", "--seq", "16")
    _check_schema(report)
    ops = {(c["graph"], c["op"]) for c in report["collectives"]}
    assert {("forward", "all_gather"), ("backward", "reduce_scatter")} <= ops, ops
    from graphshard.tools import plan as planner
    argv = ["tests.dump_targets.zoo:causal_lm_with_labels", "--devices", "8", "--cluster", "h100",
            "--global-batch", "8", "--seq", "16", "--ac", "none", "--dtypes", "bf16", "--quiet",
            "--json", str(tmp_path / "plan.json")]
    assert planner.main(argv) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["configs"][0]["fits"]


def test_a_compile_failure_is_one_line_and_raises_with_its_traceback_on_request(capsys, monkeypatch):
    target = f"{TINY}:fails_to_compile"
    code, _, err = _main(capsys, target, "-n", "2", "-q")
    assert code == dump.COMPILE_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"compiling {target!r} failed: " in lines[0], err
    assert "--traceback" in lines[0]
    with pytest.raises(Exception) as raised:
        dump.main([target, "-n", "2", "-q", "--traceback"])
    assert not isinstance(raised.value, dump.DumpError)  # the compile's own error, as raised
    assert not dist.is_initialized()
    monkeypatch.setenv(dump.TRACEBACK_ENV, "1")  # the same, and for argument errors too
    with pytest.raises(dump.DumpError, match="unknown stage"):
        dump.main([target, "--stage", "x"])
