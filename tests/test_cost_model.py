"""Cost model: alpha-beta formulas, node costs on make_fx graphs, the two-lane simulator,
liveness-based peak memory, strategy formulas, and calibration on 2 gloo processes."""

from __future__ import annotations

import dataclasses
import json
import operator
import statistics

import pytest
import sympy
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from graphshard.passes import meta_keys
from graphshard.tools import calibrate as calibration
from graphshard.compiler import cost_model as cm
from graphshard.compiler.cost_model import ClusterSpec
from graphshard.compiler.simulator import graph_estimate
from graphshard.tools.theory import theoretical_comm_bytes
from graphshard.passes.liveness import memory_estimate

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
N = sympy.Symbol("N", positive=True, integer=True)

# Round numbers so expected values are easy to compute by hand; no kernel overhead.
SPEC = ClusterSpec(latency_s=1e-3, bandwidth_Bps=1e9, flops_per_s=1e9,
                   memory_bandwidth_Bps=1e10, kernel_overhead_s=0.0)


@pytest.fixture
def fake_pg():
    """A world-size-8 fake process group, so functional collectives can be traced."""
    from graphshard._torch_compat import init_fake_process_group

    init_fake_process_group(8)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


# --------------------------------------------------------------------------- ClusterSpec


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        ClusterSpec(1e-3, -1.0, 1e9, 1e9)
    with pytest.raises(ValueError, match="flops_per_s"):
        ClusterSpec(1e-3, 1e9, 0, 1e9)
    with pytest.raises(ValueError, match="latency_s"):
        ClusterSpec(True, 1e9, 1e9, 1e9)
    with pytest.raises(ValueError, match="memory_bandwidth_Bps"):
        ClusterSpec(1e-3, 1e9, 1e9, float("inf"))
    ClusterSpec(0.0, 1e9, 1e9, 1e9, kernel_overhead_s=0.0)  # zero fixed costs are fine


def test_spec_json_round_trip_and_errors(tmp_path):
    path = tmp_path / "spec.json"
    SPEC.to_json(path)
    assert ClusterSpec.from_json(path) == SPEC
    assert ClusterSpec.from_json(str(path)) == SPEC
    assert ClusterSpec.from_json(SPEC.to_json()) == SPEC
    assert ClusterSpec.from_json(json.loads(SPEC.to_json())) == SPEC
    with pytest.raises(ValueError, match="unknown ClusterSpec key.*'bogus'.*valid keys.*latency_s"):
        ClusterSpec.from_json({**json.loads(SPEC.to_json()), "bogus": 1})
    with pytest.raises(ValueError, match="missing.*flops_per_s"):
        ClusterSpec.from_json({"latency_s": 1e-3, "bandwidth_Bps": 1e9,
                               "memory_bandwidth_Bps": 1e9})


@pytest.mark.parametrize("spec", [SPEC, ClusterSpec.default()], ids=["round", "default"])
@pytest.mark.parametrize("kind", cm.KINDS)
def test_collective_time_grows_with_bytes_and_world_size_as_n_minus_1_over_n(spec, kind):
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 24]
    worlds = [2, 3, 4, 8, 64, 1024]
    for n in worlds:  # strictly increasing in bytes
        times = [cm.collective_time(kind, b, n, spec) for b in sizes]
        assert all(a < b for a, b in zip(times, times[1:])), (n, times)
    for b in sizes:  # and in world size
        times = [cm.collective_time(kind, b, n, spec) for n in worlds]
        assert all(a < b for a, b in zip(times, times[1:])), (b, times)
    # Beyond the fixed latency, time is the bytes each rank sends over the bandwidth: (N-1)/N
    # of the buffer for a gather or a scatter, twice that for an all-reduce.
    factor = 2 if kind == "all_reduce" else 1
    for n in worlds:
        for b in sizes:
            sent = (cm.collective_time(kind, b, n, spec) - spec.latency_s) * spec.bandwidth_Bps
            assert sent == pytest.approx(factor * b * (n - 1) / n, rel=1e-9), (n, b)


@pytest.mark.parametrize("world_size", [2, 4, 64])
def test_fit_alpha_beta_recovers_a_known_spec_from_its_own_timings(world_size):
    known = ClusterSpec(latency_s=3e-4, bandwidth_Bps=2.5e9, flops_per_s=1e9,
                        memory_bandwidth_Bps=1e10)
    sizes = (1 << 10, 1 << 14, 1 << 18, 1 << 22)
    samples = [(b, cm.collective_time("all_gather", b, world_size, known)) for b in sizes]
    alpha, bandwidth = cm.fit_alpha_beta(samples, world_size=world_size)
    assert (alpha, bandwidth) == pytest.approx((known.latency_s, known.bandwidth_Bps), rel=1e-6)
    fitted = ClusterSpec(alpha, bandwidth, known.flops_per_s, known.memory_bandwidth_Bps)
    for kind in cm.KINDS:  # and predicts sizes it was not fitted on
        assert cm.collective_time(kind, 3 << 24, world_size, fitted) == pytest.approx(
            cm.collective_time(kind, 3 << 24, world_size, known), rel=1e-6)


# --------------------------------------------------------------------------- alpha-beta


def test_collective_time_numbers():
    # 8 MB at N=4: each rank sends 3/4 of it for AG/RS, twice that for AR; alpha once.
    assert cm.wire_bytes("all_gather", 8e6, 4) == pytest.approx(6e6)
    assert cm.wire_bytes("reduce_scatter", 8e6, 4) == pytest.approx(6e6)
    assert cm.wire_bytes("all_reduce", 8e6, 4) == pytest.approx(12e6)
    assert cm.collective_time("all_gather", 8e6, 4, SPEC) == pytest.approx(7e-3)
    assert cm.collective_time("reduce_scatter", 8e6, 4, SPEC) == pytest.approx(7e-3)
    assert cm.collective_time("all_reduce", 8e6, 4, SPEC) == pytest.approx(13e-3)
    assert cm.collective_time("all_gather", 2e6, 2, SPEC) == pytest.approx(2e-3)
    for kind in cm.KINDS:
        assert cm.collective_time(kind, 8e6, 1, SPEC) == 0.0
        assert cm.wire_bytes(kind, 8e6, 1) == 0.0
    assert isinstance(cm.collective_time("all_gather", 1024, 8, SPEC), float)
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        cm.collective_time("broadcast", 1, 2, SPEC)
    with pytest.raises(ValueError, match="world_size"):
        cm.wire_bytes("all_gather", 1, 0)


@pytest.mark.parametrize("kind", cm.KINDS)
def test_collective_time_symbolic(kind):
    t = cm.collective_time(kind, 1 << 20, N, SPEC)
    assert isinstance(t, sympy.Basic) and N in t.free_symbols
    for n in (2, 8, 64):
        assert float(t.subs(N, n)) == pytest.approx(cm.collective_time(kind, 1 << 20, n, SPEC))
    assert t.subs(N, 1) == 0
    w = cm.wire_bytes(kind, 1 << 20, N)
    assert float(w.subs(N, 8)) == pytest.approx(cm.wire_bytes(kind, 1 << 20, 8))
    b = sympy.Symbol("B", positive=True)
    tb = cm.collective_time(kind, b, 8, SPEC)
    assert float(tb.subs(b, 1 << 20)) == pytest.approx(cm.collective_time(kind, 1 << 20, 8, SPEC))


# --------------------------------------------------------------------------- node costs


def test_mm_node_cost_is_2mnk():
    m, k, n = 64, 32, 48
    gm = make_fx(lambda a, b: a @ b, tracing_mode="fake")(torch.randn(m, k), torch.randn(k, n))
    (mm,) = _nodes(gm, aten.mm.default)
    cost = cm.node_cost(mm, SPEC)
    assert cost.flops == 2 * m * n * k
    assert cost.bytes == 4 * (m * k + k * n + m * n)
    assert cost.seconds == pytest.approx(max(cost.flops / 1e9, cost.bytes / 1e10))
    with_overhead = cm.node_cost(mm, ClusterSpec(1e-3, 1e9, 1e9, 1e10, kernel_overhead_s=5e-6))
    assert with_overhead.seconds == pytest.approx(cost.seconds + 5e-6)


def test_mm_node_cost_symbolic_shapes():
    gm = make_fx(lambda a, b: a @ b, tracing_mode="symbolic")(torch.randn(64, 32),
                                                              torch.randn(32, 48))
    (mm,) = _nodes(gm, aten.mm.default)
    assert cm.node_cost(mm, SPEC).flops == 2 * 64 * 32 * 48  # hints
    flops = cm.node_cost(mm, SPEC, symbolic=True).flops
    assert isinstance(flops, sympy.Expr) and len(flops.free_symbols) == 3


def test_views_and_bookkeeping_nodes_cost_nothing():
    def f(x):
        y = x.view(8, 16).t().transpose(0, 1).permute(1, 0)[2:].select(0, 1)
        a, b = torch.split(x.reshape(128), 64)
        return y.expand(4, 8), a, b, x.unbind(0)[0]

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 16))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert {operator.getitem, aten.view.default, aten.t.default, aten.split.Tensor} <= {
        n.target for n in calls}
    for node in gm.graph.nodes:
        assert cm.node_cost(node, SPEC) == cm.ZERO_COST, node.format_node()


def test_elementwise_is_memory_bound():
    gm = make_fx(lambda x, y: x + y, tracing_mode="fake")(torch.randn(1000), torch.randn(1000))
    (add,) = _nodes(gm, aten.add.Tensor)
    cost = cm.node_cost(add, SPEC)
    assert (cost.flops, cost.bytes) == (0, 12000)
    assert cost.seconds == pytest.approx(12000 / 1e10)


# --------------------------------------------------------------------------- collectives in graphs


def test_collective_node_cost(fake_pg):
    def f(shard, grad):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 8, fake_pg))
        rs = c10d.wait_tensor(c10d.reduce_scatter_tensor(grad, "sum", 8, fake_pg))
        ar = c10d.wait_tensor(c10d.all_reduce(grad, "sum", fake_pg))
        return full, rs, ar

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1000), torch.randn(8000))
    ag, = _nodes(gm, c10d.all_gather_into_tensor.default)
    rs, = _nodes(gm, c10d.reduce_scatter_tensor.default)
    ar, = _nodes(gm, c10d.all_reduce.default)
    for node, kind in ((ag, "all_gather"), (rs, "reduce_scatter"), (ar, "all_reduce")):
        cost = cm.collective_node_cost(node, SPEC)
        assert (cost.kind, cost.nbytes, cost.group_size) == (kind, 32000, 8)  # unsharded size
        assert cost.seconds == pytest.approx(cm.collective_time(kind, 32000, 8, SPEC))
        assert cm.node_cost(node, SPEC) == cm.ZERO_COST
    assert cm.collective_node_cost(ar, SPEC, world_size=2).group_size == 2
    assert cm.collective_node_cost(ar, SPEC, world_size={fake_pg: 4}).group_size == 4
    symbolic = cm.collective_node_cost(ag, SPEC, world_size=N, symbolic=True).seconds
    assert float(symbolic.subs(N, 8)) == pytest.approx(cm.collective_time("all_gather", 32000, 8,
                                                                          SPEC))
    with pytest.raises(ValueError, match="not a functional collective"):
        cm.collective_node_cost(next(iter(gm.graph.nodes)), SPEC)


def _prefetch_graphs(group):
    """Same work twice: the all-gather issued before an independent matmul, or waited at once."""
    def prefetched(shard, x, w):
        full = c10d.all_gather_into_tensor(shard, 8, group)
        y = x @ w
        return y, c10d.wait_tensor(full)

    def waited(shard, x, w):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 8, group))
        return x @ w, full

    args = (torch.randn(1024), torch.randn(128, 128), torch.randn(128, 128))
    return tuple(make_fx(f, tracing_mode="fake")(*args) for f in (prefetched, waited))


def test_prefetched_collective_is_hidden_waited_one_is_exposed(fake_pg):
    prefetched, waited = _prefetch_graphs(fake_pg)
    comm = cm.collective_time("all_gather", 8 * 1024 * 4, 8, SPEC)
    mm = 2 * 128 ** 3 / 1e9  # 4.2 ms of compute vs ~1 ms of comm
    assert mm > comm

    hidden = graph_estimate(prefetched, SPEC)
    (c,) = hidden.collectives
    assert c.dur_s == pytest.approx(comm) and c.issue_s == 0.0
    assert c.exposed_s < c.dur_s and c.exposed_s == pytest.approx(0.0)
    assert c.hidden_s == pytest.approx(comm)
    assert hidden.exposed_comm_s == pytest.approx(0.0)
    assert hidden.total_s == pytest.approx(mm)

    exposed = graph_estimate(waited, SPEC)
    (c,) = exposed.collectives
    assert c.exposed_s == pytest.approx(c.dur_s) and c.hidden_s == pytest.approx(0.0)
    assert exposed.exposed_comm_s == pytest.approx(comm)
    assert exposed.total_s == pytest.approx(mm + comm)
    assert [e.kind for e in exposed.events if e.lane == "compute"] == ["wait", "compute"]

    trace = exposed.chrome_trace()["traceEvents"]
    assert {e["name"] for e in trace} == {"all_gather_into_tensor", "wait_tensor", "mm"}
    assert all(e["dur"] > 0 for e in trace)
    # At world size 1 the collective is free; the graph is pure compute.
    assert graph_estimate(waited, SPEC, world_size=1).total_s == pytest.approx(mm)


def test_without_overlap_a_collective_takes_its_time_from_compute(fake_pg):
    """Where ranks fill every core (gloo on this CPU), a prefetched collective hides nothing."""
    import dataclasses

    prefetched, _ = _prefetch_graphs(fake_pg)
    comm = cm.collective_time("all_gather", 8 * 1024 * 4, 8, SPEC)
    mm = 2 * 128 ** 3 / 1e9
    serial = graph_estimate(prefetched, dataclasses.replace(SPEC, comm_overlaps_compute=False))
    assert serial.total_s == pytest.approx(mm + comm)
    assert serial.exposed_comm_s == pytest.approx(comm)
    with pytest.raises(ValueError, match="comm_overlaps_compute must be a bool"):
        dataclasses.replace(SPEC, comm_overlaps_compute=1)


def test_collectives_queue_on_one_comm_lane(fake_pg):
    def f(a, b):
        fa = c10d.all_gather_into_tensor(a, 8, fake_pg)
        fb = c10d.all_gather_into_tensor(b, 8, fake_pg)
        return c10d.wait_tensor(fa), c10d.wait_tensor(fb)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1024), torch.randn(1024))
    est = graph_estimate(gm, SPEC)
    first, second = est.collectives
    assert second.issue_s == 0.0 and second.start_s == pytest.approx(first.dur_s)
    assert est.total_s == pytest.approx(first.dur_s + second.dur_s)
    assert est.exposed_comm_s == pytest.approx(est.comm_s)


# --------------------------------------------------------------------------- memory


def test_peak_memory_hand_computed():
    def f(x):  # x: 1024 floats = 4096 B
        a = x * 2  # +4096                      live 4096
        b = a + 1  # +4096 -> 8192 (peak); a freed -> 4096
        return b.view(32, 32).sum()  # view free; sum +4, b freed

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1024))
    mem = memory_estimate(gm)
    assert (mem.placeholder_bytes, mem.peak_transient_bytes, mem.peak_bytes) == (4096, 8192, 12288)
    assert mem.peak_node == "add"
    assert graph_estimate(gm, SPEC).peak_memory_bytes == 12288


def test_peak_memory_views_and_waits_alias(fake_pg):
    def f(x, shard):
        y = x * 2  # 4096
        lo, hi = torch.split(y, 512)  # views of y
        z = lo + hi  # +2048 -> 6144; y freed
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 8, fake_pg))  # +8*400
        return z, full.view(8, 100)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1024), torch.randn(100))
    mem = memory_estimate(gm)
    assert mem.placeholder_bytes == 4096 + 400
    assert mem.peak_transient_bytes == 6144
    assert mem.peak_node == "add"


def test_a_collective_holds_its_input_until_its_wait(fake_pg):
    def f(x):
        send = x * 2  # 4096, read by the exchange until it completes
        exchanged = c10d.all_to_all_single(send, [128] * 8, [128] * 8, fake_pg)  # +4096
        y = x + 1  # +4096 while send and the exchange are in flight -> 12288 (peak)
        return c10d.wait_tensor(exchanged), y  # send freed here, not at the exchange

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1024))
    (exchange,) = _nodes(gm, c10d.all_to_all_single.default)
    exchange.meta[meta_keys.LOWERED_FROM] = "all_gather"  # as the transport stage marks it
    mem = memory_estimate(gm)
    assert mem.peak_transient_bytes == 3 * 4096 and mem.peak_node == "add"


# --------------------------------------------------------------------------- theory


def test_theoretical_comm_bytes_formulas():
    p = 1000
    fs = theoretical_comm_bytes("full_shard", p, N)
    assert sympy.simplify(fs["total"] - 3 * p * (N - 1) / N) == 0
    assert fs["all_reduce"] == 0
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        sym = theoretical_comm_bytes(strategy, p, N)
        num = theoretical_comm_bytes(strategy, p, 8)
        for key in ("all_gather", "reduce_scatter", "all_reduce", "total"):
            assert float(sympy.sympify(sym[key]).subs(N, 8)) == pytest.approx(num[key])
    assert theoretical_comm_bytes("shard_grad_op", p, 2) == {
        "all_gather": 500.0, "reduce_scatter": 500.0, "all_reduce": 0.0, "total": 1000.0}
    assert theoretical_comm_bytes("no_shard", p, 4)["all_reduce"] == 1500.0
    assert theoretical_comm_bytes("hybrid_shard", p, 16, shard_size=4) == {
        "all_gather": 1500.0, "reduce_scatter": 750.0, "all_reduce": 375.0, "total": 2625.0}
    assert theoretical_comm_bytes("full_shard", p, 2, trainable_bytes=400) == {
        "all_gather": 1000.0, "reduce_scatter": 200.0, "all_reduce": 0.0, "total": 1200.0}
    s = sympy.Symbol("S", positive=True, integer=True)
    hy = theoretical_comm_bytes("hybrid_shard", p, N, shard_size=s)
    assert float(hy["total"].subs({N: 16, s: 4})) == pytest.approx(2625.0)


def test_theoretical_comm_bytes_errors():
    with pytest.raises(ValueError, match="unknown strategy 'zero2'.*full_shard"):
        theoretical_comm_bytes("zero2", 1, 2)
    with pytest.raises(ValueError, match="shard_size"):
        theoretical_comm_bytes("hybrid_shard", 1, 8)
    with pytest.raises(ValueError, match="divide"):
        theoretical_comm_bytes("hybrid_shard", 1, 8, shard_size=3)


# --------------------------------------------------------------------------- calibration


def test_fit_alpha_beta_recovers_line():
    alpha, bw = 2e-4, 5e8
    samples = [(b, alpha + 0.5 * b / bw) for b in (1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    fit = cm.fit_alpha_beta(samples, world_size=2)
    assert fit == pytest.approx((alpha, bw), rel=1e-6)
    with pytest.raises(ValueError, match="two or more"):
        cm.fit_alpha_beta([(1024, 1e-3)], world_size=2)


@pytest.mark.slow
def test_calibrate_two_gloo_processes(tmp_path):
    samples = []
    # sizes far apart (1 KiB, 8 MiB): on a shared, noisy machine 1 MiB can time like 1 KiB
    spec = calibration.calibrate(world_size=2, sizes=(1 << 10, 1 << 23), repeats=5, samples=samples)
    assert [b for b, _ in samples] == [1 << 10, 1 << 23]
    for name in ("latency_s", "bandwidth_Bps", "flops_per_s", "memory_bandwidth_Bps",
                 "kernel_overhead_s", "low_precision_flops_per_s", "step_overhead_s",
                 "device_memory_bytes", "all_reduce_latency_s", "all_reduce_bandwidth_Bps",
                 "skew_after_1ms_s", "shared_core_skew_after_1ms_s"):
        assert getattr(spec, name) > 0, name
    assert len(spec.attention_flops) == len(calibration.ATTENTION_SHAPES)
    # every elementwise family timed in Inductor's code; a power costs more than a multiply-add
    rates = dict(spec.elementwise_s)
    assert set(rates) == set(calibration._ELEMENTWISE_CHAINS)
    assert rates["pow"] > rates["arith"] > 0
    # two ranks on two cores: compute fills them, gloo's threads cannot run beside it
    cores = __import__("os").cpu_count() or 1
    assert spec.comm_overlaps_compute == (cores > 2)
    # each of the two ranks computes on cores // 2 threads: cores // (cores // 2) at full speed
    assert spec.compute_slots_per_node == cores // max(1, cores // 2)
    spec.to_json(tmp_path / "spec.json")
    assert ClusterSpec.from_json(tmp_path / "spec.json") == spec


def test_calibrate_cli(tmp_path, monkeypatch, capsys):
    def fake_calibrate(world_size, repeats, samples, rounds):
        assert rounds == 3  # the default: a median over three whole measurements
        samples.extend([(1024, 0.36e-3), (4 << 20, 3e-3)])
        return measured

    # every kind of field a calibration fills: numbers, flags, rows of numbers, named rows
    measured = dataclasses.replace(ClusterSpec.default(), attention_flops=((2048.0, 1e10, 2e9),),
                                   elementwise_s=(("pow", 2.8e-9), ("arith", 5e-11)))
    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    out = tmp_path / "machine.json"
    assert calibration.main(["--world-size", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "latency_s" in printed and "measured ms" in printed and str(out) in printed
    assert "(pow, 2.8e-09)" in printed
    assert ClusterSpec.from_json(out) == measured
    with pytest.raises(SystemExit):
        calibration.main(["--world-size", "1"])
    with pytest.raises(SystemExit):
        calibration.main(["--rounds", "0"])


def test_calibration_rounds_keep_each_measured_parameters_median():
    """One round's numbers move from minute to minute on a shared machine: each measured
    number is the median of the rounds', attention rates row by row; flags and counts stay."""
    rounds = [dataclasses.replace(ClusterSpec.default(), latency_s=latency, flops_per_s=flops,
                                  comm_overlaps_compute=False, compute_slots_per_node=2,
                                  attention_flops=((2048, fp32, 2 * fp32), (8192, 3 * fp32, fp32)),
                                  elementwise_s=(("arith", fp32 * 1e-21), ("pow", fp32 * 1e-19)))
              for latency, flops, fp32 in ((1e-3, 9e10, 4e10), (3e-4, 8e10, 6e10),
                                           (4e-4, 1.2e11, 5e10))]
    spec = calibration.median_spec(rounds)
    assert (spec.latency_s, spec.flops_per_s) == (4e-4, 9e10)
    assert spec.attention_flops == ((2048, 5e10, 1e11), (8192, 1.5e11, 5e10))
    rates = dict(spec.elementwise_s)
    assert list(rates) == ["arith", "pow"]
    assert (rates["arith"], rates["pow"]) == pytest.approx((5e-11, 5e-9))
    with pytest.raises(ValueError, match="different elementwise families"):
        calibration.median_spec([rounds[0], dataclasses.replace(rounds[1], elementwise_s=(("pow", 1e-9),))])
    assert spec.bandwidth_Bps == ClusterSpec.default().bandwidth_Bps  # alike in every round
    assert (spec.comm_overlaps_compute, spec.compute_slots_per_node) == (False, 2)
    assert calibration.median_spec(rounds[:1]) == rounds[0]


def test_float8_matmuls_run_at_the_float8_peak_where_the_machine_has_one():
    from graphshard.compiler.clusters import PRESETS

    h100, a100 = PRESETS["h100"], PRESETS["a100"]
    assert h100.peak_flops(torch.float8_e4m3fn) == h100.float8_flops_per_s == 1979e12
    assert a100.peak_flops(torch.float8_e4m3fn) == a100.low_precision_flops_per_s  # no float8 cores
    assert h100.shared_by(16).float8_flops_per_s == h100.float8_flops_per_s  # one rank a GPU


# --------------------------------------------------------------------------- calibrated terms


def test_a_collective_after_compute_waits_for_the_slowest_rank_once(fake_pg):
    """The ranks drift apart while they compute: the first collective after compute pays the
    skew (growing as the root of the compute), the one queued right behind it does not."""
    import dataclasses

    def f(x, w, a, b):
        y = x @ w
        fa = c10d.all_gather_into_tensor(a, 8, fake_pg)
        fb = c10d.all_gather_into_tensor(b, 8, fake_pg)
        return y, c10d.wait_tensor(fa), c10d.wait_tensor(fb)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(128, 128), torch.randn(128, 128),
                                         torch.randn(1024), torch.randn(1024))
    spec = dataclasses.replace(SPEC, comm_overlaps_compute=False, skew_after_1ms_s=1e-3)
    comm = cm.collective_time("all_gather", 8 * 1024 * 4, 8, spec)
    mm = 2 * 128 ** 3 / 1e9
    skew = 1e-3 * (mm / 1e-3) ** 0.5
    first, second = graph_estimate(gm, spec).collectives
    assert first.dur_s == pytest.approx(comm + skew) and second.dur_s == pytest.approx(comm)
    assert graph_estimate(gm, spec).total_s == pytest.approx(mm + 2 * comm + skew)
    assert graph_estimate(gm, spec, world_size=1).total_s == pytest.approx(mm)  # no collective
    # ranks taking turns on shared cores drift by the shared cores' skew
    cpu = dataclasses.replace(spec, compute_slots_per_node=2, shared_core_skew_after_1ms_s=3e-3)
    assert cpu.shared_by(2).skew_after_1ms_s == 1e-3 and cpu.shared_by(3).skew_after_1ms_s == 3e-3


def test_fit_skew_recovers_a_square_root_law():
    samples = [(c, 4e-4 * (c / 1e-3) ** 0.5) for c in calibration.SKEW_CHUNKS_S]
    assert calibration.fit_skew(samples) == pytest.approx(4e-4)


def test_skew_samples_keep_the_expected_wait_without_the_bursts():
    """A step adds up its waits: the mean, not the median, of a long-tailed wait; a tenth of
    the samples at either end is load from elsewhere."""
    waits = [1.0] * 14 + [4.0] * 5 + [100.0]
    assert statistics.median(waits) == 1.0
    assert calibration._trimmed_mean(waits) == pytest.approx((12 * 1.0 + 4 * 4.0) / 16)


def test_all_reduce_has_its_own_alpha_beta_within_a_node():
    import dataclasses

    spec = dataclasses.replace(SPEC, all_reduce_latency_s=5e-3, all_reduce_bandwidth_Bps=5e8,
                               inter_node_latency_s=2e-3, inter_node_bandwidth_Bps=1e8)
    nbytes = 1 << 20
    assert cm.collective_time("all_reduce", nbytes, 2, spec) == pytest.approx(5e-3 + nbytes / 5e8)
    # the other kinds keep the all-gather's; between nodes every kind pays the inter-node link
    assert cm.collective_time("all_gather", nbytes, 2, spec) == pytest.approx(1e-3 + nbytes / 2 / 1e9)
    assert cm.collective_time("all_reduce", nbytes, 2, spec.link(spans_nodes=True)) == \
        pytest.approx(2e-3 + nbytes / 1e8)
    fitted = cm.fit_alpha_beta([(b, cm.collective_time("all_reduce", b, 4, spec))
                                for b in (1 << 10, 1 << 24)], world_size=4, kind="all_reduce")
    assert fitted == pytest.approx((5e-3, 5e8), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_is_counted_and_priced_at_the_calibrated_attention_rate(dtype):
    """The CPU's fused attention has no entry in torch's FLOP registry: its FLOPs are counted
    here, and priced at the machine's attention rate for its sequence x head_dim and dtype."""
    import dataclasses
    from torch.utils.flop_counter import sdpa_flop_count

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    shape = (2, 4, 64, 32)  # sequence x head_dim = 2048
    gm = make_fx(f, tracing_mode="fake")(*(torch.randn(shape, dtype=dtype) for _ in range(3)))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"
               and getattr(n.target, "overloadpacket", None) in cm.ATTENTION_OPS]
    flops = sdpa_flop_count(shape, shape, shape)
    rows = ((1024, 4e10, 1e10), (4096, 8e10, 4e10))  # the rate at 2048: half-way in log size
    spec = dataclasses.replace(SPEC, flops_per_s=1e12, low_precision_flops_per_s=1e12,
                               memory_bandwidth_Bps=1e15, attention_flops=rows)
    rate = 6e10 if dtype == torch.float32 else 2.5e10
    cost = cm.node_cost(node, spec)
    assert cost.flops == flops and cost.seconds == pytest.approx(flops / rate)
    # without attention rates it runs at the matmul peak
    assert cm.node_cost(node, dataclasses.replace(spec, attention_flops=())).seconds == \
        pytest.approx(flops / 1e12)
    # rows round-trip through JSON; a malformed row is refused by name
    assert ClusterSpec.from_json(json.loads(spec.to_json())) == spec
    with pytest.raises(ValueError, match="attention_flops must be rows"):
        dataclasses.replace(spec, attention_flops=((1024, 4e10),))
