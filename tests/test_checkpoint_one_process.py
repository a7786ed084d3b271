"""Checkpoints that need none of test_checkpoint.py's shared runs: pretrained safetensors
weights (Hugging Face's layouts) into plain, meta and sharded models, DCP layouts, saves and
loads in one process, and clear errors for bad input."""

from __future__ import annotations

import shutil
import struct

import pytest
import torch
import torch.nn as nn

import ckpt_workers as workers
from ckpt_workers import TOL, assert_state_close
from graphshard import checkpoint
from graphshard.tools.cli import main as cli_main
from graphshard.tools.launch import run_local
from zoo import plain_zoo, pretrained_llamas, tiny_llama, zoo_batch, zoo_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Tiny Hugging Face Llamas saved with save_pretrained (transformers is a test dependency)."""
    return pretrained_llamas(tmp_path_factory.mktemp("hf"))


# --------------------------------------------------------------------------- saves and loads


def test_save_before_first_optimizer_step_changes_nothing(tmp_path):
    # DCP's get_state_dict initialises a fresh optimizer with a zero-lr step (Adam's step
    # count 1); neither the saving run nor a run resumed from the save may see that.
    untouched = workers.train(*workers.make(seed=3, sharded=False), 0, 2)
    model, optimizer = workers.make(seed=3, sharded=False)
    checkpoint.save(tmp_path / "c0", model, optimizer, step=0)
    assert workers.train(model, optimizer, 0, 2) == untouched
    model, optimizer = workers.make(seed=4, sharded=False)
    checkpoint.load(tmp_path / "c0", model, optimizer)
    assert not optimizer.state
    assert workers.train(model, optimizer, 0, 2) == untouched


def test_derived_rng_for_ranks_the_checkpoint_lacks():
    state = torch.get_rng_state()
    seeds = [checkpoint.derived_seed(state, rank) for rank in range(8)]
    assert len(set(seeds)) == 8
    assert seeds == [checkpoint.derived_seed(state.clone(), rank) for rank in range(8)]


class _Wrapper(nn.Module):
    """A model whose own keys start with "model." (as Hugging Face models' do)."""

    def __init__(self):
        super().__init__()
        self.model = plain_zoo()


@pytest.mark.parametrize("nested", [False, True])
def test_root_and_nested_layouts_are_told_apart(tmp_path, nested):
    import torch.distributed.checkpoint as dcp

    source = _Wrapper()
    state = source.state_dict()
    dcp.save({"model": state} if nested else state, checkpoint_id=tmp_path / "c", no_dist=True)
    target = _Wrapper()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    checkpoint.load(tmp_path / "c", target)
    assert_state_close(target.state_dict(), state)
    assert checkpoint.export(tmp_path / "c", tmp_path / "w.safetensors") == list(state)


def test_async_save_without_process_group(tmp_path):
    model, optimizer = workers.make(seed=3, sharded=False)
    workers.train(model, optimizer, 0, 1)
    at_save = workers.full_state(model)
    handle = checkpoint.save(tmp_path / "c", model, optimizer, step=1, asynchronous=True)
    workers.train(model, optimizer, 1, 2)
    assert handle.result() == tmp_path / "c" and handle.done()
    model2, optimizer2 = workers.make(seed=4, sharded=False)
    assert checkpoint.load(tmp_path / "c", model2, optimizer2).step == 1
    assert_state_close(workers.full_state(model2), at_save)


# --------------------------------------------------------------------------- pretrained weights


def test_load_pretrained_into_unsharded_and_materialised_models(hf):
    path = hf["untied"]["path"]
    original = tiny_llama(tied=False)
    with torch.device("meta"):
        meta = tiny_llama(tied=False)
    checkpoint.load_pretrained(meta, path)  # rotary buffers computed as transformers does
    real = tiny_llama(tied=False, seed=1)  # loaded in place, over other weights
    params = {n: p for n, p in real.named_parameters()}
    checkpoint.load_pretrained(real, path)
    assert all(p is params[n] for n, p in real.named_parameters())
    for model in (meta, real):
        assert_state_close(dict(sorted(model.state_dict().items())),
                            dict(sorted(original.state_dict().items())))
        assert_state_close({k: v for k, v in model.named_buffers()},
                            {k: v for k, v in original.named_buffers()})


def test_load_pretrained_bad_input(hf, tmp_path):
    from safetensors.torch import save_file

    path = hf["untied"]["path"]
    with torch.device("meta"):
        tied = tiny_llama(tied=True)
    with pytest.warns(UserWarning, match=r"\['model.embed_tokens.weight', 'lm_head.weight'\] "
                                         r"separately.*ties into one tensor"):
        checkpoint.load_pretrained(tied, path, init_fn=tied._init_weights)  # saved untied
    saved = tiny_llama(tied=False)  # what the fixture saved
    assert torch.equal(tied.lm_head.weight, saved.model.embed_tokens.weight)  # the first name's
    assert not torch.equal(tied.lm_head.weight, saved.lm_head.weight)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load_pretrained(plain_zoo(), hf["tied"]["path"])
    message = str(info.value)
    assert "missing" in message and "'emb.weight = head.weight'" in message
    assert "unexpected" in message and "'model.norm.weight'" in message

    state = plain_zoo().state_dict()
    state.pop("head.weight")  # tied: one name is enough
    state["block.weight"] = torch.zeros(6, 7)
    state["extra"] = torch.zeros(2)
    save_file(state, str(tmp_path / "zoo.safetensors"))
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load_pretrained(plain_zoo(), tmp_path / "zoo.safetensors")
    message = str(info.value)
    assert "block.weight: file (6, 7) vs model (6, 6)" in message
    assert "unexpected (in the file, not in the model): ['extra']" in message
    assert "missing" not in message

    # transformers loads an old `LayerNorm.gamma` as `LayerNorm.weight`: a file holding both
    # is ambiguous, not a silent pick of one.
    from transformers import BertConfig, BertModel
    bert = BertModel(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=16))
    state = {name: tensor.contiguous() for name, tensor in bert.state_dict().items()}
    state["embeddings.LayerNorm.gamma"] = torch.ones(8)
    save_file(state, str(tmp_path / "bert.safetensors"))
    with pytest.raises(checkpoint.CheckpointError,
                       match="'embeddings.LayerNorm.gamma' and 'embeddings.LayerNorm.weight'"):
        checkpoint.load_pretrained(bert, tmp_path / "bert.safetensors")
    state.pop("embeddings.LayerNorm.weight")  # the old name alone loads
    save_file(state, str(tmp_path / "bert.safetensors"))
    loaded = checkpoint.load_pretrained(bert, tmp_path / "bert.safetensors")
    assert "embeddings.LayerNorm.gamma" in loaded

    (tmp_path / "model.bin").write_bytes(b"x" * 16)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        shutil.copy(tmp_path / "zoo.safetensors", two / name)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="does not exist"):
        checkpoint.load_pretrained(plain_zoo(), tmp_path / "nope")  # as checkpoint.load says it
    for bad, match in [(tmp_path / "model.bin", "pickle checkpoint"),
                       (two, r"cannot tell which weights .*\(a.safetensors, b.safetensors\)")]:
        with pytest.raises(checkpoint.CheckpointError, match=match):
            checkpoint.load_pretrained(plain_zoo(), bad)
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(checkpoint.CheckpointError, match="not a safetensors file"):
        checkpoint.load_pretrained(plain_zoo(), tmp_path / "bad.safetensors")


def test_safetensors_reader_matches_the_reference_implementation(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from graphshard import safetensors_io

    tensors = {"f32": torch.randn(7, 3), "bf16": torch.randn(5, 2, 2).bfloat16(),
               "i64": torch.arange(9).reshape(9, 1), "bool": torch.rand(4) > 0.5,
               "f16": torch.randn(()).half(), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    infos = safetensors_io.resolve(tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(safetensors_io.read(infos[name]), f.get_tensor(name))
            if tensor.dim():
                rows = (1, min(3, tensor.shape[0])) if tensor.shape[0] else (0, 0)
                assert torch.equal(safetensors_io.read(infos[name], rows),
                                   f.get_slice(name)[rows[0]:rows[1]])


def test_load_pretrained_buffers_of_other_models_need_init_fn(tmp_path):
    # Only a transformers model says how its non-persistent buffers are computed; any other
    # model's come from init_fn, and one init_fn leaves unwritten is an error, not garbage.
    from safetensors.torch import save_file

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    save_file(Scaled().state_dict(), str(tmp_path / "s.safetensors"))
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(checkpoint.CheckpointError, match=r"\['scale'\] are on the meta device.*"
                       "pass init_fn="):
        checkpoint.load_pretrained(model, tmp_path / "s.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match=r"\['Scaled.scale'\].*not computed"):
        checkpoint.load_pretrained(model, tmp_path / "s.safetensors", init_fn=lambda m: None)

    def init(module):
        if isinstance(module, Scaled):
            module.scale.fill_(2.0)

    with torch.device("meta"):
        model = Scaled()
    checkpoint.load_pretrained(model, tmp_path / "s.safetensors", init_fn=init)
    assert torch.equal(model.scale, torch.full((4,), 2.0))


def test_load_pretrained_llama_with_init_fn_still_uses_it(hf):
    # init_fn, when given, computes the buffers of a transformers model too.
    calls = []
    with torch.device("meta"):
        model = tiny_llama(tied=False)

    def init(module):
        calls.append(type(module).__name__)
        model._init_weights(module)

    checkpoint.load_pretrained(model, hf["untied"]["path"], init_fn=init)
    assert calls == ["LlamaRotaryEmbedding"]
    torch.testing.assert_close(model.model.rotary_emb.inv_freq,
                               tiny_llama(tied=False).model.rotary_emb.inv_freq, atol=0, rtol=0)


def test_load_pretrained_follows_transformers_renames_and_names_the_fusions_it_cannot(tmp_path):
    # transformers' save_pretrained writes GPT-NeoX's lm_head as embed_out (its from_pretrained
    # renames it back) and Mixtral's experts unfused (from_pretrained fuses them).
    import transformers
    from safetensors import safe_open

    torch.manual_seed(0)
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)).eval()
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64))
    directories = {}
    for name, model in (("neox", neox), ("mixtral", mixtral)):
        model.save_pretrained(tmp_path / name)
        directories[name] = str(tmp_path / name)
    with safe_open(str(tmp_path / "neox" / "model.safetensors"), "pt") as f:
        assert "embed_out.weight" in f.keys()  # the old name: what the rename must map
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = neox(tokens).logits
    for result in run_local(workers.load_renamed_pretrained, 2, directories, tokens):
        torch.testing.assert_close(result["neox"], expected, **TOL)
        assert "transformers fuses this architecture's .experts.gate_up_proj" in result["mixtral"]
        assert "with from_pretrained before graphshard.shard" in result["mixtral"]


# --------------------------------------------------------------------------- bad input


def test_load_from_a_folder_of_checkpoints_lists_them(tmp_path, capsys):
    import os

    run = tmp_path / "run"
    for name, mtime in [("step-20", 2_000_000_000), ("step-100", 2_000_000_100)]:
        checkpoint.save(run / name, plain_zoo(), step=int(name[5:]))
        os.utime(run / name / checkpoint.MANIFEST, (mtime, mtime))
    (run / "step-200.tmp-0123").mkdir()  # an unfinished save is not offered
    (run / "notes.txt").write_text("not a checkpoint")
    expected = (rf"{run} is not a checkpoint but a folder holding 2 checkpoints \(step-20, "
                rf"step-100; newest last\): pass one of them, e.g. {run / 'step-100'}")
    with pytest.raises(checkpoint.CheckpointError, match=expected) as info:
        checkpoint.load(run, plain_zoo())
    assert not isinstance(info.value, checkpoint.IncompleteCheckpointError)
    assert cli_main(["export", str(run), str(tmp_path / "o.safetensors")]) == 1
    assert "folder holding 2 checkpoints" in capsys.readouterr().err


def test_missing_path(tmp_path, capsys):
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="does not exist"):
        checkpoint.load(tmp_path / "nope", plain_zoo())
    assert cli_main(["export", str(tmp_path / "nope"), str(tmp_path / "o.safetensors")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_optimizer_requested_but_not_saved(tmp_path):
    checkpoint.save(tmp_path / "ckpt", plain_zoo(), step=0)
    model, optimizer = workers.make(seed=5, sharded=False)
    with pytest.raises(checkpoint.CheckpointError, match="no optimizer state"):
        checkpoint.load(tmp_path / "ckpt", model, optimizer)
    assert checkpoint.load(tmp_path / "ckpt", model).step == 0


def test_optimizer_state_of_other_tied_weights_is_a_checkpoint_error(tmp_path):
    # Saved untied (head and embedding each with AdamW state), loaded into the tied model:
    # DCP's own error advises an option graphshard's load does not take.
    untied, optimizer = workers.make(seed=5, sharded=False)
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    optimizer = torch.optim.AdamW(untied.parameters(), lr=0.02)
    zoo_loss(untied(zoo_batch()), zoo_batch()).backward()
    optimizer.step()
    checkpoint.save(tmp_path / "ckpt", untied, optimizer, step=1)
    model, optimizer = workers.make(seed=6, sharded=False)
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model's parameters "
                       r"\(.*\); was it saved from a model with other tied weights"):
        checkpoint.load(tmp_path / "ckpt", model, optimizer)
    assert checkpoint.load(tmp_path / "ckpt", model).step == 1


def test_save_refuses_to_replace_other_data(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("precious")
    with pytest.raises(checkpoint.CheckpointError, match="refusing to replace"):
        checkpoint.save(tmp_path / "data", plain_zoo())
    assert (tmp_path / "data" / "keep.txt").read_text() == "precious"
    with pytest.raises(TypeError, match="step must be an int"):
        checkpoint.save(tmp_path / "c", plain_zoo(), step=1.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_save_of_a_model_sharded_over_part_of_the_world_is_refused(tmp_path):
    for errors in run_local(workers.save_on_part_of_the_world, 2, str(tmp_path)):
        for message in errors.values():
            assert message is not None and "spans ranks" in message, errors
            assert "every rank of the process group" in message, message
