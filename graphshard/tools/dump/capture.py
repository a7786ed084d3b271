"""Capture: compile a sharded model with the graphshard backend and record its graphs, without
running any of them."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


class CaptureComplete(Exception):
    """Raised by the observer once the last graph has been recorded: nothing needs to run."""


@dataclass
class Capture:
    texts: dict[tuple[str, str], str] = field(default_factory=dict)  # (graph, stage) -> code
    final: dict[str, Any] = field(default_factory=dict)  # graph -> final-stage GraphModule
    seconds: dict[str, float] = field(default_factory=dict)  # "graph/stage" -> time it took
    # parameters whose gathered weights forward saves for backward (the reshard policy kept)
    kept_from_forward: frozenset[str] = frozenset()
    cache_bypass: str | None = None  # why AOTAutograd's cache would not store the graph
    takes_device_mesh: bool = False  # the graph takes a DeviceMesh (a tensor-parallel plan's)


def _readable(gm) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def capture(workload, options, stages: Sequence[str],
            progress: Callable[[str], None] = lambda message: None) -> Capture:
    """Compile the workload's model with the graphshard backend; record the code of `stages` and the final
    graphs. The backward is compiled eagerly with the forward (as AOT compile does), and the
    observer stops the compilation once the final backward graph is recorded. `progress` is
    told when each graph has been captured and when its passes are done."""
    import torch

    from graphshard._torch_compat import backward_compiled_with_forward
    from graphshard.compiler.backend import GraphshardCompiler
    from graphshard.compiler.collection_pause import full_collections_paused
    from graphshard.compiler.pipeline import STAGES
    from graphshard.passes.reshard_policy import kept_from_forward

    result = Capture()
    final = STAGES[-1]
    needs_backward = _needs_backward(workload.model, workload.inputs)  # here: the backend runs under no_grad

    clock = [time.perf_counter()]

    def observe(kind: str, stage: str, gm) -> None:
        kind = "forward" if kind == "inference" else kind
        # "partitioned": AOTAutograd + partitioning since the previous event; else the pass
        result.seconds[f"{kind}/{stage}"] = time.perf_counter() - clock[0]
        if stage == final:
            captured = result.seconds[f"{kind}/partitioned"]
            passes = sum(v for k, v in result.seconds.items()
                         if k.startswith(f"{kind}/")) - captured
            progress(f"{kind} graph captured in {captured:.1f} s, passes run in {passes:.1f} s")
        if kind == "forward" and stage == "partitioned":  # markers still show what is kept
            result.kept_from_forward = kept_from_forward(gm)
        # Later stages mutate the graph in place: take the text now.
        if stage in stages or stage == final:
            result.texts[(kind, stage)] = _readable(gm)
        if stage == final:
            result.final[kind] = gm  # nothing runs after the final stage with compiler="eager"
            if kind == "backward" or not needs_backward:
                raise CaptureComplete()
        clock[0] = time.perf_counter()  # the text above is the dump's time, not the backend's

    # Inductor would only consume the final graphs: skip it, run exactly the backend's passes.
    compiler = GraphshardCompiler(dataclasses.replace(options, compiler="eager"), observe)
    with full_collections_paused():  # the resets too: they make and drop many objects
        torch.compiler.reset()
        try:
            compiled = torch.compile(workload.model, backend=compiler, fullgraph=True)
            with backward_compiled_with_forward():
                workload.run(compiled)
        except Exception as e:
            if not caused_by(e, CaptureComplete):
                raise
        finally:
            torch.compiler.reset()
    result.cache_bypass = compiler.cache_bypass
    result.takes_device_mesh = compiler.takes_device_mesh
    if "forward" not in result.final:
        raise RuntimeError("the graphshard backend never saw a sharded graph "
                           "(no parameter read reached torch.compile)")
    return result


def _needs_backward(model, inputs) -> bool:
    import torch

    from graphshard._torch_compat import tree_leaves
    return torch.is_grad_enabled() and (
        any(p.requires_grad for p in model.parameters())
        or any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in tree_leaves(inputs)))


def caused_by(e: BaseException | None, kind: type) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return False
