"""Everyday calls on a sharded model: loading full and DTensor state dicts, getting
the full state dict, torch.save / pickle / deepcopy of the module, wrapped or foreign-sharded
models refused at shard(), a meta model never materialised, bad backend options.

One world-size-2 run does every check for full_shard and no_shard (one process group, one
Inductor compile per strategy; the checks are in everyday_workers.py); a second run loads the
pickled models in fresh processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphshard
from everyday_workers import (STRATEGIES, everyday_checks, full_params, reload_checks, same,
                              zoo_model)
from graphshard.tools.launch import run_local


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # Its first launch compiles with Inductor: the tests that read it are marked slow.
    directory = str(tmp_path_factory.mktemp("everyday"))
    first = run_local(everyday_checks, 2, directory)
    return first, run_local(reload_checks, 2, directory)


def _each(runs):
    for rank, result in enumerate(runs[0]):
        for strategy in STRATEGIES:
            yield rank, strategy, result[strategy]


def _steps_match(a, b) -> bool:
    (out_a, grads_a), (out_b, grads_b) = a, b
    return same(out_a, out_b) and grads_a.keys() == grads_b.keys() and all(
        same(grads_a[n], grads_b[n]) for n in grads_a)


@pytest.mark.slow
def test_full_state_dict_loads_in_place_and_the_compiled_model_reads_it(runs):
    target = zoo_model(1).state_dict()
    for rank, strategy, r in _each(runs):
        where = (rank, strategy)
        assert r["load"].missing_keys == [] and r["load"].unexpected_keys == [], where
        assert r["in_place"] and r["leaves_bound"], where
        for name, value in r["full_after"].items():
            assert same(value, target[name]), (where, name)
        assert same(r["eager_after"], r["target_out"]), where
        assert same(r["compiled_after"], r["target_out"]), where
        assert not same(r["compiled_before"], r["target_out"]), where


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
                assert same(got[name], want[name]), (rank, phase, name)


@pytest.mark.slow
def test_weights_edited_through_attributes_reach_the_shards_and_the_compiled_step(runs):
    # Reading module.weight gathers a copy: an edit of that copy (nn.init, .data.copy_, a
    # padding row zeroed) must be written back to the shard, or it is silently lost; a
    # parameter assigned to the attribute must become a shard, or each rank trains its own.
    for rank, result in enumerate(runs[0]):
        steps = result["requires_grad"]
        got, want = steps["edited_params"], steps["edited_reference_params"]
        for name in want:
            assert same(got[name], want[name]), (rank, name)
        assert not got["emb.weight"][0].any() and got["scale"].item() == pytest.approx(4.0)
        assert steps["edited_attribute_grad"]  # module.weight.grad is the parameter's
        assert steps["edited"].keys() == steps["edited_reference"].keys()
        for name in steps["edited_reference"]:
            assert same(steps["edited"][name], steps["edited_reference"][name]), (rank, name)
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
    return zoo_model(0).block.weight.detach()


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
            assert same(value, r["full_after"][name]), (rank, strategy, name)


@pytest.mark.slow
def test_full_state_dict_out_on_rank0_or_everywhere(runs):
    target = zoo_model(1).state_dict()
    for rank, strategy, r in _each(runs):
        where = (rank, strategy)
        for full in ([r["full_rank0"]] if rank == 0 else []) + [r["full_all"]]:
            assert full.keys() == target.keys(), where
            for name, value in full.items():
                assert type(value) is torch.Tensor and same(value, target[name]), (where, name)
        if rank != 0:
            assert r["full_rank0"] == {}, where
        in_submodules = [k for k in target if "." in k]  # the 8 parameter slots of submodules
        assert r["property_gathers"] == 2 * len(in_submodules), where


@pytest.mark.slow
def test_full_state_dict_in_from_rank0(runs):
    target = zoo_model(1).state_dict()
    for rank, strategy, r in _each(runs):
        assert r["in_place_from_rank0"], (rank, strategy)
        for name, value in r["from_rank0"].items():
            assert same(value, target[name]), (rank, strategy, name)


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
        reinitialised[kind] = full_params(model)
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
