"""reshard_after_forward="auto" in the planner: the backend's search (`longest_fitting_prefix`)
over the number of blocks kept gathered, each candidate's peak interpolated between the probes
of the default and of every block kept, instead of partitioned."""

from __future__ import annotations

import dataclasses
from typing import Callable

from graphshard.compiler.auto_reshard import longest_fitting_prefix
from graphshard.tools.plan.config import Config, Probe
from graphshard.tools.plan.space import Knobs, Layout


def auto_config(layout: Layout, at: Callable[[Knobs], Probe], depth: int, knobs: Knobs,
                finish: Callable, limit: float | None) -> Config | None:
    """The "auto" configuration at the device memory `limit`: as many blocks gathered as fit,
    each beyond the default's (the last block) adding 1/(depth - 1) of the difference between
    keeping every block and the default, the forward's and the backward's peaks each on its
    own. None where it would be the default's row or the "all" row."""
    last, every = dataclasses.replace(knobs, keep="last"), dataclasses.replace(knobs, keep="all")
    if limit is None or depth < 3:
        return None  # nothing between the default and "all"
    try:
        full = at(every)
    except KeyError:  # "all" not searched
        return None
    base = at(last)
    auto = dataclasses.replace(knobs, keep="auto")

    def probe(extra_blocks: int) -> Probe:
        return base.combine(full, extra_blocks / (depth - 1))

    def peak(extra_blocks: int) -> float:
        return finish(layout, auto, probe(extra_blocks)).peak_memory_bytes

    if peak(0) > limit:
        return None  # as the backend: no block beyond the default's where the default does not fit
    kept = 1 + longest_fitting_prefix(depth - 1, peak, limit)
    if not 1 < kept < depth:
        return None
    config = finish(layout, auto, probe(kept - 1))
    config.kept_blocks = kept
    return config
