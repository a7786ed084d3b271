"""The everyday checks test_everyday.py asserts on, run on each rank of one world-size-2 process
group: state dicts in and out, meta models, weights edited through attributes, requires_grad
toggled after shard(), copies, pickles and deep copies, wrapped or foreign-sharded models, and a
second run that loads the pickled models in fresh processes."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import os
import weakref

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.tensor import DTensor

import graphshard
from graphshard import checkpoint
from graphshard.runtime import sharded_class as sharded_class_module
from graphshard.runtime.sharded_class import sharded_class
from graphshard.state import module_shards
from tests.zoo import Zoo, zoo_batch, zoo_loss

STRATEGIES = ("full_shard", "no_shard")
TOL = 1e-5


def zoo_model(seed: int, device: str | None = None) -> Zoo:
    torch.manual_seed(seed)
    if device is None:
        return Zoo()
    with torch.device(device):
        return Zoo()


def _error(fn) -> str:
    """The message of what fn raises ("" when it does not raise)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return ""


def _bad_state(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A missing key, an unexpected key and a mis-shaped value."""
    bad = dict(full)
    del bad["block.bias"]
    bad["extra.weight"] = torch.zeros(1)
    bad["gate.weight"] = torch.zeros(2, 6)
    return bad


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return not a.numel() or (a - b).abs().max().item() <= TOL


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _shards(module: nn.Module) -> dict | None:
    """The module's local shards by parameter name (None: it owns no sharded parameter)."""
    record = module_shards(module)
    return None if record is None else record.shards


def _leaves_bound(model: nn.Module) -> bool:
    """Every local-shard leaf is bound to its module's current parameter and shares its storage
    (a leaf padded to the first rank's rows reads the parameter's rows first: its storage, its
    offset; an empty parameter's data_ptr() is 0 whatever its storage)."""
    for module in model.modules():
        for name, shard in (_shards(module) or {}).items():
            param, leaf = module._parameters[name], shard.leaf
            local = param.to_local()
            if shard.param is not param or (leaf.numel() and (
                    leaf.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
                    or leaf.storage_offset() != local.storage_offset())):
                return False
    return True


@contextlib.contextmanager
def _counting_gathers():
    """Counts the parameter properties' gathers (their module's call_unshard) in the block."""
    count = [0]
    original = sharded_class_module.call_unshard

    def counting(local, spec):
        count[0] += 1
        return original(local, spec)

    sharded_class_module.call_unshard = counting
    try:
        yield count
    finally:
        sharded_class_module.call_unshard = original


def _eager_step(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Forward, backward; the output and each trainable parameter's full gradient."""
    out = model(tokens)
    zoo_loss(out, tokens).backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _state_dict_checks(strategy: str, tokens: torch.Tensor) -> dict:
    result = {}
    start, target = zoo_model(0), zoo_model(1)
    target_state = target.state_dict()
    with torch.no_grad():
        result["target_out"] = target(tokens)
    model = graphshard.shard(zoo_model(0), strategy=strategy)
    storages = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}

    # Compiled (Inductor) before the load: the graph must read the loaded weights afterwards.
    compiled = torch.compile(model, backend="graphshard")
    with torch.no_grad():
        result["compiled_before"] = compiled(tokens)
        result["load"] = model.load_state_dict(target_state)
        result["compiled_after"] = compiled(tokens)
        result["eager_after"] = model(tokens)
    result["full_after"] = full_params(model)
    result["in_place"] = storages == {n: p.to_local().data_ptr()
                                      for n, p in model.named_parameters()}
    result["leaves_bound"] = _leaves_bound(model)

    # Strict and non-strict errors, as torch words them for the unsharded model.
    bad = _bad_state(target_state)
    result["strict_error"] = _error(lambda: model.load_state_dict(bad))
    result["plain_strict_error"] = _error(lambda: start.load_state_dict(bad))
    partial = {k: v for k, v in target_state.items() if k != "gate.bias"}
    partial["extra"] = torch.zeros(1)
    result["non_strict"] = model.load_state_dict(partial, strict=False)
    result["plain_non_strict"] = zoo_model(0).load_state_dict(partial, strict=False)

    # A DTensor state dict (model.state_dict()) still loads, in place.
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    result["state_dict_types"] = sorted({type(v).__name__ for k, v in saved.items()
                                         if k != "offset"})
    model.load_state_dict(start.state_dict())
    model.load_state_dict(saved)
    result["dtensor_reload"] = full_params(model)
    result["in_place_dtensor"] = storages == {n: p.to_local().data_ptr()
                                              for n, p in model.named_parameters()}

    # Full state dict out: on rank 0 only (CPU), or on every rank. README states its cost: DCP
    # reads each parameter of a submodule through its gathering property twice (torch 2.13).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with _counting_gathers() as gathers:
        result["full_rank0"] = get_model_state_dict(model, options=options)
    result["property_gathers"] = gathers[0]
    result["full_all"] = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True))
    # Full weights in from rank 0 only (other ranks pass {}).
    model.load_state_dict(start.state_dict())
    set_model_state_dict(model, target_state if torch.distributed.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    result["from_rank0"] = full_params(model)
    result["in_place_from_rank0"] = storages == {n: p.to_local().data_ptr()
                                                 for n, p in model.named_parameters()}
    torch._dynamo.reset()
    return result


def _meta_checks(strategy: str, tokens: torch.Tensor) -> dict:
    result = {}
    model = graphshard.shard(zoo_model(0, "meta"), strategy=strategy)
    result["eager_error"] = _error(lambda: model(tokens))
    compiled = torch.compile(model, backend="graphshard")
    result["compiled_error"] = _error(lambda: compiled(tokens))
    torch._dynamo.reset()
    # Full weights assigned into the meta model materialise it, each rank keeping its part.
    # (As in torch, assign=True unties tied weights: the reference is a meta Zoo assigned too.)
    target = zoo_model(1).state_dict()
    result["assign"] = model.load_state_dict(target, assign=True)
    result["assign_local_numels"] = {n: p.to_local().numel() for n, p in model.named_parameters()}
    result["assign_leaves_bound"] = _leaves_bound(model)
    result["assign_step"] = _eager_step(model, tokens)
    reference = zoo_model(0, "meta")
    reference.load_state_dict(target, assign=True)
    result["target_step"] = _eager_step(reference, tokens)
    return result


def _edit_weights(model: nn.Module) -> None:
    """Weight edits users make through module attributes: in place (with gradients on or off),
    and by assigning a new parameter."""
    torch.manual_seed(3)  # the same random init on every rank and on the reference
    nn.init.orthogonal_(model.block.weight)
    nn.init.zeros_(model.block.weight.chunk(3)[1])  # a part of a fused weight (rows 2-3)
    model.gate.weight = nn.Parameter(torch.full((1, 6), 0.1))  # (1, 6): an empty shard at 2
    with torch.no_grad():
        model.emb.weight[0].zero_()  # a padding row (11 rows: uneven shards; tied to the head)
        model.gate.bias.data.copy_(torch.tensor([0.25]))
        model.scale.mul_(2).add_(1)  # 0-dim: replicated
        model.frozen.bias.data = model.frozen.bias.data * 3  # Hugging Face's ViT init writes so
        model.frozen.weight -= 0.5


def _attribute_read_checks() -> dict:
    """What else users do with `module.weight` after shard(), eagerly."""
    model = graphshard.shard(zoo_model(0))
    checks = {}
    held = model.block.weight
    with torch.no_grad():
        model.block._parameters["weight"].add_(1.0)  # an optimizer step, say
        checks["stale_edit"] = _error(lambda: held[0].zero_())
        checks["reshaped_in_place"] = _error(lambda: model.gate.weight.t_())  # (1, 6) -> (6, 1)
    nn.Parameter(model.block.weight.detach())  # detach().requires_grad_() of the read
    checks["still_trainable"] = model.block._parameters["weight"].requires_grad
    checks["numpy"] = model.block.weight.detach().numpy().shape
    checks["deepcopy"] = type(copy.deepcopy(model.block.weight))
    checks["tolist"] = len(model.block.weight.tolist())
    return checks


def _requires_grad_checks(tokens: torch.Tensor) -> dict:
    """Compiled (Inductor) steps before and after freezing one module and unfreezing another
    (staged fine-tuning), then after editing weights through module attributes
    (`_edit_weights`); the same on the unsharded model, eagerly."""
    model, reference = graphshard.shard(zoo_model(0)), zoo_model(0)
    compiled = torch.compile(model, backend="graphshard")
    steps = {}
    for phase in ("before", "after", "edited"):
        if phase == "after":
            for m in (model, reference):
                m.block.weight.requires_grad = False  # through the attribute, as users write it
                m.block.bias.requires_grad_(False)
                m.frozen.requires_grad_(True)
        if phase == "edited":
            for m in (model, reference):
                _edit_weights(m)
            steps["edited_params"] = full_params(model)
            steps["edited_reference_params"] = {n: p.detach().clone()
                                                for n, p in reference.named_parameters()}
        zoo_loss(compiled(tokens), tokens).backward()
        steps[phase] = {n: p.grad.full_tensor() for n, p in model.named_parameters()
                        if p.grad is not None}
        zoo_loss(reference(tokens), tokens).backward()
        steps[f"{phase}_reference"] = {n: p.grad for n, p in reference.named_parameters()
                                       if p.grad is not None}
        steps[f"{phase}_attribute_grad"] = model.gate.weight.grad is model.gate._parameters["weight"].grad
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
    torch._dynamo.reset()
    return steps


def _copy_checks(strategy: str, tokens: torch.Tensor, rank: int, directory: str) -> dict:
    result = {}
    model = graphshard.shard(zoo_model(0), strategy=strategy,
                             param_dtype=torch.float64 if strategy == "no_shard" else None)
    shallow = copy.copy(model)
    result["shallow_shares"] = all(
        _shards(a) == _shards(b)
        and a._parameters is b._parameters
        for a, b in zip(model.modules(), shallow.modules()))
    twin = copy.deepcopy(model)
    result["twin_class_shared"] = all(type(a) is type(b) for a, b in
                                      zip(model.modules(), twin.modules()))
    result["twin_leaves_bound"] = _leaves_bound(twin)
    result["twin_tied"] = _shards(twin.emb)["weight"] is _shards(twin.head)["weight"]
    result["twin_storage_own"] = all(
        a.to_local().data_ptr() != b.to_local().data_ptr() or not a.to_local().numel()
        for a, b in zip(model.parameters(), twin.parameters()))
    result["twin_step"] = _eager_step(twin, tokens)
    result["original_grads_after_twin"] = [n for n, p in model.named_parameters()
                                           if p.grad is not None]
    result["step"] = _eager_step(model, tokens)
    for p in model.parameters():
        p.grad = None

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    result["reloaded_leaves_bound"] = _leaves_bound(again)
    result["reloaded_step"] = _eager_step(again, tokens)
    # For a fresh process (reload_checks, below): this rank's pickle, expectations
    torch.save({"model": model, "step": result["step"]},
               os.path.join(directory, f"{strategy}-rank{rank}.pt"))
    return result


def _wrapper_errors() -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    errors = {}
    errors["ddp"] = _error(lambda: graphshard.shard(DistributedDataParallel(nn.Linear(4, 4))))
    nested = nn.Sequential(nn.Linear(4, 4), DistributedDataParallel(nn.Linear(4, 4)))
    errors["ddp_nested"] = _error(lambda: graphshard.shard(nested))
    errors["fsdp2"] = _error(lambda: graphshard.shard(fully_shard(nn.Linear(4, 4))))
    # FSDP1 cannot be built without an accelerator: an instance as far as isinstance goes.
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(fsdp1)
    errors["fsdp1"] = _error(lambda: graphshard.shard(fsdp1))
    tp = nn.Linear(4, 4)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), init_device_mesh("cpu", (2,)),
                                               [Shard(1)]))
    errors["dtensor"] = _error(lambda: graphshard.shard(tp))
    sharded = graphshard.shard(nn.Sequential(nn.Linear(4, 4)))
    errors["twice"] = _error(lambda: graphshard.shard(sharded[0]))
    return errors


def _setup_order_checks(tokens: torch.Tensor, directory: str) -> dict:
    """What DDP allows that shard() must too: an optimizer built before sharding, and the
    model cast after it (`model.double()`). Eager steps, every rank on the same tokens."""
    def train(model, optimizer, steps: int = 2):
        for _ in range(steps):
            zoo_loss(model(tokens), tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
                for n, p in model.named_parameters()}

    checks = {}
    early = zoo_model(0)
    optimizer = torch.optim.AdamW(early.parameters(), lr=0.1)
    checks["optimizer_first"] = train(graphshard.shard(early), optimizer)
    usual = graphshard.shard(zoo_model(0))
    usual_optimizer = torch.optim.AdamW(usual.parameters(), lr=0.1)
    checks["optimizer_after"] = train(usual, usual_optimizer)
    # Resuming: the optimizer is built before shard(), then loaded (state and all) and stepped.
    path = os.path.join(directory, "setup-order")
    checkpoint.save(path, usual, usual_optimizer)
    resumed = zoo_model(1)  # other weights: the load brings them
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    checkpoint.load(path, graphshard.shard(resumed), optimizer)
    checks["resumed"] = train(resumed, optimizer, steps=1)
    checks["continued"] = train(usual, usual_optimizer, steps=1)
    stepped = zoo_model(0)
    optimizer = torch.optim.AdamW(stepped.parameters(), lr=0.1)
    train(stepped, optimizer, steps=1)
    checks["stepped_first"] = _error(lambda: train(graphshard.shard(stepped), optimizer, steps=1))

    # shard() swaps the shards into a live optimizer at once: the originals are freed, and
    # GradScaler.unscale_ over the optimizer's groups before its first step reaches the gradients.
    scaled = zoo_model(0)
    original = weakref.ref(scaled.block.weight)
    optimizer = torch.optim.SGD(scaled.parameters(), lr=0.1)
    graphshard.shard(scaled)
    gc.collect()
    checks["original_freed"] = original() is None
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # a power of two: unscaling is exact
    for _ in range(2):
        scaler.scale(zoo_loss(scaled(tokens), tokens)).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    checks["scaled"] = train(scaled, optimizer, steps=0)
    unscaled = graphshard.shard(zoo_model(0))
    checks["unscaled"] = train(unscaled, torch.optim.SGD(unscaled.parameters(), lr=0.1))

    adagrad = zoo_model(0)  # its constructor makes state for every parameter
    optimizer = torch.optim.Adagrad(adagrad.parameters(), lr=0.1)
    checks["adagrad_first"] = _error(lambda: train(graphshard.shard(adagrad), optimizer, steps=1))
    partly = graphshard.shard(zoo_model(0))
    partly.head.double()  # head.weight is emb.weight: the embedding reads the cast weight too
    checks["tied_cast"] = (partly.emb.weight.dtype,
                           _shards(partly.emb)["weight"] is _shards(partly.head)["weight"])

    cast, reference = graphshard.shard(zoo_model(0)).double(), zoo_model(0).double()
    # Inductor (the default compiler) with the native transports (the path NCCL users run)
    compiled = torch.compile(cast, backend="graphshard",
                             options={"all_gather": "native", "reduce_scatter": "native"})
    checks["cast"] = {}
    for name, model in (("eager", cast), ("compiled", compiled), ("reference", reference)):
        loss = zoo_loss(model(tokens), tokens)
        loss.backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                 for n, p in (reference if name == "reference" else cast).named_parameters()
                 if p.grad is not None}
        (reference if name == "reference" else cast).zero_grad()
        checks["cast"][name] = (loss.detach(), grads)
    return checks


def everyday_checks(rank: int, world: int, directory: str) -> dict:
    tokens = zoo_batch(4)
    results = {"wrappers": _wrapper_errors(), "requires_grad": _requires_grad_checks(tokens),
               "setup_order": _setup_order_checks(tokens, directory),
               "bf16_edit_error": _error(lambda: nn.init.zeros_(
                   graphshard.shard(zoo_model(0), param_dtype=torch.bfloat16).block.weight)),
               "attribute_reads": _attribute_read_checks(),
               "reshaped_error": _error(lambda: setattr(
                   graphshard.shard(zoo_model(0)).block, "weight", nn.Parameter(torch.zeros(2, 6))))}
    for strategy in STRATEGIES:
        results[strategy] = {**_state_dict_checks(strategy, tokens),
                             **_meta_checks(strategy, tokens),
                             **_copy_checks(strategy, tokens, rank, directory)}
    return results


def reload_checks(rank: int, world: int, directory: str) -> dict:
    """In a fresh process group: load this rank's pickled model and take a step with it."""
    tokens = zoo_batch(4)
    results = {}
    for strategy in STRATEGIES:
        saved = torch.load(os.path.join(directory, f"{strategy}-rank{rank}.pt"),
                           weights_only=False)
        model = saved["model"]
        results[strategy] = {
            "class": type(model.block) is sharded_class(nn.Linear, ("bias", "weight")),
            "leaves_bound": _leaves_bound(model),
            "step": _eager_step(model, tokens),
            "expected": saved["step"],
        }
    return results
