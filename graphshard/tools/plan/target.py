"""What the planner needs of its target: a factory it can call at any micro-batch and sequence
length, and the model's depth (a deep model is captured at two small depths and extrapolated)."""

from __future__ import annotations

import inspect
from typing import Callable

from graphshard.tools.plan.config import Probe
from graphshard.tools.plan.space import Knobs, PlanError

SHAPE_ARGUMENTS = ("batch", "seq_len")


def factory_of(target: str) -> Callable:
    from graphshard.tools.dump.loading import import_factory
    from graphshard.tools.models import BUILTIN_MODELS

    return BUILTIN_MODELS.get(target) or import_factory(target)


def check_factory_takes_shape(target: str) -> None:
    """The planner builds each layout's example inputs itself, at that layout's micro-batch
    and --seq: a factory must take batch= and seq_len= (`graphshard dump` calls one as it is)."""
    from graphshard.tools.models import BUILTIN_MODELS

    if target in BUILTIN_MODELS or ":" not in target:
        return  # built-ins take both; anything else is load_workload's to report
    parameters = inspect.signature(factory_of(target)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    missing = [name for name in SHAPE_ARGUMENTS if name not in parameters]
    if missing:
        raise PlanError(
            f"{target} takes no {' or '.join(f'{name}=' for name in missing)}: the planner varies "
            "the micro-batch and the sequence length, so it needs factory(batch=, seq_len=) "
            "returning example inputs of batch rows of seq_len tokens (graphshard dump calls the "
            "factory without them)")


def depth_probes(target: str, model_args: dict) -> tuple[int | None, tuple]:
    """(repeated blocks in the model, the block counts to capture: (4, 5) to extrapolate from,
    or (None,): the model as built). The first blocks are unlike the rest: a 1-block model's
    only block is also the last one of forward, and where backward peaks (while the last
    blocks' activations are alive, or at its end with every gradient produced) settles only
    from about 4 blocks on: from 3 and 4 blocks the backward's peak grew 4x faster per block
    than it does after (an 8-block transformer, tests/test_plan.py)."""
    from graphshard.activation_checkpointing import repeated_blocks
    from graphshard.tools.dump.loading import load_workload
    from graphshard.tools.models import BUILTIN_MODELS

    workload = load_workload(target, batch=1, seq_len=8, model_args=model_args)
    try:
        depth = len(repeated_blocks(workload.model))
    except ValueError:
        return None, (None,)
    takes = target in BUILTIN_MODELS or "n_layers" in inspect.signature(factory_of(target)).parameters
    probed = takes and "n_layers" not in model_args and depth > 5
    return depth, (4, 5) if probed else (None,)


def at_depth(captured: list[dict[Knobs, Probe]], probe_sizes: tuple, depth: int | None,
             knob: Knobs) -> Probe:
    """A knob set's probe at the model's depth: as captured, or extrapolated from the probes."""
    if len(captured) == 1:
        return captured[0][knob]
    low, high = probe_sizes
    return captured[0][knob].combine(captured[1][knob], (depth - low) / (high - low))
