"""Everyday calls on a sharded model: loading full and DTensor state dicts, getting
the full state dict, torch.save / pickle / deepcopy of the module, wrapped or foreign-sharded
models refused at shard(), a meta model never materialised, bad backend options.

One world-size-2 run does every check for full_shard and no_shard (one process group, one
Inductor compile per strategy); a second run loads the pickled models in fresh processes."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import os
import weakref

import pytest
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
from graphshard.tools.launch import run_local
from tests.zoo import Zoo, zoo_batch, zoo_loss

STRATEGIES = ("full_shard", "no_shard")
TOL = 1e-5


def _zoo(seed: int, device: str | None = None) -> Zoo:
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


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return not a.numel() or (a - b).abs().max().item() <= TOL


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _shards(module: nn.Module) -> dict | None:
    """The module's local shards by parameter name (None: it owns no sharded parameter)."""
    record = module_shards(module)
    return None if record is None else record.shards


def _leaves_bound(model: nn.Module) -> bool:
    """Every local-shard leaf is bound to its module's current parameter and shares its storage."""
    for module in model.modules():
        for name, shard in (_shards(module) or {}).items():
            param, leaf = module._parameters[name], shard.leaf
            if shard.param is not param or (
                    leaf.numel() and leaf.data_ptr() != param.to_local().data_ptr()):
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
    start, target = _zoo(0), _zoo(1)
    target_state = target.state_dict()
    with torch.no_grad():
        result["target_out"] = target(tokens)
    model = graphshard.shard(_zoo(0), strategy=strategy)
    storages = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}

    # Compiled (Inductor) before the load: the graph must read the loaded weights afterwards.
    compiled = torch.compile(model, backend="graphshard")
    with torch.no_grad():
        result["compiled_before"] = compiled(tokens)
        result["load"] = model.load_state_dict(target_state)
        result["compiled_after"] = compiled(tokens)
        result["eager_after"] = model(tokens)
    result["full_after"] = _full_params(model)
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
    result["plain_non_strict"] = _zoo(0).load_state_dict(partial, strict=False)

    # A DTensor state dict (model.state_dict()) still loads, in place.
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    result["state_dict_types"] = sorted({type(v).__name__ for k, v in saved.items()
                                         if k != "offset"})
    model.load_state_dict(start.state_dict())
    model.load_state_dict(saved)
    result["dtensor_reload"] = _full_params(model)
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
    result["from_rank0"] = _full_params(model)
    result["in_place_from_rank0"] = storages == {n: p.to_local().data_ptr()
                                                 for n, p in model.named_parameters()}
    torch._dynamo.reset()
    return result


def _meta_checks(strategy: str, tokens: torch.Tensor) -> dict:
    result = {}
    model = graphshard.shard(_zoo(0, "meta"), strategy=strategy)
    result["eager_error"] = _error(lambda: model(tokens))
    compiled = torch.compile(model, backend="graphshard")
    result["compiled_error"] = _error(lambda: compiled(tokens))
    torch._dynamo.reset()
    # Full weights assigned into the meta model materialise it, each rank keeping its part.
    # (As in torch, assign=True unties tied weights: the reference is a meta Zoo assigned too.)
    target = _zoo(1).state_dict()
    result["assign"] = model.load_state_dict(target, assign=True)
    result["assign_local_numels"] = {n: p.to_local().numel() for n, p in model.named_parameters()}
    result["assign_leaves_bound"] = _leaves_bound(model)
    result["assign_step"] = _eager_step(model, tokens)
    reference = _zoo(0, "meta")
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
    model = graphshard.shard(_zoo(0))
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
    model, reference = graphshard.shard(_zoo(0)), _zoo(0)
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
            steps["edited_params"] = _full_params(model)
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
    model = graphshard.shard(_zoo(0), strategy=strategy,
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
    # For a fresh process (tests/test_everyday.py::_reload): this rank's pickle, expectations
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
    early = _zoo(0)
    optimizer = torch.optim.AdamW(early.parameters(), lr=0.1)
    checks["optimizer_first"] = train(graphshard.shard(early), optimizer)
    usual = graphshard.shard(_zoo(0))
    usual_optimizer = torch.optim.AdamW(usual.parameters(), lr=0.1)
    checks["optimizer_after"] = train(usual, usual_optimizer)
    # Resuming: the optimizer is built before shard(), then loaded (state and all) and stepped.
    path = os.path.join(directory, "setup-order")
    checkpoint.save(path, usual, usual_optimizer)
    resumed = _zoo(1)  # other weights: the load brings them
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    checkpoint.load(path, graphshard.shard(resumed), optimizer)
    checks["resumed"] = train(resumed, optimizer, steps=1)
    checks["continued"] = train(usual, usual_optimizer, steps=1)
    stepped = _zoo(0)
    optimizer = torch.optim.AdamW(stepped.parameters(), lr=0.1)
    train(stepped, optimizer, steps=1)
    checks["stepped_first"] = _error(lambda: train(graphshard.shard(stepped), optimizer, steps=1))

    # shard() swaps the shards into a live optimizer at once: the originals are freed, and
    # GradScaler.unscale_ over the optimizer's groups before its first step reaches the gradients.
    scaled = _zoo(0)
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
    unscaled = graphshard.shard(_zoo(0))
    checks["unscaled"] = train(unscaled, torch.optim.SGD(unscaled.parameters(), lr=0.1))

    adagrad = _zoo(0)  # its constructor makes state for every parameter
    optimizer = torch.optim.Adagrad(adagrad.parameters(), lr=0.1)
    checks["adagrad_first"] = _error(lambda: train(graphshard.shard(adagrad), optimizer, steps=1))
    partly = graphshard.shard(_zoo(0))
    partly.head.double()  # head.weight is emb.weight: the embedding reads the cast weight too
    checks["tied_cast"] = (partly.emb.weight.dtype,
                           _shards(partly.emb)["weight"] is _shards(partly.head)["weight"])

    cast, reference = graphshard.shard(_zoo(0)).double(), _zoo(0).double()
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


def _everyday(rank: int, world: int, directory: str) -> dict:
    tokens = zoo_batch(4)
    results = {"wrappers": _wrapper_errors(), "requires_grad": _requires_grad_checks(tokens),
               "setup_order": _setup_order_checks(tokens, directory),
               "bf16_edit_error": _error(lambda: nn.init.zeros_(
                   graphshard.shard(_zoo(0), param_dtype=torch.bfloat16).block.weight)),
               "attribute_reads": _attribute_read_checks(),
               "reshaped_error": _error(lambda: setattr(
                   graphshard.shard(_zoo(0)).block, "weight", nn.Parameter(torch.zeros(2, 6))))}
    for strategy in STRATEGIES:
        results[strategy] = {**_state_dict_checks(strategy, tokens),
                             **_meta_checks(strategy, tokens),
                             **_copy_checks(strategy, tokens, rank, directory)}
    return results


def _reload(rank: int, world: int, directory: str) -> dict:
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # Its first launch compiles with Inductor: the tests that read it are marked slow.
    directory = str(tmp_path_factory.mktemp("everyday"))
    first = run_local(_everyday, 2, directory)
    return first, run_local(_reload, 2, directory)


def _each(runs):
    for rank, result in enumerate(runs[0]):
        for strategy in STRATEGIES:
            yield rank, strategy, result[strategy]


def _steps_match(a, b) -> bool:
    (out_a, grads_a), (out_b, grads_b) = a, b
    return _same(out_a, out_b) and grads_a.keys() == grads_b.keys() and all(
        _same(grads_a[n], grads_b[n]) for n in grads_a)


@pytest.mark.slow
def test_full_state_dict_loads_in_place_and_the_compiled_model_reads_it(runs):
    target = _zoo(1).state_dict()
    for rank, strategy, r in _each(runs):
        where = (rank, strategy)
        assert r["load"].missing_keys == [] and r["load"].unexpected_keys == [], where
        assert r["in_place"] and r["leaves_bound"], where
        for name, value in r["full_after"].items():
            assert _same(value, target[name]), (where, name)
        assert _same(r["eager_after"], r["target_out"]), where
        assert _same(r["compiled_after"], r["target_out"]), where
        assert not _same(r["compiled_before"], r["target_out"]), where


@pytest.mark.slow
def test_freezing_and_unfreezing_after_shard_take_effect_in_the_compiled_step(runs):
    # The compiled graph reads a plain leaf per parameter, not the parameter: a requires_grad
    # changed after shard() must still reach it (it recompiles), or a frozen module would keep
    # training and an unfrozen one would silently never train.
    for rank, result in enumerate(runs[0]):
        steps = result["requires_grad"]
        assert "block.weight" in steps["before"] and "frozen.weight" not in steps["before"]
        assert "block.weight" not in steps["after"] and "frozen.weight" in steps["after"]
        for phase in ("before", "after"):
            got, want = steps[phase], steps[f"{phase}_reference"]
            assert got.keys() == want.keys(), (rank, phase, sorted(got), sorted(want))
            for name in want:
                assert _same(got[name], want[name]), (rank, phase, name)


@pytest.mark.slow
def test_weights_edited_through_attributes_reach_the_shards_and_the_compiled_step(runs):
    # Reading module.weight gathers a copy: an edit of that copy (nn.init, .data.copy_, a
    # padding row zeroed) must be written back to the shard, or it is silently lost; a
    # parameter assigned to the attribute must become a shard, or each rank trains its own.
    for rank, result in enumerate(runs[0]):
        steps = result["requires_grad"]
        got, want = steps["edited_params"], steps["edited_reference_params"]
        for name in want:
            assert _same(got[name], want[name]), (rank, name)
        assert not got["emb.weight"][0].any() and got["scale"].item() == pytest.approx(4.0)
        assert steps["edited_attribute_grad"]  # module.weight.grad is the parameter's
        assert steps["edited"].keys() == steps["edited_reference"].keys()
        for name in steps["edited_reference"]:
            assert _same(steps["edited"][name], steps["edited_reference"][name]), (rank, name)
        # A weight read in its compute dtype is a rounded copy: editing it is refused, by name.
        assert ("ValueError: graphshard: ShardedLinear.weight was edited in place, but reading "
                "it returns a torch.bfloat16 copy") in result["bf16_edit_error"], result
        assert ("ValueError: graphshard: ShardedLinear.weight was replaced after graphshard.shard "
                "by a tensor of shape (2, 6); the sharded parameter has shape (6, 6)"
                ) in result["reshaped_error"], result


@pytest.mark.slow
def test_a_read_of_module_weight_behaves_like_the_weight(runs):
    for result in runs[0]:
        checks = result["attribute_reads"]
        # an edit through a read held across a change of the parameter would undo the change
        assert "ValueError: graphshard: ShardedLinear.weight was edited in place through a read " \
               "made before the parameter last changed" in checks["stale_edit"], checks
        assert "ValueError: graphshard: ShardedLinear.weight was reshaped in place to (6, 1); a " \
               "sharded parameter keeps its shape (1, 6)" in checks["reshaped_in_place"], checks
        assert checks["still_trainable"]  # a detached copy's requires_grad is its own
        assert checks["numpy"] == (6, 6) and checks["tolist"] == 6
        assert checks["deepcopy"] is torch.Tensor  # the values, not the module behind them


@pytest.mark.slow
def test_an_optimizer_built_before_shard_trains_the_shards_and_a_cast_after_shard_holds(runs):
    for result in runs[0]:
        checks = result["setup_order"]
        early, usual = checks["optimizer_first"], checks["optimizer_after"]
        assert early.keys() == usual.keys()
        assert all(torch.equal(early[n], usual[n]) for n in usual), "optimizer order changed training"
        assert not torch.equal(early["block.weight"], _initial_block_weight()), "nothing trained"
        assert checks["stepped_first"].startswith("ValueError: AdamW holds state for 6 "
                                                  "parameter(s)"), checks["stepped_first"]
        assert "Create the optimizer after graphshard.shard(model)" in checks["stepped_first"]
        assert checks["adagrad_first"].startswith("ValueError: Adagrad holds state for 8 "
                                                  "parameter(s)"), checks["adagrad_first"]
        assert checks["original_freed"], "an early optimizer still holds a full parameter"
        scaled, unscaled = checks["scaled"], checks["unscaled"]
        assert all(torch.equal(scaled[n], unscaled[n]) for n in unscaled), "GradScaler missed"
        assert checks["tied_cast"] == (torch.float64, True)
        resumed, continued = checks["resumed"], checks["continued"]
        assert all(torch.equal(resumed[n], continued[n]) for n in continued), "resume differs"
        reference_loss, reference_grads = checks["cast"]["reference"]
        assert reference_loss.dtype == torch.float64
        for name in ("eager", "compiled"):
            loss, grads = checks["cast"][name]
            assert loss.dtype == torch.float64 and torch.allclose(loss, reference_loss, atol=1e-12)
            assert grads.keys() == reference_grads.keys(), name
            for n, grad in reference_grads.items():
                assert grads[n].dtype == torch.float64
                assert torch.allclose(grads[n], grad, atol=1e-12), (name, n)


def _initial_block_weight() -> torch.Tensor:
    return _zoo(0).block.weight.detach()


@pytest.mark.slow
def test_bad_keys_are_named_as_torch_names_them(runs):
    for rank, strategy, r in _each(runs):
        where = (rank, strategy)
        message = r["strict_error"]
        assert 'Missing key(s) in state_dict: "block.bias"' in message, where
        assert 'Unexpected key(s) in state_dict: "extra.weight"' in message, where
        assert "size mismatch for gate.weight: copying a param with shape torch.Size([2, 6])" \
            in message, where
        assert message.replace("ShardedZoo", "Zoo") == r["plain_strict_error"], where
        assert r["non_strict"] == r["plain_non_strict"], where
        assert r["non_strict"].missing_keys == ["gate.bias"], where


@pytest.mark.slow
def test_dtensor_state_dict_round_trips(runs):
    for rank, strategy, r in _each(runs):
        assert r["state_dict_types"] == ["DTensor"], (rank, strategy)
        assert r["in_place_dtensor"], (rank, strategy)
        for name, value in r["dtensor_reload"].items():
            assert _same(value, r["full_after"][name]), (rank, strategy, name)


@pytest.mark.slow
def test_full_state_dict_out_on_rank0_or_everywhere(runs):
    target = _zoo(1).state_dict()
    for rank, strategy, r in _each(runs):
        where = (rank, strategy)
        for full in ([r["full_rank0"]] if rank == 0 else []) + [r["full_all"]]:
            assert full.keys() == target.keys(), where
            for name, value in full.items():
                assert type(value) is torch.Tensor and _same(value, target[name]), (where, name)
        if rank != 0:
            assert r["full_rank0"] == {}, where
        in_submodules = [k for k in target if "." in k]  # the 8 parameter slots of submodules
        assert r["property_gathers"] == 2 * len(in_submodules), where


@pytest.mark.slow
def test_full_state_dict_in_from_rank0(runs):
    target = _zoo(1).state_dict()
    for rank, strategy, r in _each(runs):
        assert r["in_place_from_rank0"], (rank, strategy)
        for name, value in r["from_rank0"].items():
            assert _same(value, target[name]), (rank, strategy, name)


@pytest.mark.slow
def test_meta_model_never_materialised_names_parameters_and_materialize(runs):
    for rank, strategy, r in _each(runs):
        for key in ("eager_error", "compiled_error"):
            message = r[key]
            assert message.startswith("RuntimeError: graphshard: parameter(s) emb.weight are "
                                      "still on the meta device"), (rank, strategy, key, message)
            assert "graphshard.materialize(model)" in message, (rank, strategy, key)


@pytest.mark.slow
def test_full_weights_assigned_into_a_meta_model(runs):
    for rank, strategy, r in _each(runs):
        where = (rank, strategy)
        assert r["assign"].missing_keys == [] and r["assign"].unexpected_keys == [], where
        assert r["assign_leaves_bound"], where
        # each rank holds only its part: 11 embedding rows at world size 2 -> 6 or 5
        expected_rows = 11 if strategy == "no_shard" else (6, 5)[rank]
        assert r["assign_local_numels"]["emb.weight"] == expected_rows * 6, where
        assert _steps_match(r["assign_step"], r["target_step"]), where


@pytest.mark.slow
def test_deepcopy_is_independent(runs):
    for rank, strategy, r in _each(runs):
        where = (rank, strategy)
        assert r["shallow_shares"], where
        assert r["twin_class_shared"] and r["twin_leaves_bound"] and r["twin_tied"], where
        assert r["twin_storage_own"], where
        assert r["original_grads_after_twin"] == [], where  # the twin's grads stay its own
        assert _steps_match(r["twin_step"], r["step"]), where


@pytest.mark.slow
def test_pickled_model_loads_and_trains(runs):
    for rank, strategy, r in _each(runs):
        assert r["reloaded_leaves_bound"], (rank, strategy)
        assert _steps_match(r["reloaded_step"], r["step"]), (rank, strategy)
    for rank, result in enumerate(runs[1]):
        for strategy in STRATEGIES:
            r = result[strategy]
            assert r["class"] and r["leaves_bound"], (rank, strategy)
            assert _steps_match(r["step"], r["expected"]), (rank, strategy)


@pytest.mark.slow
def test_wrapped_or_foreign_sharded_models_are_refused(runs):
    for errors in (result["wrappers"] for result in runs[0]):
        assert errors["ddp"].startswith("ValueError: graphshard.shard: the model "
                                        "(DistributedDataParallel) is wrapped in "
                                        "DistributedDataParallel"), errors["ddp"]
        assert "graphshard.shard(ddp_model.module)" in errors["ddp"]
        assert "submodule '1' (DistributedDataParallel)" in errors["ddp_nested"]
        assert "already sharded by FSDP2's fully_shard" in errors["fsdp2"], errors["fsdp2"]
        assert "wrapped in FullyShardedDataParallel (FSDP1)" in errors["fsdp1"], errors["fsdp1"]
        assert "parameter 'weight' is already a DTensor ((Shard(dim=1),)" in errors["dtensor"]
        assert "already sharded by graphshard" in errors["twice"], errors["twice"]


def test_unknown_backend_option_is_the_first_line(fake_pg):
    model = graphshard.shard(nn.Linear(4, 4))
    compiled = torch.compile(model, backend="graphshard", options={"bucket": 1})
    with pytest.raises(ValueError) as info:
        compiled(torch.randn(2, 4))
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith("unknown graphshard option(s) ['bucket']; valid options: "
                                 "bucket_mb"), first_line
    torch._dynamo.reset()


def _hugging_face_model(kind: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2))
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                      bos_token_id=0, eos_token_id=0))  # tied head


HF_KINDS = ("llama", "gpt2")


def _reinitialised(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    reinitialised = {}
    for kind in HF_KINDS:
        model = graphshard.shard(_hugging_face_model(kind))
        torch.manual_seed(1)
        model.apply(model._init_weights)  # Hugging Face's init, after sharding
        reinitialised[kind] = _full_params(model)
    return reinitialised


@pytest.fixture(scope="module")
def reinitialised() -> list[dict[str, dict[str, torch.Tensor]]]:
    return run_local(_reinitialised, 2)  # one launch for every kind


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hugging_face_init_weights_after_shard_gives_the_unsharded_models_weights(kind,
                                                                                 reinitialised):
    reference = _hugging_face_model(kind)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    torch.manual_seed(1)
    reference.apply(reference._init_weights)
    assert any(not torch.equal(before[n], p) for n, p in reference.named_parameters())
    for params in (per_rank[kind] for per_rank in reinitialised):
        for name, value in reference.named_parameters():
            assert torch.equal(params[name], value), name
