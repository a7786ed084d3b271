"""`graphshard plan`: the search, its JSON, the configuration it writes being usable as it is,
the topology of collectives, depth extrapolation against a whole capture, and bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re

import pytest
import torch.distributed as dist

import graphshard
from graphshard._torch_compat import init_fake_process_group
from graphshard.compiler.clusters import PRESETS, resolve_cluster
from graphshard.compiler.options import GraphshardOptions
from graphshard.tools import plan as planner
from graphshard.tools.models import build_model

SMALL = ["transformer", "--model-args", "dim=64,vocab_size=256", "--seq", "32"]
TINY = "tests/dump_targets/tiny.py"


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One exhaustive search on 16 H100s (two nodes): full_shard, hybrid over one node,
    no_shard; AC none and full (the default search would leave out "full", which "none"
    outruns here)."""
    tmp = tmp_path_factory.mktemp("plan")
    argv = [*SMALL, "--devices", "16", "--cluster", "h100", "--global-batch", "16",
            "--ac", "none,full", "--dtypes", "bf16", "--exhaustive", "--quiet",
            "--json", str(tmp / "all.json"), "--out", str(tmp / "best.json"),
            "--trace", str(tmp / "trace.json")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert planner.main(argv) == 0
    return {"printed": printed.getvalue(),
            **{name: json.loads((tmp / f"{name}.json").read_text()) for name in ("all", "best", "trace")}}


@pytest.mark.slow  # the planner's CLI search
def test_every_configuration_is_reported_best_first(planned):
    configs = planned["all"]["configs"]
    # full_shard and hybrid x 2 AC, 6 option sets each (+ "auto" where distinct); no_shard x
    # 2 AC, one option set per bucket size (it gathers nothing: no keep, no prefetch)
    assert len(configs) >= 24 + 4
    for c in configs:
        for key in ("step_s", "tokens_per_s", "peak_memory_bytes", "fits", "shard", "options"):
            assert key in c, key
        assert c["tokens_per_s"] == pytest.approx(16 * 32 / c["step_s"])
    fitting = [c["step_s"] for c in configs if c["fits"]]
    assert fitting == sorted(fitting) and configs[0]["fits"]
    assert planned["best"] == configs[0]
    strategies = {(c["shard"]["strategy"], tuple(c["shard"]["mesh_shape"])) for c in configs}
    assert {("full_shard", (16,)), ("shard_grad_op", (16,)), ("hybrid_shard", (2, 8)),
            ("no_shard", (16,))} <= strategies
    no_shard = [c for c in configs if c["shard"]["strategy"] == "no_shard"]
    assert len(no_shard) == 4 and all(set(c["options"]) == {"bucket_mb"} for c in no_shard)
    # DDP's layout: an all-reduce is a reduce-scatter and an all-gather, of the fp32 gradients
    # (bf16 parameters, fp32 reduction), where shard_grad_op gathers bf16 parameters: 4 + 4
    # bytes an element against 2 + 4; every parameter and its optimizer state whole on each rank
    grad_op = {(c["activation_checkpointing"], c["options"]["bucket_mb"]): c for c in configs
               if c["shard"]["strategy"] == "shard_grad_op" and c["options"]["prefetch"] == 1}
    for c in no_shard:
        twin = grad_op[(c["activation_checkpointing"], c["options"]["bucket_mb"])]
        assert c["comm_bytes"] == pytest.approx(twin["comm_bytes"] * 8 / 6, rel=0.02), (c, twin)
        assert c["peak_memory_bytes"] > twin["peak_memory_bytes"]
    assert {c["activation_checkpointing"] for c in configs} == {"none", "full"}
    assert {(c["micro_batch"], c["accumulation_steps"]) for c in configs} == {(1, 1)}
    assert {c["options"].get("prefetch") for c in configs} == {1, 2, None}  # None: no_shard
    assert {c["options"]["bucket_mb"] for c in configs} == {25.0, 64.0}
    assert planned["trace"]["traceEvents"], "the trace of the best configuration is empty"


@pytest.mark.slow  # the planner's CLI search
def test_memory_is_printed_in_a_unit_that_fits(planned):
    """This model peaks at about 1 MiB: in GiB every cell would read 0.0."""
    rows = [line for line in planned["printed"].splitlines() if re.match(r"\s+\d+\s+\w+_shard", line)]
    assert rows, planned["printed"]
    limit = "74.51 GiB"  # the H100 preset's 80 GB
    for row in rows:
        assert re.search(rf"\b\d+\.\d\d [KM]iB / {limit}", row), row
    assert " 0.0 " not in planned["printed"] and "0.00 GiB" not in planned["printed"]


def test_micro_batches_accumulate_to_the_global_batch():
    assert planner.micro_batches(4) == [4, 2, 1] and planner.micro_batches(3) == [3, 1]
    layouts = planner.layouts(16, 8, 64, ("none", "full"), ("bfloat16",))
    assert {(layout.strategy, layout.shard_size) for layout in layouts} == {
        ("full_shard", 16), ("hybrid_shard", 8), ("no_shard", 1)}
    assert len(layouts) == 3 * 2 * 3  # strategies x AC x micro-batch sizes
    assert {layout.strategy for layout in planner.layouts(
        16, 8, 64, ("none",), ("bfloat16",), strategies=("full_shard", "no_shard"))} == {
        "full_shard", "no_shard"}
    # one data-parallel rank: no_shard is full_shard, and not a layout of its own
    assert {layout.strategy for layout in planner.layouts(2, 8, 4, ("none",), ("bfloat16",),
                                                          tp_sizes=(2,))} == {"full_shard"}
    assert planner.shard_group_sizes(64, 8) == [8, 16, 32]


def _built_as_planned(plan, target: str, **model_args):
    """The model `plan` (a plan JSON, or one of its configurations) describes, set up by
    graphshard.apply_plan on the fake process group: (the model, what apply_plan returned)."""
    model, _, _ = build_model(target, batch=1, seq_len=32, **model_args)
    applied = graphshard.apply_plan(model, plan)
    GraphshardOptions.from_dict(applied.options)
    return model, applied


@pytest.mark.slow  # the planner's CLI search
def test_the_best_configuration_is_accepted_as_it_is(planned):
    init_fake_process_group(16)
    try:
        # --json's list: its best configuration, as --out wrote it
        model, applied = _built_as_planned(planned["all"], "transformer", dim=64, vocab_size=256)
        assert graphshard.is_sharded(model)
        best = planned["best"]
        assert applied.mesh.shape == tuple(best["shard"]["mesh_shape"])
        assert applied.options == best["options"]
        assert (applied.micro_batch, applied.accumulation_steps) == (
            best["micro_batch"], best["accumulation_steps"])
    finally:
        dist.destroy_process_group()


LLAMA_ARGS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256,
              "ffn_hidden": 128}


def _plan_small_llama(tmp_path, dtypes: str, tp: str, quiet: bool = True
                      ) -> tuple[list[dict], str]:
    """The planner's CLI on the small Llama, 8 H100s: (every configuration, the printed table)."""
    argv = ["llama", "--model-args", ",".join(f"{k}={v}" for k, v in LLAMA_ARGS.items()),
            "--seq", "32", "--devices", "8", "--cluster", "h100", "--global-batch", "8",
            "--ac", "none", "--dtypes", dtypes, "--tp", tp, "--top", "40",
            *(["--quiet"] if quiet else []),
            "--json", str(tmp_path / "all.json"), "--out", str(tmp_path / "best.json")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert planner.main(argv) == 0
    return json.loads((tmp_path / "all.json").read_text())["configs"], printed.getvalue()


@pytest.mark.slow  # whole searches
def test_the_search_covers_tp_degrees_and_a_tp_configuration_builds_as_written(tmp_path,
                                                                               capsys):
    configs, printed = _plan_small_llama(tmp_path, "bf16", "1,2,4", quiet=False)
    # tp 4 would cut the 2 KV heads: skipped (said once, however many layouts it skips); tp 2
    # runs over 4 data-parallel ranks
    progress = capsys.readouterr().err
    assert progress.count("skipped: ") == 1 and "layouts skipped in all" in progress, progress
    assert {c["shard"]["tensor_parallel"] for c in configs} == {1, 2}
    with_tp = [c for c in configs if c["shard"]["tensor_parallel"] == 2]
    assert {tuple(c["shard"]["mesh_shape"]) for c in with_tp} == {(4, 2)}
    assert re.search(r"full_shard\s+4x2\s+2\s", printed), printed
    # the same global batch: a data-parallel rank of a TP pair trains twice a device's share
    assert {(c["micro_batch"] * c["accumulation_steps"]) for c in with_tp} == {2}
    init_fake_process_group(8)
    try:
        model, applied = _built_as_planned(with_tp[0], "llama", **LLAMA_ARGS)
        assert applied.mesh.mesh_dim_names == ("dp", "tp")
        weight = model.layers[0].attention.wq._parameters["weight"].placements
        assert len(weight) == 2 and weight[1].is_shard(0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_float8_is_searched_priced_at_one_byte_a_gathered_element_and_builds_as_written(tmp_path):
    configs, printed = _plan_small_llama(tmp_path, "bf16,float8", "1")
    float8 = [c for c in configs if "float8" in c]
    assert float8 and len(float8) < len(configs), [c.get("float8") for c in configs]
    assert re.search(r"full_shard\s+8\s+1\s+none\s+float8\s", printed), printed

    def key(c):  # the same layout and knobs, another dtype
        return (c["shard"]["strategy"], c["micro_batch"], c["options"].get("prefetch"),
                c["options"]["bucket_mb"], c["options"].get("reshard_after_forward"))

    bf16 = {key(c): c for c in configs if "float8" not in c}
    for c in float8:
        assert c["shard"]["param_dtype"] == "bfloat16" and c["float8"]["config"] == {
            "enable_fsdp_float8_all_gather": True}
        # the Linears' weights (every width divides by 16 here) are gathered in one byte, not
        # two; the reduce-scatters stay fp32 for both
        assert c["comm_bytes"] < 0.9 * bf16[key(c)]["comm_bytes"], (c, bf16[key(c)])
    init_fake_process_group(8)
    try:
        from torchao.float8.float8_linear import Float8Linear

        model, _ = _built_as_planned(float8[0], "llama", **LLAMA_ARGS)
        assert graphshard.is_sharded(model)
        assert isinstance(model.layers[0].attention.wq, Float8Linear)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # whole searches
def test_collectives_pay_the_link_their_group_spans():
    h100 = PRESETS["h100"]
    assert h100.link(spans_nodes=False) is h100
    between = h100.link(spans_nodes=True)
    assert between.bandwidth_Bps == h100.inter_node_bandwidth_Bps < h100.bandwidth_Bps
    # Over 16 devices (two nodes), full_shard's gathers and reduce-scatters cross nodes; hybrid
    # with one node per shard group keeps them on NVLink and sends only the replica all-reduce
    # of the gradient shards between nodes. A 100x slower inter-node link must hurt full_shard
    # more.
    slow = dataclasses.replace(h100, inter_node_bandwidth_Bps=h100.inter_node_bandwidth_Bps / 100)
    steps = {}
    for name, cluster in (("fast", h100), ("slow", slow)):
        configs = planner.plan("transformer", 16, cluster, 16, 32, model_args={"dim": 128},
                               ac_modes=("none",), dtypes=("bfloat16",),
                               knobs=(planner.Knobs("last", 1, 64.0),))
        steps[name] = {c.layout.strategy: c.step_s for c in configs}
    slowdown = {s: steps["slow"][s] - steps["fast"][s] for s in ("full_shard", "hybrid_shard")}
    assert slowdown["full_shard"] > 2 * slowdown["hybrid_shard"] > 0, (steps, slowdown)


def test_ranks_beyond_a_nodes_compute_slots_share_it():
    """3 ranks on a 2-core machine compute at 2/3 speed each; 2 ranks, or GPUs, at full speed."""
    cpu = dataclasses.replace(PRESETS["a100"], compute_slots_per_node=2, devices_per_node=None)
    assert cpu.shared_by(2) is cpu and PRESETS["a100"].shared_by(8) is PRESETS["a100"]
    shared = cpu.shared_by(3)
    assert shared.flops_per_s == pytest.approx(cpu.flops_per_s * 2 / 3)
    assert shared.low_precision_flops_per_s == pytest.approx(cpu.low_precision_flops_per_s * 2 / 3)
    assert shared.kernel_overhead_s == pytest.approx(cpu.kernel_overhead_s * 1.5)
    # gloo's transfers within the node are copies on the same cores
    assert shared.bandwidth_Bps == pytest.approx(cpu.bandwidth_Bps * 2 / 3)
    assert shared.latency_s == pytest.approx(cpu.latency_s * 1.5)
    knobs = planner.Knobs("last", 1, 64.0)
    layout = planner.Layout("full_shard", 3, "none", "float32", 1)
    steps = {name: planner.predict("transformer", 3, spec, 3, 32, layout, knobs,
                                   model_args={"dim": 64, "vocab_size": 256}).step_s
             for name, spec in (("own device", PRESETS["a100"]), ("sharing", cpu))}
    # every term of the step (compute, memory traffic, overheads, transfers) slows alike
    assert steps["sharing"] == pytest.approx(1.5 * steps["own device"], rel=0.02), steps


@pytest.mark.slow  # whole searches
def test_depth_extrapolation_matches_a_whole_capture():
    """8 blocks predicted from 4- and 5-block captures vs the 8-block model captured whole."""
    knobs = (planner.Knobs("last", 1, 64.0), planner.Knobs("all", 1, 64.0))
    args = dict(ac_modes=("full",), dtypes=("bfloat16",), knobs=knobs)
    assert planner.depth_probes("transformer-large", {"dim": 128}) == (8, (4, 5))
    probed = planner.plan("transformer-large", 8, PRESETS["a100"], 8, 64, model_args={"dim": 128},
                          **args)
    whole = planner.plan("transformer-large", 8, PRESETS["a100"], 8, 64,
                         model_args={"dim": 128, "n_layers": 8}, **args)
    key = lambda c: (c.knobs, c.layout)  # noqa: E731
    whole_by = {key(c): c for c in whole}
    for c in probed:
        w = whole_by[key(c)]
        assert c.step_s == pytest.approx(w.step_s, rel=0.03), c.knobs
        # Backward's peak does not grow by the same amount with the first blocks as with later
        # ones (this model: +0.47 MB from 3 to 4 blocks, +0.1 MB per block from 4 on), which
        # is why the probes start at 4 blocks.
        assert c.peak_memory_bytes == pytest.approx(w.peak_memory_bytes, rel=0.03), c.knobs


def test_auto_keeps_as_many_blocks_beyond_the_default_as_the_device_memory_allows():
    """The planner's reshard_after_forward="auto" on made-up probes of a 5-block model: the
    default (its tail: the last block kept) peaks at 10 MB, every block kept at 18 MB, so each
    block beyond the default's one costs 2 MB."""
    from types import SimpleNamespace

    mb = 1e6

    def probe(peak: float) -> planner.Probe:
        return planner.Probe(step_s=1.0, model_compute_s=1.0, flops=0.0, exposed_comm_s=0.0,
                             comm_bytes=0.0, forward_peak_bytes=0.0, backward_peak_bytes=peak,
                             state_bytes=0.0, gradient_bytes=0.0, trainable_params=0.0,
                             trainable_shard_elements=0.0)

    probes = {"last": probe(10 * mb), "all": probe(18 * mb)}
    layout, knobs = planner.Layout("full_shard", 8, "none", "float32", 1), planner.Knobs("last", 1, 64.0)

    def kept(limit: float, depth: int = 5) -> int | None:
        config = planner.auto_config(layout, lambda k: probes[k.keep], depth, knobs,
                                     lambda _, __, p: SimpleNamespace(peak_memory_bytes=p.transient_bytes),
                                     limit)
        return None if config is None else config.kept_blocks

    assert kept(11 * mb) is None  # no room beyond the default: that is the default's row
    assert (kept(12.5 * mb), kept(16 * mb)) == (2, 4)
    assert kept(18 * mb) is None  # everything fits: the "all" row
    assert kept(100 * mb, depth=2) is None  # 2 blocks: the default keeps one, "all" both


@pytest.mark.parametrize("argv, message", [
    ([*SMALL, "--devices", "8", "--cluster", "tpu", "--global-batch", "8"], "unknown cluster 'tpu'"),
    # checked before the capture: a plan takes minutes
    ([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "8", "--out",
      "/no_such_dir/best.json"], "--out '/no_such_dir/best.json': folder /no_such_dir does not exist"),
    ([*SMALL, "--devices", "12", "--cluster", "h100", "--global-batch", "12"],
     "not a whole number of nodes of 8 devices"),
    ([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "12", "--tp", "1"],
     "divides over no data-parallel size of 8 devices"),
    # TP 4 would split 12 sequences over 2 data-parallel ranks, but the model has no TP plan
    ([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "12", "--tp", "4"],
     "no layout could be captured: .*has no tensor-parallel plan"),
    (["llama3-8b", "--seq", "128", "--devices", "1", "--cluster", "local", "--global-batch", "1",
      "--ac", "none", "--dtypes", "bf16", "--model-args", "n_layers=4"],
     r"fits in no configuration on 1 devices of 24.00 GiB: the smallest peak is .* GiB too much"),
    # `graphshard dump` accepts these factories; the planner builds inputs at each micro-batch
    ([f"{TINY}:make_fixed", "--seq", "8", "--devices", "8", "--cluster", "h100", "--global-batch", "8"],
     r"make_fixed takes no batch= or seq_len=: the planner varies the micro-batch .* needs "
     r"factory\(batch=, seq_len=\)"),
    ([f"{TINY}:make", "--seq", "8", "--devices", "8", "--cluster", "h100", "--global-batch", "8"],
     r"make takes no seq_len=: .*factory\(batch=, seq_len=\)"),
    ([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "8", "--ac", "full,most"],
     r"--ac: expected none, full, selective \(comma-separated\), got 'full,most'"),
    ([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "8", "--dtypes", "int8"],
     r"--dtypes takes bf16, fp32 and/or float8 \(fp8\), comma-separated; got 'int8'"),
    ([*SMALL, "--devices", "8", "--cluster", "a100", "--global-batch", "8", "--dtypes", "fp8"],
     r"--dtypes float8: this cluster has no float8 matmul peak"),
    (["transformer", "--model-args", "dim", "--seq", "32", "--devices", "8", "--cluster", "h100",
      "--global-batch", "8"], r"--model-args: expected KEY=VALUE, got 'dim'"),
    ([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "8", "--strategies",
      "full_shard,ddp"], r"--strategies takes full_shard, hybrid_shard, no_shard, comma-separated "
                         r"\(shard_grad_op is full_shard keeping every unit gathered: searched "
                         r"with full_shard\); got 'full_shard,ddp'"),
    ([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "8", "--strategies",
      "hybrid_shard"], r"--strategies hybrid_shard: no such layout on 8 devices"),
    (["llama3-8b", "--seq", "128", "--devices", "2", "--cluster", "local", "--global-batch", "2",
      "--ac", "none", "--dtypes", "bf16", "--tp", "1", "--strategies", "no_shard", "--model-args",
      "n_layers=4"], r"fits in no configuration .* or let --strategies include full_shard"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    assert planner.main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("graphshard plan: error:"), err
    assert re.search(message, err), err


def test_presets_are_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        planner.main(["--help"])
    out = capsys.readouterr().out
    assert "h100" in out and "a100" in out and "local" in out
    assert resolve_cluster("local").device_memory_bytes == 24 * 2**30


def test_inductors_joint_graph_rewrites_run_once_per_capture(monkeypatch):
    """A capture partitions its joint graph once, with Inductor's joint-graph rewrites: the
    default's tail check and keep="all" derive their partitions from that one (a joint graph
    partitioned again would skip the rewrites: they rewrite it in place)."""
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor import config as inductor_config

    rewrites = []
    partition_fn = compile_fx.partition_fn

    def recording(joint, joint_inputs, **kwargs):
        rewrites.append(inductor_config.use_joint_graph_passes)
        return partition_fn(joint, joint_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "partition_fn", recording)
    knobs = (planner.Knobs("last", 1, 64.0), planner.Knobs("all", 1, 64.0))
    layout = planner.Layout("full_shard", 8, "none", "float32", 1)
    probes = planner.capture_probes("transformer", layout, 8, 32, None, knobs, PRESETS["a100"],
                                    {"dim": 64, "vocab_size": 256})
    assert set(probes) == set(knobs)
    assert rewrites == [True], rewrites


def test_dump_and_plan_take_the_same_activation_checkpointing_option(capsys, tmp_path):
    """`--ac MODE` means the same to both: dump shows the step with the blocks checkpointed
    (fewer activations saved for backward), and both refuse a mode neither knows alike."""
    from graphshard.tools import dump

    saved = {}
    for mode in ("none", "full", "selective"):
        out = tmp_path / f"{mode}.json"
        assert dump.main([*SMALL, "--model-args", "n_layers=2", "--world-size", "2", "--quiet",
                          "--ac", mode, "--json", str(out)]) == 0
        saved[mode] = json.loads(out.read_text())["estimate"]["memory"]["backward_saved_bytes"]
    assert saved["full"] < saved["selective"] < saved["none"], saved
    capsys.readouterr()
    assert dump.main([*SMALL, "--ac", "most"]) == 2
    dump_error = capsys.readouterr().err
    assert planner.main([*SMALL, "--devices", "8", "--cluster", "h100", "--global-batch", "8",
                         "--ac", "most"]) == 2
    plan_error = capsys.readouterr().err
    for err in (dump_error, plan_error):
        assert "expected" in err and "none, full, selective" in err and "'most'" in err, err


def test_the_auto_search_finds_the_longest_fitting_prefix_in_few_measurements():
    """The search the backend and the planner share: every unit first, then a binary search;
    the peak may fall before it rises (keeping a unit spares backward its gather)."""
    from graphshard.compiler.auto_reshard import longest_fitting_prefix

    peaks = [10, 9, 9, 11, 12, 14, 17, 21, 26]  # convex in the units kept
    measured = []

    def peak(n: int) -> float:
        measured.append(n)
        return peaks[n]

    assert longest_fitting_prefix(8, peak, 13) == 4
    assert len(measured) <= 4 and measured[0] == 8
    assert longest_fitting_prefix(8, peaks.__getitem__, 26) == 8
    assert longest_fitting_prefix(8, peaks.__getitem__, 10.5) == 2
    assert longest_fitting_prefix(0, peaks.__getitem__, 0) == 0
