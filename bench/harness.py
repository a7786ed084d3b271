"""Runs the benchmark: N local gloo processes, every method on the same model and batch.

Two launches share one fresh Inductor cache directory:

1. timing: every method is set up once (its own deep copy of the same initial model) and kept
   alive; after warm-up, repeats interleave the methods (the order rotates each repeat) and
   time `steps` steps each, so machine noise spreads over all methods alike. The first
   warm-up step of a compiled method, less its median step, is its cold compile time (the
   cache directory starts empty). Every step's loss is kept for the agreement check.
2. profile: fresh processes on the now-populated caches. A compiled method's first step, less
   the timing run's median step, is its warm compile time (as a restarted job's). Then, per
   method, one profiler run covers model copy, setup, two steps and PROFILED_STEPS
   measured steps, whose average gives collectives, bytes and the peak memory (see
   bench.measure); graphshard compiles there as observed, so that its passes run (on one rank
   per host, the others load its compile) and predict the peak. Profiling never overlaps a
   timed step.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graphshard._torch_compat import allow_recompiles, compile_counters

from graphshard.bench.measure import (analyze, count_frees_on_every_thread, measured_step, phase,
                                      memory_profile)
from graphshard.bench.methods import MethodUnavailable, compiles_observed, method
from graphshard.bench.workload import build_workload
from graphshard.tools.workload import Workload

OK = "ok"
PROFILED_STEPS = 3  # in the profile's measured region: per-step numbers are their average
_TIMEOUT = timedelta(seconds=120)  # a dead rank fails its peers' collectives, never hangs them


@dataclass(frozen=True)
class BenchConfig:
    model: str = "transformer"
    model_args: tuple[tuple[str, object], ...] = ()
    nproc: int = 2
    tp: int = 1  # TP degree of the tensor-parallel methods (the (nproc / tp, tp) mesh)
    methods: tuple[str, ...] = ("ddp_eager", "fsdp2_eager")
    batch: int = 8  # global batch; each rank trains batch // nproc samples
    seq: int = 32
    steps: int = 10  # timed steps per method per repeat
    repeats: int = 3
    warmup: int = 3
    optimizer: str = "fused_adamw"
    lr: float = 1e-3
    seed: int = 0

    @property
    def threads_per_rank(self) -> int:
        # One rank per core at most: more threads than cores would time the OS scheduler.
        return max(1, (os.cpu_count() or 1) // self.nproc)


@dataclass(frozen=True)
class RankPlacement:
    """What a method trains on, on this rank: its mesh and its slice of the global batch."""

    mesh: DeviceMesh
    inputs: tuple[torch.Tensor, ...]


def rank_placements(cfg: BenchConfig, workload: Workload, rank: int) -> dict[bool, RankPlacement]:
    """This rank's placement for the data-parallel methods (False) and, when any method is
    tensor-parallel, for those (True): the (dp, tp) mesh, where the ranks of one TP group
    train the same rows, their data-parallel rank's (rank // tp)."""
    placements = {False: RankPlacement(init_device_mesh("cpu", (cfg.nproc,)),
                                       workload.local_inputs(rank, cfg.nproc))}
    if any(method(name).tensor_parallel for name in cfg.methods):
        dp = cfg.nproc // cfg.tp
        mesh = init_device_mesh("cpu", (dp, cfg.tp), mesh_dim_names=("dp", "tp"))
        placements[True] = RankPlacement(mesh, workload.local_inputs(rank // cfg.tp, dp))
    return placements


def placed_set_up(name: str, cfg: BenchConfig, workload: Workload,
                  placements: dict[bool, RankPlacement]) -> Callable[[], torch.Tensor]:
    placement = placements[method(name).tensor_parallel]
    return set_up(name, cfg, workload, placement.mesh, placement.inputs)


@dataclass(frozen=True)
class CpuSample:
    """A span of time: its wall seconds, this rank's CPU seconds (all its threads), and the
    CPU seconds every process of the machine used and the hypervisor stole (/proc/stat; None
    where there is none). The report takes the ranks' own from the machine's: what others used."""

    wall_s: float
    own_s: float
    machine_busy_s: float | None
    machine_steal_s: float | None

    @staticmethod
    def now() -> "CpuSample":
        busy = steal = None
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            tick = os.sysconf("SC_CLK_TCK")
            user, nice, system, _idle, _iowait, irq, softirq, steal_ticks = fields[:8]
            busy, steal = (user + nice + system + irq + softirq) / tick, steal_ticks / tick
        except (OSError, IndexError, ValueError):
            pass
        return CpuSample(time.perf_counter(), time.process_time(), busy, steal)

    def since(self, start: "CpuSample") -> "CpuSample":
        def delta(a, b):
            return None if a is None or b is None else a - b
        return CpuSample(self.wall_s - start.wall_s, self.own_s - start.own_s,
                         delta(self.machine_busy_s, start.machine_busy_s),
                         delta(self.machine_steal_s, start.machine_steal_s))


@dataclass
class RankResult:
    """What one rank measured in one launch, keyed by method name."""

    status: dict[str, str] = field(default_factory=dict)
    first_step_s: dict[str, float] = field(default_factory=dict)
    step_s: dict[str, list[float]] = field(default_factory=dict)
    losses: dict[str, list[float]] = field(default_factory=dict)
    profile: dict[str, dict] = field(default_factory=dict)
    dynamo: dict[str, dict[str, int]] = field(default_factory=dict)  # compile counters
    predicted_peak_bytes: dict[str, int] = field(default_factory=dict)  # graphshard's memory model
    loadavg: list[list[float]] = field(default_factory=list)  # one (1, 5, 15 min) per repeat
    cpu: list[CpuSample] = field(default_factory=list)  # one per repeat: what used the CPUs

    def __post_init__(self):  # read back from the launch's JSON: dicts
        self.cpu = [c if isinstance(c, CpuSample) else CpuSample(**c) for c in self.cpu]


# --------------------------------------------------------------------------- one method


def make_optimizer(cfg: BenchConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer in ("adamw", "fused_adamw"):
        # fused: one kernel over all of a dtype's tensors (sharded DTensors included): the
        # fastest configuration for sharded parameters (the for-loop default is ~10x slower).
        return torch.optim.AdamW(params, lr=cfg.lr, fused=cfg.optimizer == "fused_adamw")
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; valid: 'fused_adamw', 'adamw', 'sgd'")


def make_train_step(
    module: nn.Module, loss_fn: Callable, inputs: tuple[torch.Tensor, ...],
    optimizer: torch.optim.Optimizer,
) -> Callable[[], torch.Tensor]:
    """The one training step every method runs; returns this rank's loss."""
    after_optimizer_step = getattr(module, "after_optimizer_step", None)

    def step() -> torch.Tensor:
        with phase("forward"):
            loss = loss_fn(module(*inputs), *inputs)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if after_optimizer_step is not None:  # FSDP2 + torchao's float8 scales
                after_optimizer_step()
        return loss.detach()

    step.module = module  # what it trains (the profile reads graphshard's prediction there)
    return step


def set_up(name: str, cfg: BenchConfig, workload: Workload, mesh: DeviceMesh,
           inputs: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
    module = method(name).setup(copy.deepcopy(workload.model), mesh)
    return make_train_step(module, workload.loss_fn, inputs, make_optimizer(cfg, module.parameters()))


def _timed(step: Callable[[], torch.Tensor]) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, float(loss)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


def _agree(status: dict[str, str]) -> dict[str, str]:
    """Make every rank drop a method any rank failed, so collectives stay matched."""
    gathered: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, status)
    merged = dict(status)
    for other in gathered:
        for name, state in other.items():
            if state != OK and merged.get(name) == OK:
                merged[name] = state
    return merged


def _dynamo_counts() -> dict[str, int]:
    """Process-wide compile counters: graphs, graph breaks, compile-cache hits and misses."""
    counters = compile_counters()
    counts = {"graphs": counters["stats"]["unique_graphs"],
              "graph_breaks": sum(counters["graph_break"].values())}
    for group, prefix in (("inductor", "fxgraph_cache_"), ("aot_autograd", "autograd_cache_")):
        for outcome in ("hit", "miss", "bypass"):
            counts[prefix + outcome] = counters[group][prefix + outcome]
    return counts


def _counts_since(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in _dynamo_counts().items()}


def _prime_inductor() -> None:
    """Compile a trivial function so one-time imports are not billed to the first method."""
    x = torch.ones(8, requires_grad=True)
    torch.compile(lambda t: (t * 2).sin().sum())(x).backward()


# --------------------------------------------------------------------------- phases


def _set_up_all(cfg: BenchConfig, workload: Workload, placements: dict[bool, RankPlacement],
                result: RankResult) -> dict[str, Callable[[], torch.Tensor]]:
    steps = {}
    for name in cfg.methods:
        try:
            steps[name] = placed_set_up(name, cfg, workload, placements)
            result.status[name] = OK
        except MethodUnavailable as exc:
            result.status[name] = f"unavailable: {exc}"
        except Exception as exc:  # a broken method must not take the others down
            result.status[name] = f"failed in setup: {_describe(exc)}"
    result.status = _agree(result.status)
    return {name: step for name, step in steps.items() if result.status[name] == OK}


def _run_steps(name: str, step: Callable[[], torch.Tensor], count: int, result: RankResult,
               times: list[float] | None) -> bool:
    """Run `count` steps of one method, keeping losses (and times); False if it failed."""
    try:
        for _ in range(count):
            elapsed, loss = _timed(step)
            result.losses[name].append(loss)
            if times is not None:
                times.append(elapsed)
        return True
    except Exception as exc:
        result.status[name] = f"failed: {_describe(exc)}"
        return False


def timing_phase(cfg: BenchConfig, workload: Workload, placements: dict[bool, RankPlacement]
                 ) -> RankResult:
    result = RankResult()
    if any(method(name).compiled for name in cfg.methods):
        _prime_inductor()
    steps = _set_up_all(cfg, workload, placements, result)

    for name, step in steps.items():
        result.losses[name], result.step_s[name] = [], []
        first: list[float] = []
        before = _dynamo_counts()
        if _run_steps(name, step, 1, result, first):
            result.first_step_s[name] = first[0]
            _run_steps(name, step, cfg.warmup - 1, result, None)
        # Dynamo's counters are process-wide; methods warm up one at a time, so the change
        # during a method's warm-up is that method's.
        result.dynamo[name] = _counts_since(before)
        result.status = _agree(result.status)

    for repeat in range(cfg.repeats):
        result.loadavg.append(list(os.getloadavg()))
        names = [n for n in steps if result.status[n] == OK]
        shift = repeat % max(1, len(names))
        dist.barrier()
        start = CpuSample.now()
        for name in names[shift:] + names[:shift]:
            dist.barrier()  # start each method's block together on all ranks
            _run_steps(name, steps[name], cfg.steps, result, result.step_s[name])
            result.status = _agree(result.status)
        dist.barrier()
        result.cpu.append(CpuSample.now().since(start))
    return result


def profile_phase(cfg: BenchConfig, workload: Workload, placements: dict[bool, RankPlacement]
                  ) -> RankResult:
    result = RankResult()
    compiled = [name for name in cfg.methods if method(name).compiled]
    if compiled:
        _prime_inductor()
    for name in cfg.methods:
        result.losses[name] = []
        try:
            if method(name).compiled:
                # Warm compile: fresh process, cache filled by the timing launch, no profiler.
                before = _dynamo_counts()
                step = placed_set_up(name, cfg, workload, placements)
                result.first_step_s[name] = _timed(step)[0]
                result.dynamo[name] = _counts_since(before)
                del step
                gc.collect()
            with memory_profile() as prof:
                with compiles_observed():
                    step = placed_set_up(name, cfg, workload, placements)
                step(), step()
                with measured_step():
                    for _ in range(PROFILED_STEPS):
                        step()
            compiler = getattr(step.module, "graphshard_compiler", None)
            if compiler is not None and compiler.predicted_peak_bytes is not None:
                result.predicted_peak_bytes[name] = compiler.predicted_peak_bytes
            del step
            gc.collect()
            result.profile[name] = asdict(analyze(prof, dist.get_world_size(), PROFILED_STEPS))
            result.status[name] = OK
        except MethodUnavailable as exc:
            result.status[name] = f"unavailable: {exc}"
        except Exception as exc:
            result.status[name] = f"failed in profiling: {_describe(exc)}"
        result.status = _agree(result.status)
    return result


PHASES: dict[str, Callable[..., RankResult]] = {"timing": timing_phase, "profile": profile_phase}


def _worker(rank: int, cfg: BenchConfig, phase: str, port: int, out_path: str) -> None:
    count_frees_on_every_thread()  # before anything is allocated: honest peak memory
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg.nproc, timeout=_TIMEOUT)
    try:
        torch.set_num_threads(cfg.threads_per_rank)
        # Several compiled methods trace the same forward code objects; do not let Dynamo's
        # per-code recompile limit fall back to eager for the later ones.
        allow_recompiles(per_code=64, total=4096)
        workload = build_workload(cfg.model, cfg.batch, cfg.seq, cfg.seed, dict(cfg.model_args))
        result = PHASES[phase](cfg, workload, rank_placements(cfg, workload, rank))
        gathered: list[dict] = [{} for _ in range(cfg.nproc)]
        dist.all_gather_object(gathered, asdict(result))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: BenchConfig, phase: str, workdir: str) -> list[RankResult]:
    """Run one phase on cfg.nproc local processes; returns each rank's result.

    A phase whose rank a signal kills runs once more: seen here, a sporadic SIGSEGV inside
    torch.profiler's startup (kineto: "Not starting tracing - insufficient time for warmup"),
    not in any method. A method's own errors never kill a rank (each rank reports them)."""
    out_path = os.path.join(workdir, f"{phase}.json")
    for attempt in (1, 2):
        try:
            mp.spawn(_worker, args=(cfg, phase, _free_port(), out_path), nprocs=cfg.nproc,
                     join=True)
            break
        except mp.ProcessExitedException as exc:
            if exc.signal_name is None or attempt == 2:
                raise
            print(f"bench: the {phase} launch lost rank {exc.error_index} to {exc.signal_name}; "
                  "running it again", file=sys.stderr, flush=True)
    with open(out_path) as f:
        return [RankResult(**r) for r in json.load(f)]


def run(cfg: BenchConfig, cache_dir: str | None = None
        ) -> tuple[list[RankResult], list[RankResult]]:
    """Both launches; returns (timing, profile) per rank. They compile into a fresh Inductor
    cache directory (the first step is a cold compile), or into `cache_dir`, which is kept: runs
    that share one load what an earlier run compiled."""
    workdir = tempfile.mkdtemp(prefix="graphshard-bench-")
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # children inherit it
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir or os.path.join(workdir, "inductor")
    try:
        return launch(cfg, "timing", workdir), launch(cfg, "profile", workdir)
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        shutil.rmtree(workdir, ignore_errors=True)

