"""The search: every layout captured (in a process pool), every option set estimated on each,
"auto" added where it is neither the default nor "all", ranked best first."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

from graphshard.tools.plan.auto import auto_config
from graphshard.tools.plan.capture import capture_job, capture_probes
from graphshard.tools.plan.config import Config, finish, matmul_peak
from graphshard.tools.plan.pool import capture_pool
from graphshard.tools.plan.space import (KNOBS, STRATEGIES, TP_DEGREES, Knobs, Layout, PlanError,
                                         knobs_for, layouts, rank_batch, tp_degrees)
from graphshard.tools.plan.target import at_depth, check_factory_takes_shape, depth_probes


def as_ranks_see_it(cluster, devices: int):
    """The cluster as each rank sees it when `devices` ranks fill its nodes (ranks beyond a
    node's compute slots share them)."""
    return cluster.shared_by(min(devices, cluster.devices_per_node or devices))


def predict(target: str, devices: int, cluster, global_batch: int, seq: int, layout: Layout,
            knobs: Knobs, model_args: dict | None = None) -> Config:
    """One configuration's prediction, as `plan` makes it (the fidelity bench compares it with
    a measurement)."""
    model_args = dict(model_args or {})
    check_factory_takes_shape(target)
    cluster = as_ranks_see_it(cluster, devices)
    depth, probe_sizes = depth_probes(target, model_args)
    knob = dataclasses.replace(knobs, keep="last") if knobs.keep == "auto" else knobs
    captured = [capture_probes(target, layout, devices, seq, n, (knob,), cluster, model_args)
                for n in probe_sizes]
    return finish(layout, knobs, at_depth(captured, probe_sizes, depth, knob),
                  accumulation=rank_batch(global_batch, devices, layout.tp) // layout.micro_batch,
                  cluster=cluster,
                  devices=devices, tokens=global_batch * seq)


def check_plan_input(devices: int, cluster, global_batch: int) -> None:
    if devices < 1:
        raise PlanError(f"--devices must be at least 1, got {devices}")
    node = cluster.devices_per_node
    if node and devices > node and devices % node:
        raise PlanError(f"--devices {devices} is not a whole number of nodes of {node} devices: "
                        f"use at most {node} or a multiple of {node}")
    if global_batch < 1:
        raise PlanError(f"--global-batch must be at least 1, got {global_batch}")


def plan(target: str, devices: int, cluster, global_batch: int, seq: int, *,
         model_args: dict | None = None, ac_modes: Sequence[str] = ("none", "full", "selective"),
         dtypes: Sequence[str] = ("bfloat16", "float32"), knobs: Sequence[Knobs] = KNOBS,
         tp_sizes: Sequence[int] = TP_DEGREES, strategies: Sequence[str] = STRATEGIES,
         workers: int = 1,
         progress: Callable[[str], None] = lambda message: None,
         exhaustive: bool = False) -> list[Config]:
    """The configurations, best first (fitting ones by step time, then the rest by peak).

    The full_shard layouts, each left out where it cannot beat the best step found
    (`_not_beaten`, `_not_outrun`), then hybrid shard groups and no_shard (DDP's layout) only
    for the best `HYBRID_TRIED_FOR` of those (their TP degree, checkpointing, dtype and
    micro-batch) and the layouts those outran, the least compute first and left out likewise
    (and by `_not_outcomputed`): both trade memory for traffic around a layout that already
    fits and runs fast, and hybrid groups are most of the layouts on a cluster of many nodes.
    `exhaustive`: every layout."""
    model_args = dict(model_args or {})
    check_plan_input(devices, cluster, global_batch)
    if "float8" in dtypes and cluster.float8_flops_per_s is None:
        raise PlanError("--dtypes float8: this cluster has no float8 matmul peak "
                        "(float8_flops_per_s): float8 training pays on float8 tensor cores (the "
                        "h100 preset); add float8_flops_per_s to a cluster JSON to plan it")
    check_factory_takes_shape(target)
    cluster = as_ranks_see_it(cluster, devices)
    depth, probe_sizes = depth_probes(target, model_args)
    if depth is None:
        ac_modes = ("none",)  # no repeated blocks to checkpoint
    tokens = global_batch * seq
    wanted = tp_sizes
    tp_sizes = tp_degrees(devices, cluster.devices_per_node, global_batch, wanted)
    if not tp_sizes:
        raise PlanError(
            f"--global-batch {global_batch} divides over no data-parallel size of {devices} "
            f"devices with TP degrees {list(wanted)} (each data-parallel rank, devices / tp of "
            "them, trains an equal share): use a multiple of the device count")
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies:
        raise PlanError(f"--strategies takes {', '.join(STRATEGIES)}, comma-separated "
                        "(shard_grad_op is full_shard keeping every unit gathered: searched with "
                        f"full_shard); got {','.join(strategies)!r}")
    candidates = layouts(devices, cluster.devices_per_node, global_batch, ac_modes, dtypes,
                         tp_sizes, strategies)
    if not candidates:
        raise PlanError(f"--strategies {','.join(strategies)}: no such layout on {devices} "
                        "devices (hybrid_shard needs several nodes' worth of devices, no_shard "
                        "more than one data-parallel rank)")
    # hybrid shard groups and no_shard: full_shard's twins that hold more, to move less; with
    # no full_shard to stage them on, they are the first stage themselves
    twins = "full_shard" in strategies
    replicated = [layout for layout in candidates if layout.strategy != "full_shard"]
    first = candidates if exhaustive or not twins else [
        c for c in candidates if c.strategy == "full_shard"]
    configs: list[Config] = []
    skipped: list[str] = []  # why a layout could not be captured (its TP degree)
    step_flops: dict[tuple, float] = {}  # (tp, ac): one device's matmul FLOPs in a step
    started, captures = time.perf_counter(), [0]

    def evaluate(stages: list[list[Layout]]) -> None:
        """Capture the stages in order, each in waves, leaving out what cannot win."""
        if exhaustive:
            capture([layout for stage in stages for layout in stage])
            return
        left_out = {"oversized": 0, "beaten": 0, "outcomputed": 0, "outrun": 0}  # by each bound
        for stage in stages:
            for wave in waves(stage):  # the fastest of each family first, then what could win
                fitting = _not_oversized(wave, configs, cluster)
                fast_enough = _not_beaten(fitting, configs, step_flops, cluster)
                computed = _not_outcomputed(fast_enough, configs)
                kept = _not_outrun(computed, configs)
                left_out["oversized"] += len(wave) - len(fitting)
                left_out["beaten"] += len(fitting) - len(fast_enough)
                left_out["outcomputed"] += len(fast_enough) - len(computed)
                left_out["outrun"] += len(computed) - len(kept)
                capture(kept)
        why = {"oversized": "by their parameters and AdamW state alone, whole on every device",
               "beaten": "by their matmuls alone at their dtype's peak",
               "outcomputed": "by their full_shard twin's model compute alone",
               "outrun": "by a larger micro-batch or lighter checkpointing of theirs"}
        reasons = [f"{count} {why[bound]}" for bound, count in left_out.items() if count]
        if reasons:
            progress(f"{sum(left_out.values())} layouts left out, none able to fit and beat the "
                     f"best step found ({_best_step(configs) * 1e3:,.1f} ms): {', '.join(reasons)} "
                     "(--exhaustive captures them)")

    def capture(stage: list[Layout]) -> None:
        jobs = [(target, layout, devices, seq, n, knobs_for(layout, knobs), cluster, model_args)
                for layout in stage for n in probe_sizes]
        results = iter(pool.map(capture_job, jobs))
        for layout in stage:
            captured = [next(results) for _ in probe_sizes]
            captures[0] += 1
            done = f"[{time.perf_counter() - started:5.1f} s] layout {captures[0]}"
            unsplittable = next((c for c in captured if isinstance(c, str)), None)
            if unsplittable is not None:
                if unsplittable not in skipped:  # each reason once (it repeats per layout)
                    progress(f"{done} skipped: {unsplittable}")
                skipped.append(unsplittable)
                continue
            progress(f"{done} done: {layout}")
            at = functools.partial(at_depth, captured, probe_sizes, depth)
            share = rank_batch(global_batch, devices, layout.tp)  # a data-parallel rank's
            finish_layout = functools.partial(finish, accumulation=share // layout.micro_batch,
                                              cluster=cluster, devices=devices, tokens=tokens)
            for knob in knobs_for(layout, knobs):
                probe = at(knob)
                step = probe.flops * (share // layout.micro_batch)  # every micro-batch's
                step_flops[(layout.tp, layout.ac)] = min(
                    step, step_flops.get((layout.tp, layout.ac), float("inf")))
                configs.append(finish_layout(layout, knob, probe))
                if knob.keep == "last" and depth:
                    auto = auto_config(layout, at, depth, knob, finish_layout,
                                       cluster.device_memory_bytes)
                    if auto is not None:
                        configs.append(auto)

    progress(f"up to {len(first)} {'' if exhaustive or not twins else 'full_shard '}layouts x "
             f"{len(probe_sizes)} captures, {len(knobs)} option sets each, on {workers} process(es)")
    with capture_pool(workers) as pool:
        # the dtypes with the fastest matmuls first: a slower dtype's layouts are captured
        # only where their matmuls alone could still beat the best step found
        for peak in sorted({matmul_peak(layout, cluster) for layout in first}, reverse=True):
            evaluate([[layout for layout in first if matmul_peak(layout, cluster) == peak]])
        if replicated and twins and not exhaustive:
            best = best_layouts(configs, HYBRID_TRIED_FOR)
            # and what those outran: a hybrid or no_shard layout holds more memory than its
            # full_shard twin, so where the faster one does not fit, the slower one may win
            second = [layout for layout in replicated
                      if any(_outruns(key, _but_strategy(layout)) for key in best)]
            progress(f"hybrid shard groups and no_shard for the best {len(best)} full_shard "
                     f"layouts and the layouts they outran: up to {len(second)} layouts "
                     f"({len(replicated) - len(second)} left out; --exhaustive tries them all)")
            evaluate(by_compute_floor(second, configs))
    if len(skipped) > len(set(skipped)):
        progress(f"{len(skipped)} layouts skipped in all, for the reason(s) above")
    if not configs:
        raise PlanError(f"{target}: no layout could be captured: {skipped[0]}")
    configs.sort(key=_best_first)
    return configs


AC_RECOMPUTES = {"none": 0, "selective": 1, "full": 2}  # how much backward computes again


def waves(stage: list[Layout]) -> list[list[Layout]]:
    """`stage` in the order that lets `_not_outrun` leave layouts out: each layout after every
    layout that is at least as fast (see `_outrunners`), so the fastest of each family are
    captured first, and the rest only while they could still win."""
    rank = {layout: AC_RECOMPUTES[layout.ac] + sum(
        other.micro_batch > layout.micro_batch and _family(other) == _family(layout)
        for other in stage) for layout in stage}
    return [[layout for layout in stage if rank[layout] == r] for r in sorted(set(rank.values()))]


def _family(layout: Layout) -> tuple:
    return (layout.strategy, layout.shard_size, layout.param_dtype, layout.tp)


def _outruns(faster: tuple, slower: tuple) -> bool:
    """Whether a layout keyed `faster` is at least as fast as one keyed `slower` (keys of
    `_but_strategy`, one family): micro-batch at least as large, checkpointing no heavier."""
    (tp, ac, dtype, micro), (other_tp, other_ac, other_dtype, other_micro) = faster, slower
    return (tp, dtype) == (other_tp, other_dtype) and micro >= other_micro and (
        AC_RECOMPUTES[ac] <= AC_RECOMPUTES[other_ac])


def _outrunners(layout: Layout, captured: set[Layout]) -> list[Layout]:
    """The captured layouts whose every step is at most `layout`'s, option set by option set:
    the same family (strategy, shard groups, dtype, TP degree) with micro-batches at least as
    large and checkpointing no heavier. A smaller micro-batch repeats every per-micro-batch
    cost (the parameters' collectives, each kernel's overhead, the wait for the slowest rank)
    for the same rows, and checkpointing only adds the recomputation; "auto" lies between its
    layout's "last" and "all" rows."""
    return [other for other in captured if other != layout and _family(other) == _family(layout)
            and _outruns(_but_strategy(other), _but_strategy(layout))]


def _best_step(configs: list[Config]) -> float:
    return min((config.step_s for config in configs if config.fits), default=float("inf"))


def _not_outrun(stage: list[Layout], configs: list[Config]) -> list[Layout]:
    """The layouts of `stage` that could still beat the best fitting configuration found: one
    whose outrunner (a larger micro-batch or lighter checkpointing of it, captured) is nowhere
    faster than that best is left out, since it is no faster than its outrunner."""
    fastest: dict[Layout, float] = {}
    for config in configs:
        fastest[config.layout] = min(config.step_s, fastest.get(config.layout, float("inf")))

    def bound(layout: Layout) -> float:
        return max((fastest[other] for other in _outrunners(layout, set(fastest))), default=0.0)

    best = _best_step(configs)
    return [layout for layout in stage if bound(layout) < best]


def compute_floor(layout: Layout, configs: list[Config]) -> float:
    """At most any step of the hybrid or no_shard `layout`: the model's own compute in its
    full_shard twin (the same TP degree, checkpointing, dtype and micro-batch), the least of its
    option sets; or in a twin whose key outruns `layout`'s (`_outruns`), whose layout of the
    same strategy and shard groups is no slower than `layout`. The model's nodes and their
    shapes are the same in both strategies; only graphshard's own (casts, padding, bucket
    copies, collectives) differ with the shard groups, and they are left out. 0 for a
    full_shard layout, and where no such twin was captured."""
    if layout.strategy == "full_shard":
        return 0.0
    twins: dict[tuple, float] = {}
    for config in configs:
        key = _but_strategy(config.layout)
        if config.layout.strategy == "full_shard" and _outruns(key, _but_strategy(layout)):
            twins[key] = min(config.model_compute_s, twins.get(key, float("inf")))
    return max(twins.values(), default=0.0)


def by_compute_floor(stage: list[Layout], configs: list[Config]) -> list[list[Layout]]:
    """`stage` (hybrid and no_shard layouts) in groups of one full_shard twin each, the lowest
    `compute_floor` first (then lighter checkpointing, larger micro-batches: a group's
    outrunners before it): the likeliest best is captured first, and the groups after it only
    while they could still beat it (`_not_outcomputed`)."""
    groups: dict[tuple, list[Layout]] = {}
    for layout in stage:
        groups.setdefault(_but_strategy(layout), []).append(layout)
    return sorted(groups.values(), key=lambda group: (
        compute_floor(group[0], configs), AC_RECOMPUTES[group[0].ac], -group[0].micro_batch))


def _not_outcomputed(stage: list[Layout], configs: list[Config]) -> list[Layout]:
    """The layouts of `stage` that could still beat the best fitting configuration found: a
    hybrid or no_shard layout's step takes at least its `compute_floor`."""
    best = _best_step(configs)
    return [layout for layout in stage if compute_floor(layout, configs) < best]


NO_SHARD_STATE_BYTES = 12  # a parameter's fp32 master and AdamW's two fp32 moments


def _not_oversized(stage: list[Layout], configs: list[Config], cluster) -> list[Layout]:
    """The layouts of `stage` that could fit: a no_shard layout holds every parameter of its TP
    piece whole on each device, with its optimizer state (`NO_SHARD_STATE_BYTES` an element at
    the least: the model's parameters, known from any capture, over the TP degree, its
    replicated norms aside), so a model whose state alone exceeds the device memory is not
    captured that way."""
    limit = cluster.device_memory_bytes
    params = max((config.trainable_params for config in configs), default=0.0)
    if limit is None or not params:
        return list(stage)
    return [layout for layout in stage if not layout.replicated
            or params / layout.tp * NO_SHARD_STATE_BYTES <= limit]


def _not_beaten(stage: list[Layout], configs: list[Config], step_flops: dict,
                cluster) -> list[Layout]:
    """The layouts of `stage` that could still beat the best fitting configuration found: a
    step takes at least its matmuls' FLOPs at the dtype's peak (the cost model's compute time
    of a node is never below its FLOPs at the peak, and compute runs one node at a time), and
    those FLOPs, one device's in a step, are the same for every layout of one TP degree and
    checkpointing mode (micro-batches split the same rows; shard groups and dtypes do not
    change the matmuls), and no fewer than with lighter checkpointing (which recomputes
    less)."""
    def bound(layout: Layout) -> float:
        flops = max((step_flops.get((layout.tp, ac), 0.0) for ac, recomputes in AC_RECOMPUTES.items()
                     if recomputes <= AC_RECOMPUTES[layout.ac]), default=0.0)
        return flops / matmul_peak(layout, cluster)

    best = _best_step(configs)
    return [layout for layout in stage if bound(layout) < best]


HYBRID_TRIED_FOR = 3  # full_shard layouts whose hybrid and no_shard twins the search tries


def _best_first(config: Config) -> tuple:
    return (not config.fits, config.step_s if config.fits else config.peak_memory_bytes)


def _but_strategy(layout: Layout) -> tuple:
    return (layout.tp, layout.ac, layout.param_dtype, layout.micro_batch)


def best_layouts(configs: list[Config], count: int) -> set[tuple]:
    """The `count` best layouts of `configs` (each by its best option set), strategy left out."""
    best: list[tuple] = []
    for config in sorted(configs, key=_best_first):
        key = _but_strategy(config.layout)
        if key not in best:
            best.append(key)
    return set(best[:count])
