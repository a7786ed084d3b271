"""The planner's search: it leaves out only layouts that could not have ranked first.

Each test sets a staged search (`graphshard.tools.plan.plan`) beside an exhaustive one over the
same space, on small models and preset clusters (one process, fake process groups): hybrid shard
groups and no_shard tried around the best full_shard layouts, the matmul bound across dtypes,
larger micro-batches and lighter checkpointing outrunning the rest, the twin's compute as a
floor, and what the device memory leaves out. The planner's CLI and output: tests/test_plan.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from graphshard.compiler.clusters import PRESETS
from graphshard.tools import plan as planner


@pytest.fixture(autouse=True, scope="module")
def captures_once():
    """Each capture job once per module: a staged search beside its exhaustive twin asks for
    layouts the twin has captured (the same model, layout, knobs and cluster: the same
    probes). Which layouts a search asks for is what these tests check, and that is unchanged.
    The searches here run in this process (workers=1) and read the probes without changing them."""
    from graphshard.tools.plan import search

    done: dict = {}
    capture_job = search.capture_job

    def once(job: tuple):
        *head, model_args = job
        key = (*head, tuple(sorted(model_args.items())))
        if key not in done:
            done[key] = capture_job(job)
        return done[key]

    search.capture_job = once
    yield
    search.capture_job = capture_job


@pytest.mark.slow  # two searches
def test_hybrid_groups_are_tried_around_the_best_full_shard_layouts(monkeypatch):
    """Every full_shard layout is captured but those a captured one outruns; hybrid shard
    groups only for the best of them (TP degree, AC, dtype, micro-batch; the best one here,
    three by default): the same best as the exhaustive search on this cluster."""
    from graphshard.tools.plan import search

    monkeypatch.setattr(search, "HYBRID_TRIED_FOR", 1)
    args = dict(model_args={"dim": 128}, ac_modes=("none",), dtypes=("bfloat16",),
                knobs=(planner.Knobs("last", 1, 64.0),), tp_sizes=(1, 2),
                strategies=("full_shard", "hybrid_shard"))
    staged = planner.plan("llama", 16, PRESETS["h100"], 16, 32, **args)  # it has a TP plan
    every = planner.plan("llama", 16, PRESETS["h100"], 16, 32, exhaustive=True, **args)
    tried = {c.layout for c in staged}
    full = {layout for layout in (c.layout for c in every) if layout.strategy == "full_shard"}
    hybrid = {c.layout for c in every} - full
    assert len(full) == 3 and len(hybrid) == 3  # TP 1; TP 2 at micro 2, 1
    fastest = {layout: min(c.step_s for c in every if c.layout == layout) for layout in full}
    assert all(fastest[layout] >= staged[0].step_s for layout in full - tried)
    best = search.best_layouts([c for c in staged if c.layout.strategy == "full_shard"], 1)
    assert {(layout.tp, layout.ac, layout.param_dtype, layout.micro_batch)
            for layout in tried - full} == best and len(tried - full) == 1
    assert (staged[0].layout, staged[0].step_s) == (every[0].layout, every[0].step_s)


@pytest.mark.slow  # three searches
def test_layouts_whose_matmuls_alone_outlast_the_best_step_are_not_captured():
    """Dtypes are searched fastest matmuls first; a slower dtype's layouts are captured only
    where their matmul FLOPs at its peak could still beat the best step found. On a cluster
    whose fp32 matmuls are 1000x slower, the fp32 layouts are left out, with the exhaustive
    search's best, and each is slower there than that best; at the real fp32 peak this small
    model's steps are overhead and traffic, so its fp32 layouts are captured. Checkpointed
    fp32 layouts are left out by the FLOPs without checkpointing (recomputation only adds),
    though no checkpointed layout was captured to count their own."""
    h100 = PRESETS["h100"]
    slow_fp32 = dataclasses.replace(h100, flops_per_s=h100.flops_per_s / 1000)
    args = dict(model_args={"dim": 128}, ac_modes=("none", "full"), dtypes=("bfloat16", "float32"),
                knobs=(planner.Knobs("last", 1, 64.0),), tp_sizes=(1,),
                strategies=("full_shard",))
    staged = planner.plan("llama", 8, slow_fp32, 8, 32, **args)
    every = planner.plan("llama", 8, slow_fp32, 8, 32, exhaustive=True, **args)
    assert {c.layout.param_dtype for c in staged} == {"bfloat16"}
    assert {c.layout.ac for c in staged} == {"none"}  # "full" outrun: its FLOPs never counted
    left_out = [c for c in every if c.layout.param_dtype == "float32"]
    assert left_out and min(c.step_s for c in left_out) > staged[0].step_s
    assert (staged[0].layout, staged[0].step_s) == (every[0].layout, every[0].step_s)
    assert {c.layout.param_dtype for c in planner.plan("llama", 8, h100, 8, 32, **args)} == {
        "bfloat16", "float32"}


@pytest.mark.slow  # three searches
def test_smaller_micro_batches_and_heavier_checkpointing_are_captured_only_while_they_could_win():
    """A layout's larger micro-batch or lighter checkpointing is never slower (checked here on
    every layout of the exhaustive search); the search captures the fastest of each family
    first and the others only while they could beat the best step found: the exhaustive
    search's best with fewer captures, and, once the device memory leaves out the largest
    micro-batch without checkpointing, the next fastest that fits is captured and ranks first."""
    from graphshard.tools.plan import search

    args = dict(model_args={"dim": 128}, ac_modes=("none", "full"), dtypes=("bfloat16",),
                knobs=(planner.Knobs("last", 1, 64.0),), tp_sizes=(1,),
                strategies=("full_shard",))
    h100 = PRESETS["h100"]
    every = planner.plan("llama", 8, h100, 32, 32, exhaustive=True, **args)
    fastest = {c.layout: c.step_s for c in every}  # one option set: one row per layout
    assert len(fastest) == 6  # micro-batches 4, 2, 1 x AC none, full
    for layout, step in fastest.items():
        for other in search._outrunners(layout, set(fastest)):
            assert step >= fastest[other] * (1 - 1e-9), (layout, other)
    staged = planner.plan("llama", 8, h100, 32, 32, **args)
    assert (staged[0].layout, staged[0].step_s) == (every[0].layout, every[0].step_s)
    tried = {c.layout for c in staged}
    assert len(tried) < len(fastest)

    # Only the fastest of the family is captured while it fits; once the device memory leaves
    # it out, the layouts it outran are captured and the fastest of them that fits ranks first.
    assert tried == {every[0].layout}
    peak = {c.layout: c.peak_memory_bytes for c in every}
    tight = dataclasses.replace(h100, device_memory_bytes=peak[every[0].layout] * (1 - 1e-6))
    fitting = min((c for c in every if c.peak_memory_bytes <= tight.device_memory_bytes),
                  key=lambda c: c.step_s)
    staged = planner.plan("llama", 8, tight, 32, 32, **args)
    assert staged[0].fits and staged[0].layout == fitting.layout != every[0].layout
    assert staged[0].step_s == pytest.approx(fitting.step_s)


@pytest.mark.slow  # three searches
def test_no_shard_is_tried_as_a_twin_of_the_best_full_shard_layouts_where_it_fits():
    """no_shard (DDP's layout) holds every parameter and its optimizer state whole and moves
    shard_grad_op's bytes, in all-reduces (fp32 here: the planner's fp32 layouts), and
    nothing is gathered: one row per bucket size. The search tries it beside the best full_shard
    layouts, as it tries hybrid groups, with the exhaustive search's best; where the device
    memory leaves it out, the best that fits ranks first."""
    args = dict(model_args={"dim": 128}, ac_modes=("none",), dtypes=("float32",),
                knobs=(planner.Knobs("last", 1, 64.0), planner.Knobs("all", 1, 64.0)),
                tp_sizes=(1,))
    h100 = PRESETS["h100"]
    every = planner.plan("llama", 8, h100, 8, 32, exhaustive=True, **args)
    by_layout = {(c.layout.strategy, c.layout.ac, c.knobs.keep): c for c in every}
    assert set(by_layout) == {("full_shard", "none", "last"), ("full_shard", "none", "all"),
                              ("no_shard", "none", "last")}
    ddp, grad_op = by_layout[("no_shard", "none", "last")], by_layout[("full_shard", "none", "all")]
    assert ddp.comm_bytes == pytest.approx(grad_op.comm_bytes, rel=0.02)
    assert ddp.peak_memory_bytes > grad_op.peak_memory_bytes
    staged = planner.plan("llama", 8, h100, 8, 32, **args)
    assert "no_shard" in {c.layout.strategy for c in staged}
    assert (staged[0].layout, staged[0].step_s) == (every[0].layout, every[0].step_s)

    no_shard_peak = min(c.peak_memory_bytes for c in every if c.layout.strategy == "no_shard")
    tight = dataclasses.replace(h100, device_memory_bytes=no_shard_peak * (1 - 1e-6))
    fitting = min((c for c in every if c.peak_memory_bytes <= tight.device_memory_bytes),
                  key=lambda c: c.step_s)
    staged = planner.plan("llama", 8, tight, 8, 32, **args)
    assert not any(c.fits for c in staged if c.layout.strategy == "no_shard")
    assert (staged[0].layout, staged[0].knobs) == (fitting.layout, fitting.knobs)
    assert staged[0].step_s == pytest.approx(fitting.step_s)
    # A device that cannot hold the parameters and AdamW state whole: no_shard not captured
    from graphshard.tools.plan.search import NO_SHARD_STATE_BYTES

    small = dataclasses.replace(h100, device_memory_bytes=(
        every[0].trainable_params * NO_SHARD_STATE_BYTES * (1 - 1e-6)))
    assert fitting.peak_memory_bytes <= small.device_memory_bytes
    staged = planner.plan("llama", 8, small, 8, 32, **args)
    assert {c.layout.strategy for c in staged} == {"full_shard"} and staged[0].fits


@pytest.mark.slow  # three searches
def test_hybrid_layouts_that_the_best_outran_are_captured_where_the_faster_does_not_fit():
    """A hybrid layout holds more memory than its full_shard twin: where the hybrid layout of
    a best full_shard key does not fit, the hybrid layouts it outran (heavier checkpointing
    here) are captured too, and the search's best is the exhaustive search's."""
    args = dict(model_args={"dim": 128}, ac_modes=("none", "full"), dtypes=("bfloat16",),
                knobs=(planner.Knobs("last", 1, 64.0),), tp_sizes=(1,),
                strategies=("full_shard", "hybrid_shard"))
    h100 = PRESETS["h100"]
    every = planner.plan("llama", 16, h100, 16, 32, exhaustive=True, **args)
    peak = {(c.layout.strategy, c.layout.ac): c.peak_memory_bytes for c in every}
    assert len(peak) == 4  # full_shard, hybrid 2 x 8; AC none, full
    hybrid_full = next(c.layout for c in every if c.layout.strategy == "hybrid_shard"
                       and c.layout.ac == "full")
    roomy = {c.layout for c in planner.plan("llama", 16, h100, 16, 32, **args)}
    assert hybrid_full not in roomy
    # room for every layout but the hybrid one without checkpointing
    limit = peak[("hybrid_shard", "none")] * (1 - 1e-6)
    assert max(v for k, v in peak.items() if k != ("hybrid_shard", "none")) <= limit
    tight = dataclasses.replace(h100, device_memory_bytes=limit)
    staged = planner.plan("llama", 16, tight, 16, 32, **args)
    assert hybrid_full in {c.layout for c in staged}
    fitting = min((c for c in every if c.peak_memory_bytes <= limit), key=lambda c: c.step_s)
    assert (staged[0].layout, staged[0].step_s) == (fitting.layout, pytest.approx(fitting.step_s))


@pytest.mark.slow  # two searches
def test_hybrid_layouts_whose_twin_computes_longer_than_the_best_step_are_not_captured():
    """The model's own compute is the same in a hybrid layout and its full_shard twin (checked
    on an exhaustive search over 24 devices, where the twin pads the rows 24 ranks do not
    divide and hybrid groups of 8 pad others); hybrid groups are captured least compute first,
    and the rest only while that compute could still beat the best step found. Here fp32 steps
    faster than bf16 (this small model's casts cost more than its matmuls save): the bf16
    hybrid layout, whose twin's model computes longer than the fp32 best step, is left out,
    with the exhaustive search's best."""
    from graphshard.tools.plan import search

    args = dict(model_args={"dim": 128}, ac_modes=("none",), dtypes=("bfloat16", "float32"),
                knobs=(planner.Knobs("last", 1, 64.0),), tp_sizes=(1,),
                strategies=("full_shard", "hybrid_shard"))
    h100 = PRESETS["h100"]
    every = planner.plan("llama", 24, h100, 24, 32, exhaustive=True, **args)
    twin = {c.layout.param_dtype: c.model_compute_s for c in every
            if c.layout.strategy == "full_shard"}
    hybrid = [c for c in every if c.layout.strategy == "hybrid_shard"]
    assert len(hybrid) == 2 and len(twin) == 2  # one layout per strategy and dtype
    for config in hybrid:
        assert config.model_compute_s == pytest.approx(twin[config.layout.param_dtype], rel=1e-9)
        assert config.step_s > config.model_compute_s
    staged = planner.plan("llama", 24, h100, 24, 32, **args)
    assert (staged[0].layout, staged[0].step_s) == (every[0].layout, every[0].step_s)
    left_out = {c.layout for c in hybrid} - {c.layout for c in staged}
    assert [layout.param_dtype for layout in left_out] == ["bfloat16"], left_out
    for layout in left_out:
        assert search.compute_floor(layout, staged) >= staged[0].step_s
        assert min(c.step_s for c in every if c.layout == layout) >= staged[0].step_s


def test_no_shard_is_left_out_where_its_state_alone_exceeds_the_device_memory():
    """The bound needs no capture: the parameters any capture counted, their fp32 master and
    AdamW's two moments (12 bytes each) over the TP degree, whole on every device."""
    from types import SimpleNamespace

    from graphshard.tools.plan.search import NO_SHARD_STATE_BYTES, _not_oversized

    stage = planner.layouts(8, 8, 8, ("none",), ("bfloat16",), tp_sizes=(1, 2))
    captured = [SimpleNamespace(trainable_params=1e9)]  # a full_shard capture's count
    state = 1e9 * NO_SHARD_STATE_BYTES
    between = dataclasses.replace(PRESETS["h100"], device_memory_bytes=0.75 * state)
    kept = _not_oversized(stage, captured, between)
    assert {(layout.strategy, layout.tp) for layout in stage if layout not in kept} == {
        ("no_shard", 1)}  # TP 2 halves the state: 0.5 of it fits in 0.75
    assert _not_oversized(stage, [], between) == stage  # nothing captured yet: nothing known
