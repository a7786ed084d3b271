"""Rank functions and shared helpers for tests/test_checkpoint*.py (module-level so
`run_local` can spawn them, and kept apart from the test modules so spawned ranks do not import
pytest)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import graphshard
from graphshard import checkpoint
from zoo import Zoo, zoo_loss

GLOBAL_BATCH, SEQ, VOCAB = 12, 8, 11  # 12 rows split evenly over 1, 2, 3 and 4 ranks
SAVE_STEP, LAST_STEP = 3, 6


def make(seed: int, sharded: bool = True, **shard_kwargs) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Zoo(vocab=VOCAB)
    if sharded:
        graphshard.shard(model, **shard_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ),
                         generator=torch.Generator().manual_seed(100 + step))


def train(model, optimizer, start: int, stop: int, after_backward=None) -> list[float]:
    """Data-parallel steps over a fixed global batch; returns the global mean losses."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for step in range(start, stop):
        tokens = global_batch(step).chunk(world)[rank]
        loss = zoo_loss(model(tokens), tokens)
        optimizer.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        optimizer.step()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    """Unsharded copies of the model's state_dict (a collective on a sharded model)."""
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for name, value in model.state_dict().items()}


def reference(rank: int, world: int, root: str) -> dict[str, Any]:
    """The uninterrupted run at world size 4, saving at SAVE_STEP (replacing its step-1 save)."""
    path = Path(root) / "ckpt"
    model, optimizer = make(seed=0)
    losses = train(model, optimizer, 0, 1)
    checkpoint.save(path, model, optimizer, step=1)
    losses += train(model, optimizer, 1, SAVE_STEP)
    checkpoint.save(path, model, optimizer, step=SAVE_STEP, extra={"tokens_seen": 36})
    at_save = full_state(model)
    draws = torch.rand(4)  # what rank `rank` draws right after the save
    losses += train(model, optimizer, SAVE_STEP, LAST_STEP)
    return {"losses": losses, "at_save": at_save, "final": full_state(model), "draws": draws}


def _inject_write_failure() -> None:
    # This rank writes its shards, then fails: a save that breaks half-way.
    original = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        original(self, plan, planner).wait()
        raise RuntimeError("injected failure in the middle of the save")

    FileSystemWriter.write_data = write_then_fail


def resume(rank: int, world: int, root: str, compiled: bool) -> dict[str, Any]:
    """Resume from the world-size-4 checkpoint with graphshard.checkpoint.load and train on.

    At world size 2 also: a save that fails on rank 1 half-way must leave the step-3
    checkpoint intact and loadable, and leave no temporary directory behind.
    """
    path = Path(root) / "ckpt"
    model, optimizer = make(seed=1000 + rank)  # different weights: the load must replace them
    runner = (torch.compile(model, backend="graphshard", options={"compiler": "eager"})
              if compiled else model)
    info = checkpoint.load(path, runner, optimizer)
    result: dict[str, Any] = {"step": info.step, "world_size": info.world_size,
                              "extra": info.extra, "rng": info.rng_restored,
                              "draws": torch.rand(4)}
    result["losses"] = train(runner, optimizer, SAVE_STEP, LAST_STEP)
    result["final"] = full_state(model)
    if world == 2:
        if rank == 1:
            _inject_write_failure()
        try:
            checkpoint.save(path, runner, optimizer, step=LAST_STEP)
            result["failed_save"] = None
        except checkpoint.CheckpointError as exc:
            result["failed_save"] = str(exc)
        dist.barrier()
        result["dir_after_failure"] = sorted(os.listdir(root))
        model2, optimizer2 = make(seed=7)
        result["reloaded_step"] = checkpoint.load(path, model2, optimizer2).step
        result["reloaded"] = full_state(model2)
    return result


def resume_hybrid(rank: int, world: int, root: str) -> dict[str, Any]:
    """Resume the world-size-4 (1-D, full_shard) checkpoint into hybrid sharding on a 2 x 2 mesh,
    train on, and save the hybrid model (its shards replicated across the two groups)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, optimizer = make(seed=1000 + rank, mesh=mesh, strategy="hybrid_shard")
    info = checkpoint.load(Path(root) / "ckpt", model, optimizer)
    result: dict[str, Any] = {"step": info.step,
                              "placements": {str(p.placements) for p in model.parameters()},
                              "losses": train(model, optimizer, SAVE_STEP, LAST_STEP),
                              "final": full_state(model)}
    checkpoint.save(Path(root) / "hybrid-ckpt", model, optimizer, step=LAST_STEP)
    return result


def resume_plain_dcp(rank: int, world: int, root: str, single: str) -> dict[str, Any]:
    """Resume with only the standard DCP calls; then check a bad path fails on every rank,
    and load `single` (saved by one unsharded process) with graphshard.checkpoint.load."""
    path = Path(root) / "ckpt"
    model, optimizer = make(seed=1000 + rank)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    result: dict[str, Any] = {"losses": train(model, optimizer, SAVE_STEP, LAST_STEP),
                              "final": full_state(model)}
    # ... and a standard DCP save at world size 3 loads back with the standard calls too.
    plain = Path(root) / "plain-dcp-3"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=plain)
    model2, optimizer2 = make(seed=7)
    model_sd, optim_sd = get_state_dict(model2, optimizer2)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=plain)
    set_state_dict(model2, optimizer2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    result["plain_reloaded"] = full_state(model2)
    result["plain_next_loss"] = train(model2, optimizer2, LAST_STEP, LAST_STEP + 1)
    result["next_loss"] = train(model, optimizer, LAST_STEP, LAST_STEP + 1)
    info = checkpoint.load(single, model2, optimizer2)
    result.update(single_rng=info.rng_restored, single_draws=torch.rand(4),
                  single_state=full_state(model2))
    try:
        checkpoint.load(Path(root) / "missing", model, optimizer)
    except checkpoint.CheckpointNotFoundError as exc:
        result["missing_error"] = str(exc)
    return result


def load_into_meta(rank: int, world: int, root: str) -> dict[str, Any]:
    """checkpoint.load into a sharded model built on the meta device and never materialised:
    the error on each rank, and the warnings it printed (torch's no-op copies into meta)."""
    with torch.device("meta"):
        model = Zoo(vocab=VOCAB)
    graphshard.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            info = checkpoint.load(Path(root) / "ckpt", model, optimizer)
            error = f"loaded step {info.step}"
        except checkpoint.CheckpointError as exc:
            error = str(exc)
    return {"error": error, "warnings": [str(w.message) for w in caught]}


def save_pretrained_refused(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A sharded Hugging Face model's save_pretrained, called on every rank: what each rank
    raised, and what it left in the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    graphshard.shard(model)
    try:
        model.save_pretrained(directory)
        error = None
    except checkpoint.CheckpointError as exc:
        error = str(exc)
    dist.barrier()
    written = sorted(os.listdir(directory)) if os.path.isdir(directory) else None
    # The model still trains: the refusal changed nothing else.
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=tokens, labels=tokens).loss.backward()
    return {"error": error, "written": written,
            "grads": all(p.grad is not None for p in model.parameters())}


def save_on_part_of_the_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each rank's own model, sharded over a mesh of that rank alone: a save over the default
    group would wait for ranks that never call it, synchronous or not."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ranks", "alone"))["alone"]
    errors = {}
    for asynchronous in (False, True):
        model = graphshard.shard(torch.nn.Linear(4, 4), mesh=mesh)
        try:
            checkpoint.save(os.path.join(root, f"rank{rank}-{asynchronous}"), model,
                            asynchronous=asynchronous)
            errors[asynchronous] = None
        except checkpoint.CheckpointError as exc:
            errors[asynchronous] = str(exc)
    dist.barrier()
    return errors


# --------------------------------------------------------------------------- one group, many checks


def run_checks(rank: int, world: int, checks: list[tuple[str, tuple]]) -> dict[str, Any]:
    """Run several checks of this module in one process group: {check name: its result}."""
    return {name: globals()[name](rank, world, *args) for name, args in checks}


# --------------------------------------------------------------------------- FSDP2 interop


def make_fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer under FSDP2. FSDP2 cannot shard a 0-dim parameter: `scale`
    is left to the user (ignored_params), who averages its gradient (`average_scale_grad`)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Zoo(vocab=VOCAB)
    fully_shard(model, ignored_params={model.scale})
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def average_scale_grad(model) -> None:
    dist.all_reduce(model.scale.grad)
    model.scale.grad /= dist.get_world_size()


def fsdp2_interop(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP2 resumes graphshard's world-size-4 checkpoint with the standard calls and trains on;
    then an FSDP2 run saves at SAVE_STEP (the standard calls), for graphshard to resume."""
    model, optimizer = make_fsdp2(seed=1000 + rank)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(root) / "ckpt")
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    result: dict[str, Any] = {
        "losses": train(model, optimizer, SAVE_STEP, LAST_STEP, average_scale_grad),
        "final": full_state(model)}

    model, optimizer = make_fsdp2(seed=0)
    result["fsdp2_losses"] = train(model, optimizer, 0, SAVE_STEP, average_scale_grad)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(root) / "fsdp2")
    result["fsdp2_at_save"] = full_state(model)
    return result


def resume_fsdp2(rank: int, world: int, root: str) -> dict[str, Any]:
    """graphshard resumes the FSDP2 run (saved at world size 2) with checkpoint.load; and a plain
    dcp.save of model.state_dict() (the root layout) loads back with checkpoint.load."""
    model, optimizer = make(seed=1000 + rank)
    info = checkpoint.load(Path(root) / "fsdp2", model, optimizer)
    result: dict[str, Any] = {"info": (info.format, info.step, info.world_size, info.rng_restored),
                              "at_load": full_state(model),
                              "losses": train(model, optimizer, SAVE_STEP, LAST_STEP),
                              "final": full_state(model)}
    root_layout = Path(root) / "plain-root-3"
    dcp.save(model.state_dict(), checkpoint_id=root_layout)
    model2, optimizer2 = make(seed=7)
    result["root_format"] = checkpoint.load(root_layout, model2).format
    result["root_reloaded"] = full_state(model2)
    try:
        checkpoint.load(root_layout, model2, optimizer2)
    except checkpoint.CheckpointError as exc:
        result["root_optimizer_error"] = str(exc)
    return result


# --------------------------------------------------------------------------- async save


@contextlib.contextmanager
def _writes(replace):
    """FileSystemWriter.write_data replaced by `replace(original, self, plan, planner)`."""
    original = FileSystemWriter.write_data
    FileSystemWriter.write_data = lambda self, plan, planner: replace(original, self, plan, planner)
    try:
        yield
    finally:
        FileSystemWriter.write_data = original


def _late(release: Path, original, self, plan, planner):
    """This rank's shards reach the disk at least 2 s late, and not before the worker has seen
    training go on with the save in flight (`release`): the test reads no race with the clock."""
    time.sleep(2.0)
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return original(self, plan, planner)


def _failing(original, self, plan, planner):
    raise RuntimeError("injected async write failure")


def async_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """An asynchronous save returns at once, training goes on, and the checkpoint appears only
    when every rank's write finished (rank 1 writes 2 s late); it holds the state at save time."""
    path = Path(root) / "async"
    model, optimizer = make(seed=0)
    losses = train(model, optimizer, 0, SAVE_STEP)
    at_save = full_state(model)
    release = Path(root) / "async-release"
    with _writes(functools.partial(_late, release) if rank == 1
                 else lambda original, *args: original(*args)):
        start = time.perf_counter()
        handle = checkpoint.save(path, model, optimizer, step=SAVE_STEP, asynchronous=True)
        returned_s = time.perf_counter() - start
        losses += train(model, optimizer, SAVE_STEP, LAST_STEP)  # updates weights in place
        result: dict[str, Any] = {"returned_s": returned_s, "losses": losses,
                                  "pending_after_training": not handle.done(),
                                  "exists_after_training": path.exists()}
        dist.barrier()  # every rank has looked: rank 1's write may go on
        if rank == 1:
            release.touch()
        result["path"] = str(handle.result())
    result["elapsed_s"] = time.perf_counter() - start
    result["manifest"] = (path / checkpoint.MANIFEST).is_file()
    model2, optimizer2 = make(seed=5)
    info = checkpoint.load(path, model2, optimizer2)
    result["step"] = info.step
    result["reloaded"] = full_state(model2)
    result["at_save"] = at_save
    result["reloaded_losses"] = train(model2, optimizer2, SAVE_STEP, LAST_STEP)

    # A write that fails on rank 1: result() raises on every rank; the checkpoint is intact.
    with _writes(_failing if rank == 1 else lambda original, *args: original(*args)):
        handle = checkpoint.save(path, model, optimizer, step=LAST_STEP, asynchronous=True)
        try:
            handle.result()
        except checkpoint.CheckpointError as exc:
            result["failed"] = str(exc)
    dist.barrier()
    result["after_failure"] = sorted(os.listdir(root))
    result["step_after_failure"] = checkpoint.load(path, model2).step
    return result


def save_bench(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A tiny run of bench/checkpoint_save.py's measurement (every step saves)."""
    from graphshard.bench.checkpoint_save import SaveBenchConfig, measure

    cfg = SaveBenchConfig(model_args=(("dim", 32), ("n_layers", 1)), steps=2, every=1,
                          repeats=1, warmup=1)
    return measure(rank, world, cfg, directory)


# --------------------------------------------------------------------------- pretrained weights


def stack(layers: int, dim: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def pretrained_memory(rank: int, world: int, file: str, layers: int, dim: int) -> dict | None:
    """Peak host memory (resident set) of load_pretrained into a meta-built sharded model."""
    with torch.device("meta"):
        model = stack(layers, dim)
    graphshard.shard(model)
    gc.collect()
    try:  # reset the kernel's peak-RSS counter (VmHWM), Linux >= 4.0
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_mib("VmRSS")
    checkpoint.load_pretrained(model, file)
    peak = _status_mib("VmHWM") - before
    # The loaded model runs compiled (before any eager use) as it does eagerly.
    x = torch.randn(2, dim, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="graphshard", options={"compiler": "eager"})
    with torch.no_grad():
        compiled_matches = torch.allclose(compiled(x), model(x), atol=1e-6, rtol=0)
    shard_mib = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    sums = {n: p.to_local().double().sum().item() for n, p in model.named_parameters()}
    # Into the now materialised shards, in place, over other values.
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.to_local().zero_()
    checkpoint.load_pretrained(model, file)
    in_place = all(p is q for p, q in zip(model.parameters(), params)) and sums == {
        n: p.to_local().double().sum().item() for n, p in model.named_parameters()}
    return {"peak_mib": peak, "shard_mib": shard_mib, "sums": sums, "in_place": in_place,
            "compiled_matches": compiled_matches}


def llama_round_trip(rank: int, world: int, pretrained: str, tokens: torch.Tensor,
                     save_to: str | None) -> dict[str, Any]:
    """A Hugging Face Llama built on the meta device, sharded, load_pretrained: its outputs and
    first training step (AdamW, data parallel over `tokens`) as the unsharded original's."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(pretrained)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    graphshard.shard(model)
    names = checkpoint.load_pretrained(model, pretrained)  # rotary buffers: as transformers does
    with torch.no_grad():
        logits = model(tokens).logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = tokens.chunk(world)[rank]
    loss = model(input_ids=local, labels=local).loss
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    result = {"names": names, "logits": logits, "loss": total.item() / world, "grads": grads,
              "after_step": full_state(model),
              "tied": model.lm_head._parameters["weight"]
              is model.model.embed_tokens._parameters["weight"]}
    if save_to is not None:
        checkpoint.save(save_to, model, optimizer, step=1)
    return result


def load_renamed_pretrained(rank: int, world: int, directories: dict[str, str],
                            tokens: torch.Tensor) -> dict[str, Any]:
    """Each architecture built on the meta device, sharded, load_pretrained from what
    transformers' save_pretrained wrote: its logits, or the error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    results = {}
    for name, directory in directories.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        graphshard.shard(model)
        try:
            checkpoint.load_pretrained(model, directory)
        except checkpoint.CheckpointError as exc:
            results[name] = str(exc)
            continue
        with torch.no_grad():
            results[name] = model(tokens).logits
    return results


# --------------------------------------------------------------------------- shared by the test modules

TOL = dict(atol=1e-6, rtol=0)


def assert_state_close(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOL, msg=name)
