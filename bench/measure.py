"""Measuring training steps with torch.profiler: collectives, bytes, peak memory, phases.

Why the profiler: it sees both eager and compiled methods the same way. Every collective,
whichever layer issued it (DDP's reducer, FSDP2, DTensor, functional collectives in an Inductor
graph), ends in one `gloo:<kind>` event in the backend, with its tensor's shape. And with
`profile_memory=True` the CPU allocator reports every allocation and free, including the
buffers Inductor's generated code allocates directly (which a TorchDispatchMode such as
MemTracker never sees).

Memory: each allocation event carries the CPU allocator's running total of live bytes. The
profiler only records events on the threads it profiles, and by default the allocator only
counts frees made on those threads too, so a buffer freed on one of gloo's threads (an
all-to-all's send buffer, a finished collective's input) stayed "live" forever.
`count_frees_on_every_thread()` (call it first thing in each process) makes the allocator keep
its total on every thread, so the totals the events report are the true live bytes. A method's
footprint is the peak of that total inside the measured step, less the total when the profiling
session opened (before the method's model copy is made): its parameters, optimizer state,
gradient buffers and the step's transients, excluding what all methods share (the pristine
model, inputs, the interpreter).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from torch.profiler import ProfilerActivity, profile, record_function

from graphshard._torch_compat import count_cpu_frees_on_every_thread as count_frees_on_every_thread  # noqa: F401
from graphshard._torch_compat import cpu_allocations

STEP_MARK = "bench::measured_step"
PHASES = ("forward", "backward", "optimizer")  # of a step, marked by `phase`
# Where a compiled graph blocks on a collective (eager methods wait inside c10d: not seen).
_WAIT_EVENT = "_c10d_functional::wait_tensor"
_FUNCTIONAL_PREFIX = "_c10d_functional::"  # a compiled graph's collective calls (and waits)
_EXCHANGE_OP_EVENT = "graphshard::exchange_with_peers"  # an all-to-all with its rank lookup
# A compiled forward's and backward's run (AOTAutograd's function; any final compiler)
_GRAPH_EVENTS = frozenset({"CompiledFunction", "CompiledFunctionBackward"})
_COPY_OUT_EVENT = "graphshard::split_copy"  # a gathered bucket copied out into its parameters
_GLOO_PREFIX = "gloo:"
_EXCHANGE_EVENT = "_c10d_functional::all_to_all_single"
_FLOAT32_BYTES = 4
# The profiler's names of the input dtypes a collective carries (bf16 and float8-as-uint8
# gathers beside fp32 ones).
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "unsigned char": 1,
                "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "int": 4, "long int": 8}


@dataclass
class StepProfile:
    collectives: dict[str, int] = field(default_factory=dict)  # kind -> count per step
    comm_bytes: dict[str, int] = field(default_factory=dict)  # kind -> bytes per step
    peak_bytes: int = 0  # peak of this method's live CPU tensor bytes during the step
    # Where the measured step's time goes (main thread, ms): each phase, and the time spent
    # blocked on communication ("wait") inside the step.
    breakdown_ms: dict[str, float] = field(default_factory=dict)

    @property
    def total_collectives(self) -> int:
        return sum(self.collectives.values())

    @property
    def total_comm_bytes(self) -> int:
        return sum(self.comm_bytes.values())


@contextmanager
def memory_profile() -> Iterator[profile]:
    """A CPU profiling session that records shapes and allocator events."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        yield prof


def phase(name: str):
    """Marks a phase of the training step (one of PHASES) for the breakdown."""
    return record_function(f"bench::{name}")


@contextmanager
def measured_step() -> Iterator[None]:
    """Marks the step `analyze` measures, inside a `memory_profile` session."""
    with record_function(STEP_MARK):
        yield


def _element_bytes(dtypes: list) -> int:
    """Bytes per element of a collective's first input, as the profiler names its dtype;
    float32 where it records none."""
    named = [d for d in dtypes if d]
    return _DTYPE_BYTES.get(named[0], _FLOAT32_BYTES) if named else _FLOAT32_BYTES


def _message_bytes(kind: str, shapes: list, world_size: int, dtypes: list = ()) -> int:
    """Logical size of a collective: the full (unsharded) buffer it reads or produces.

    gloo records the input: a shard for all-gather (hence * world size), the full buffer for
    all-reduce and for reduce-scatter (gloo runs reduce-scatter as an all-reduce of the whole
    buffer).
    """
    numel = math.prod(shapes[0] if shapes else [])
    factor = world_size if "gather" in kind else 1
    return numel * factor * _element_bytes(dtypes)


def _exchange_bytes(shapes: list, concrete_inputs: list, dtypes: list = ()) -> int:
    """Logical size of an all-to-all: its input, counted with the rank's own chunk where the
    transport keeps that chunk local (a split of 0 for the rank itself; gloo records only what
    it sends)."""
    numel = math.prod(shapes[0])
    input_splits = concrete_inputs[2]
    sent = sum(1 for split in input_splits if split)
    return numel * len(input_splits) // max(sent, 1) * _element_bytes(dtypes)


def analyze(prof: profile, world_size: int, steps: int = 1) -> StepProfile:
    """Collectives and peak memory of the `measured_step` region in a finished
    `memory_profile`, which holds `steps` training steps: collectives, bytes and phase times
    are per step (their average), the peak is the region's."""
    # kineto_results is the one place the raw event stream is exposed.
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    marks = [e for e in events if e.name() == STEP_MARK]
    if len(marks) != 1:
        raise RuntimeError(f"expected one {STEP_MARK!r} region in the profile, found {len(marks)}")
    start, end = marks[0].start_ns(), marks[0].end_ns()
    inside = [e for e in events if start <= e.start_ns() <= end]

    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    for event in inside:
        name = event.name()
        if name.startswith(_GLOO_PREFIX):
            kind = name[len(_GLOO_PREFIX):]
            counts[kind] += 1
            if kind != "all_to_all":
                sizes[kind] += _message_bytes(kind, event.shapes(), world_size, event.dtypes())
        elif name == _EXCHANGE_EVENT:  # the graph's op: its split sizes are recorded
            sizes["all_to_all"] += _exchange_bytes(event.shapes(), event.concrete_inputs(),
                                                   event.dtypes())
    counts = {kind: round(count / steps) for kind, count in counts.items()}
    sizes = {kind: round(size / steps) for kind, size in sizes.items()}
    breakdown = {name: sum(e.end_ns() - e.start_ns() for e in inside
                           if e.name() == f"bench::{name}") / 1e6 / steps for name in PHASES}
    waits = [(e.start_ns(), e.end_ns()) for e in inside if e.name() == _WAIT_EVENT]
    breakdown["wait"] = _union_ns(waits) / 1e6 / steps
    breakdown["step"] = (end - start) / 1e6 / steps
    breakdown.update(_main_thread_split(inside, marks[0].start_thread_id(), steps, breakdown))
    allocations = cpu_allocations(prof)
    if not allocations:
        return StepProfile(counts, sizes, 0, breakdown)
    _, first_bytes, first_total = allocations[0]
    at_open = first_total - first_bytes  # live bytes when the session opened
    before = [total for t, _, total in allocations if t < start]
    during = [total for t, _, total in allocations if start <= t <= end]
    peak = max(during + before[-1:], default=at_open)  # entering the step, or inside it
    return StepProfile(counts, sizes, peak - at_open, breakdown)


def _main_thread_split(inside: list, thread: int, steps: int, breakdown: dict) -> dict[str, float]:
    """The step's main thread, ms per step: inside the compiled graphs, the kernels (compute,
    the copies Inductor fuses into it: packing reduce-scatter buckets, casts; and the packing and
    local sums ATen runs for graphshard's buckets), the collective calls
    (`issue`), the waits on collectives and graphshard's copy-out of gathered buckets
    (`copy_out`); outside them and the optimizer, the host's own work (`host`: Python, Dynamo's
    guards, the autograd engine, gradient accumulation). Eager methods run no compiled graph:
    all their time outside the optimizer is `host`."""
    def union_ms(predicate) -> float:
        spans = [(e.start_ns(), e.end_ns()) for e in inside
                 if e.start_thread_id() == thread and predicate(e.name())]
        return _union_ns(spans) / 1e6 / steps

    graphs = union_ms(lambda name: name in _GRAPH_EVENTS)
    issue = union_ms(lambda name: (name.startswith(_FUNCTIONAL_PREFIX) and name != _WAIT_EVENT)
                     or name == _EXCHANGE_OP_EVENT)
    copy_out = union_ms(lambda name: name == _COPY_OUT_EVENT)
    return {"kernels": max(graphs - breakdown["wait"] - issue - copy_out, 0.0), "issue": issue,
            "copy_out": copy_out,
            "host": max(breakdown["step"] - graphs - breakdown.get("optimizer", 0.0), 0.0)}


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of intervals (nested wait events count once)."""
    total, reach = 0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total, reach = total + b - a, b
        elif b > reach:
            total, reach = total + b - reach, b
    return total


@dataclass(frozen=True)
class TimeStats:
    median_s: float
    min_s: float
    max_s: float
    n: int

    @staticmethod
    def of(samples: list[float]) -> "TimeStats":
        return TimeStats(statistics.median(samples), min(samples), max(samples), len(samples))
