"""Measuring one training step with torch.profiler: collectives, bytes, peak memory.

Why the profiler: it sees both eager and compiled methods the same way. Every collective,
whichever layer issued it (DDP's reducer, FSDP2, DTensor, functional collectives in an Inductor
graph), ends in one `gloo:<kind>` event in the backend, with its tensor's shape. And with
`profile_memory=True` the CPU allocator reports every allocation and free, including the
buffers Inductor's generated code allocates directly (which a TorchDispatchMode such as
MemTracker never sees).

Memory is counted from the start of the profiling session: only blocks allocated while it runs
are tracked. So the session is opened before the method's model copy is made, and the peak of
the running total inside the measured step is that method's per-rank footprint (its parameters,
optimizer state, gradient buffers and the step's transients), excluding what all methods share
(the pristine model, inputs, the interpreter).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from torch.profiler import ProfilerActivity, profile, record_function

STEP_MARK = "bench::measured_step"
_MEMORY_EVENT = "[memory]"
_GLOO_PREFIX = "gloo:"
_FLOAT32_BYTES = 4


@dataclass
class StepProfile:
    collectives: dict[str, int] = field(default_factory=dict)  # kind -> count in the step
    comm_bytes: dict[str, int] = field(default_factory=dict)  # kind -> bytes in the step
    peak_bytes: int = 0  # peak of this method's live CPU tensor bytes during the step

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


@contextmanager
def measured_step() -> Iterator[None]:
    """Marks the step `analyze` measures, inside a `memory_profile` session."""
    with record_function(STEP_MARK):
        yield


def _message_bytes(kind: str, shapes: list, world_size: int) -> int:
    """Logical size of a collective: the full (unsharded) buffer it reads or produces.

    gloo records the input: a shard for all-gather (hence * world size), the full buffer for
    all-reduce and for reduce-scatter (gloo runs reduce-scatter as an all-reduce of the whole
    buffer). The dtype is not recorded on gloo events; every method benchmarked here
    communicates float32.
    """
    numel = 1
    for dim in (shapes[0] if shapes else []):
        numel *= dim
    factor = world_size if "gather" in kind else 1
    return numel * factor * _FLOAT32_BYTES


def analyze(prof: profile, world_size: int) -> StepProfile:
    """Collectives and peak memory of the `measured_step` in a finished `memory_profile`."""
    # kineto_results is the one place the raw event stream (with allocator events) is exposed.
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    marks = [e for e in events if e.name() == STEP_MARK]
    if len(marks) != 1:
        raise RuntimeError(f"expected one {STEP_MARK!r} region in the profile, found {len(marks)}")
    start, end = marks[0].start_ns(), marks[0].end_ns()

    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    live, entry_level, step_max = 0, None, 0
    for event in events:
        name, t = event.name(), event.start_ns()
        if entry_level is None and t >= start:
            entry_level = live  # what the method holds on entering the step
        in_step = start <= t <= end
        if name == _MEMORY_EVENT:
            live += event.nbytes()
            if in_step:
                step_max = max(step_max, live)
        elif name.startswith(_GLOO_PREFIX) and in_step:
            kind = name[len(_GLOO_PREFIX):]
            counts[kind] += 1
            sizes[kind] += _message_bytes(kind, event.shapes(), world_size)
    peak = max(live if entry_level is None else entry_level, step_max)
    return StepProfile(dict(counts), dict(sizes), peak)


@dataclass(frozen=True)
class TimeStats:
    median_s: float
    min_s: float
    max_s: float
    n: int

    @staticmethod
    def of(samples: list[float]) -> "TimeStats":
        return TimeStats(statistics.median(samples), min(samples), max(samples), len(samples))
