"""Checkpoints: save at world size 4, resume at 2, 3 and 1 exactly as the uninterrupted run,
an interrupted save, checkpoints of plain DCP and FSDP2 in and out, asynchronous save, export to
safetensors (one file, Hugging Face's layout), pretrained safetensors weights into a sharded
model (outputs, first step, memory), and clear errors for bad input.

A few gloo runs, each shared by several tests through module-scoped fixtures: the
world-size-4 reference run and its checkpoint, one world-size-2 run and one world-size-3 run
that each carry out several checks in one process group (ckpt_workers.run_checks).
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
import torch.nn as nn

import ckpt_workers as workers
from graphshard import checkpoint
from graphshard.tools.cli import main as cli_main
from graphshard.tools.launch import run_local
from zoo import Zoo, plain_zoo, pretrained_llamas

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TOL = workers.TOL


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """The world-size-4 run: the reference (saving at SAVE_STEP), then, in the same process
    group, its checkpoint resumed into hybrid sharding on a 2 x 2 mesh."""
    root = tmp_path_factory.mktemp("ckpt")
    results = run_local(workers.run_checks, 4, [("reference", (str(root),)),
                                                ("resume_hybrid", (str(root),))])
    return root, results


@pytest.fixture(scope="module")
def saved(world4):
    root, results = world4
    return root, [r["reference"] for r in results]


# The large model load_pretrained's memory is measured on: 32 x Linear(1024, 1024), 128 MiB in
# fp32; 64 MiB per rank at world size 2, the largest tensor 4 MiB.
BIG_LAYERS, BIG_DIM = 32, 1024


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Tiny Hugging Face Llamas saved with save_pretrained, and the originals' outputs and first
    step (transformers is a test dependency)."""
    return pretrained_llamas(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def ws2(saved, hf, tmp_path_factory):
    """One world-size-2 run for: load_pretrained's memory (first, in a fresh process), FSDP2
    interop, async save, a tiny run of the sync/async save benchmark, a load into a model
    never materialised, the tied Llama round trip (saved again as a checkpoint) and a sharded
    Llama's save_pretrained."""
    from safetensors.torch import save_file

    root = saved[0]
    big = tmp_path_factory.mktemp("big") / "stack.safetensors"
    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in workers.stack(BIG_LAYERS, BIG_DIM).state_dict().items()}
    save_file({k: torch.randn(shape) * BIG_DIM**-0.5 for k, shape in shapes.items()}, str(big))
    checks = [("pretrained_memory", (str(big), BIG_LAYERS, BIG_DIM)),
              ("fsdp2_interop", (str(root),)),
              ("async_save", (str(root),)),
              ("save_bench", (str(tmp_path_factory.mktemp("bench")),)),
              ("load_into_meta", (str(root),))]
    if hf is not None:
        checks.append(("llama_round_trip", (str(hf["tied"]["path"]), hf["tokens"],
                                            str(root / "llama-ckpt"))))
        checks.append(("save_pretrained_refused",
                       (str(tmp_path_factory.mktemp("hf-out") / "llama"),)))
    return run_local(workers.run_checks, 2, checks), big


@pytest.fixture(scope="module")
def ws3(saved, ws2, hf, tmp_path_factory):
    """One world-size-3 run for: resuming with the standard DCP calls, resuming the FSDP2 run
    with checkpoint.load, and the untied, sharded Llama round trip."""
    root = saved[0]
    # A checkpoint of one unsharded process, to load sharded over 3 ranks.
    single = tmp_path_factory.mktemp("single") / "single"
    model, optimizer = workers.make(seed=11, sharded=False)
    workers.train(model, optimizer, 0, 1)
    rng_state = torch.get_rng_state()
    checkpoint.save(single, model, optimizer, step=1)
    checks = [("resume_plain_dcp", (str(root), str(single))),
              ("resume_fsdp2", (str(root),))]
    if hf is not None:
        checks.append(("llama_round_trip", (str(hf["untied"]["path"]), hf["tokens"], None)))
    return run_local(workers.run_checks, 3, checks), model.state_dict(), rng_state


def _assert_continues(results: list[dict], reference: dict) -> None:
    for rank_result in results:
        torch.testing.assert_close(torch.tensor(rank_result["losses"]),
                                   torch.tensor(reference["losses"][workers.SAVE_STEP:]), **TOL)
    workers.assert_state_close(results[0]["final"], reference["final"])


def _leftovers(names: list[str]) -> list[str]:
    return [name for name in names if ".tmp-" in name or ".old-" in name]


# --------------------------------------------------------------------------- resharding


def test_checkpoint_layout(saved):
    root, ref = saved
    manifest = json.loads((root / "ckpt" / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == workers.SAVE_STEP and manifest["world_size"] == 4
    assert manifest["model"]["emb.weight"] == {"shape": [11, 6], "dtype": "float32"}
    assert list(manifest["model"]) == list(ref[0]["at_save"])  # the model's own names
    # The step-1 checkpoint was replaced, and nothing temporary is left next to it.
    assert _leftovers([p.name for p in root.iterdir()]) == []


def test_resume_at_2_with_interrupted_save(saved):
    root, ref = saved
    results = run_local(workers.resume, 2, str(root), False)
    _assert_continues(results, ref[0])
    for rank, result in enumerate(results):
        assert (result["step"], result["world_size"]) == (workers.SAVE_STEP, 4)
        assert result["extra"] == {"tokens_seen": 36}
        assert result["rng"] == "saved"
        torch.testing.assert_close(result["draws"], ref[rank]["draws"], atol=0, rtol=0)
        # The save that failed on rank 1 failed on every rank, naming the cause ...
        assert "rank 1" in result["failed_save"] and "injected failure" in result["failed_save"]
        # ... left no partial directory and the step-3 checkpoint intact.
        assert "ckpt" in result["dir_after_failure"]
        assert _leftovers(result["dir_after_failure"]) == []
        assert result["reloaded_step"] == workers.SAVE_STEP
    workers.assert_state_close(results[0]["reloaded"], ref[0]["at_save"])


@pytest.mark.slow  # the world-3 launch
def test_resume_at_3_with_standard_dcp_calls(saved, ws3):
    root, ref = saved
    results, single_state, rng_state = ws3
    results = [r["resume_plain_dcp"] for r in results]
    _assert_continues(results, ref[0])
    workers.assert_state_close(results[0]["plain_reloaded"], results[0]["final"])
    assert results[0]["plain_next_loss"] == results[0]["next_loss"]  # optimizer state too

    # One unsharded process's checkpoint loaded sharded over 3 ranks: ranks 1 and 2 have no
    # saved RNG state and derive theirs.
    workers.assert_state_close(results[0]["single_state"], single_state)
    assert [r["single_rng"] for r in results] == ["saved", "derived", "derived"]
    torch.set_rng_state(rng_state)
    expected = [torch.rand(4)]
    for rank in (1, 2):
        torch.manual_seed(checkpoint.derived_seed(rng_state, rank))
        expected.append(torch.rand(4))
    for result, draws in zip(results, expected):
        torch.testing.assert_close(result["single_draws"], draws, atol=0, rtol=0)
    assert not torch.equal(expected[1], expected[2])
    assert all("does not exist" in r["missing_error"] for r in results)


def test_resume_at_1_compiled(saved):
    root, ref = saved
    [result] = run_local(workers.resume, 1, str(root), True)
    _assert_continues([result], ref[0])
    assert result["rng"] == "saved"
    torch.testing.assert_close(result["draws"], ref[0]["draws"], atol=0, rtol=0)


@pytest.mark.slow  # the world-3 launch
def test_hybrid_resumes_a_flat_checkpoint_and_saves_one_that_loads_unsharded(world4, ws3):
    root, results = world4
    ref = [r["reference"] for r in results]
    hybrid = [r["resume_hybrid"] for r in results]
    assert {r["step"] for r in hybrid} == {workers.SAVE_STEP}
    # sharded within a group, replicated across the two (the 0-dim parameter: replicated on both)
    assert all(r["placements"] <= {"(Replicate(), Shard(dim=0))", "(Replicate(), Replicate())"}
               and "(Replicate(), Shard(dim=0))" in r["placements"] for r in hybrid)
    _assert_continues(hybrid, ref[0])
    # The hybrid save (each shard held by two replicas) loads into one unsharded process with
    # its optimizer state: the next step matches world size 3's, resumed the standard way.
    model, optimizer = workers.make(seed=9, sharded=False)
    info = checkpoint.load(root / "hybrid-ckpt", model, optimizer)
    assert (info.step, info.world_size) == (workers.LAST_STEP, 4)
    workers.assert_state_close(workers.full_state(model), ref[0]["final"])
    next_loss = workers.train(model, optimizer, workers.LAST_STEP, workers.LAST_STEP + 1)
    torch.testing.assert_close(torch.tensor(next_loss),
                               torch.tensor(ws3[0][0]["resume_plain_dcp"]["next_loss"]), **TOL)


def test_resume_into_unsharded_model_without_process_group(saved):
    root, ref = saved
    model, optimizer = workers.make(seed=9, sharded=False)
    info = checkpoint.load(root / "ckpt", model, optimizer)
    assert info.step == workers.SAVE_STEP
    workers.assert_state_close(workers.full_state(model), ref[0]["at_save"])
    torch.testing.assert_close(torch.tensor(workers.train(model, optimizer, workers.SAVE_STEP,
                                                          workers.LAST_STEP)),
                               torch.tensor(ref[0]["losses"][workers.SAVE_STEP:]), **TOL)
    workers.assert_state_close(workers.full_state(model), ref[0]["final"])


# --------------------------------------------------------------------------- other DCP checkpoints


def test_graphshard_checkpoint_resumed_by_fsdp2(saved, ws2):
    # graphshard at world size 4 -> FSDP2 at 2, with the standard DCP calls, optimizer included.
    root, ref = saved
    results = [r["fsdp2_interop"] for r in ws2[0]]
    _assert_continues(results, ref[0])


@pytest.mark.slow  # the world-3 launch
def test_fsdp2_checkpoint_resumed_by_graphshard(saved, ws2, ws3):
    # FSDP2 at world size 2 -> graphshard at 3 with checkpoint.load (no marker needed): the
    # FSDP2 run matched graphshard's up to the save, and the resumed run goes on as both would.
    root, ref = saved
    fsdp2 = ws2[0][0]["fsdp2_interop"]
    torch.testing.assert_close(torch.tensor(fsdp2["fsdp2_losses"]),
                               torch.tensor(ref[0]["losses"][:workers.SAVE_STEP]), **TOL)
    results = [r["resume_fsdp2"] for r in ws3[0]]
    assert results[0]["info"] == ("dcp", None, None, "none")
    workers.assert_state_close(results[0]["at_load"], fsdp2["fsdp2_at_save"])
    _assert_continues(results, ref[0])


@pytest.mark.slow  # the world-3 launch
def test_plain_dcp_checkpoints_load_and_export(saved, ws2, ws3, tmp_path):
    from safetensors.torch import load_file

    root, ref = saved
    resumed = ws3[0][0]["resume_fsdp2"]
    # dcp.save(model.state_dict()): the state dict at the root, no optimizer.
    assert resumed["root_format"] == "dcp"
    workers.assert_state_close(resumed["root_reloaded"], resumed["final"])
    assert "has no optimizer state" in resumed["root_optimizer_error"]
    # {"model", "optim"} saved with the standard calls at world size 3, into one process.
    plain = ws3[0][0]["resume_plain_dcp"]
    model, optimizer = workers.make(seed=8, sharded=False)
    info = checkpoint.load(root / "plain-dcp-3", model, optimizer)
    assert (info.format, info.step, info.world_size) == ("dcp", None, None)
    workers.assert_state_close(workers.full_state(model), plain["final"])
    torch.testing.assert_close(
        torch.tensor(workers.train(model, optimizer, workers.LAST_STEP, workers.LAST_STEP + 1)),
        torch.tensor(plain["next_loss"]), **TOL)
    # Export takes any of them.
    fsdp2 = ws2[0][0]["fsdp2_interop"]["fsdp2_at_save"]
    for name, expected in [("plain-root-3", resumed["final"]), ("plain-dcp-3", plain["final"]),
                           ("fsdp2", fsdp2)]:
        out = tmp_path / f"{name}.safetensors"
        assert cli_main(["export", str(root / name), str(out)]) == 0
        workers.assert_state_close(dict(sorted(load_file(out).items())), dict(sorted(expected.items())))


@pytest.mark.slow  # the world-3 launch (it writes the plain DCP checkpoint read here)
def test_unfinished_graphshard_save_is_incomplete_but_plain_dcp_is_not(saved, ws3, tmp_path):
    # The marker guards graphshard's own saves: without it a directory holding graphshard.*
    # entries is an interrupted save, while a plain DCP checkpoint is complete with .metadata.
    partial = tmp_path / "partial"
    shutil.copytree(saved[0] / "ckpt", partial)
    (partial / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="no graphshard.json"):
        checkpoint.export(partial, tmp_path / "o.safetensors")
    assert checkpoint.load(saved[0] / "plain-dcp-3", plain_zoo()).format == "dcp"


# --------------------------------------------------------------------------- async save


def test_async_save_returns_at_once_and_commits_when_every_rank_wrote(saved, ws2):
    root, ref = saved
    results = [r["async_save"] for r in ws2[0]]
    for result in results:
        # Rank 1's write took 2 s; save() returned long before, and training went on.
        assert result["returned_s"] < 1.5, result["returned_s"]
        assert result["pending_after_training"] and not result["exists_after_training"]
        assert result["elapsed_s"] >= 2.0
        assert result["manifest"] and result["step"] == workers.SAVE_STEP
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(ref[0]["losses"]), **TOL)
        # It holds the state at save time, not the weights training changed afterwards.
        workers.assert_state_close(result["reloaded"], result["at_save"])
        torch.testing.assert_close(torch.tensor(result["reloaded_losses"]),
                                   torch.tensor(ref[0]["losses"][workers.SAVE_STEP:]), **TOL)
        # A write failing on rank 1 fails on every rank and leaves the checkpoint intact.
        assert "rank 1" in result["failed"] and "injected async write failure" in result["failed"]
        assert _leftovers(result["after_failure"]) == []
        assert result["step_after_failure"] == workers.SAVE_STEP
    workers.assert_state_close(results[0]["at_save"], ref[0]["at_save"])


def test_save_benchmark_runs(ws2):
    from graphshard.bench.checkpoint_save import MODES, summarize

    result = ws2[0][0]["save_bench"]
    assert set(result["times"]) == set(MODES) and all(len(t) == 2 for t in result["times"].values())
    assert result["saved"]["none"] == [False, False] and result["saved"]["async"] == [True, True]
    summary = summarize(result)
    assert summary["async"]["final_wait_ms"] >= 0 and summary["sync"]["save_step_ms"] > 0


# --------------------------------------------------------------------------- export


def test_export_round_trips_into_unsharded_model(saved, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    root, ref = saved
    out = tmp_path / "model.safetensors"
    assert cli_main(["export", str(root / "ckpt"), str(out)]) == 0
    assert "wrote 10 tensors" in capsys.readouterr().out
    model = plain_zoo()
    model.load_state_dict(load_file(out), strict=True)  # tied and buffer keys included
    workers.assert_state_close(model.state_dict(), ref[0]["at_save"])
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["graphshard_step"] == str(workers.SAVE_STEP)
    # The Python function writes the same bytes.
    assert checkpoint.export(root / "ckpt", tmp_path / "again.safetensors") == list(
        ref[0]["at_save"])
    assert (tmp_path / "again.safetensors").read_bytes() == out.read_bytes()
    header_len = struct.unpack("<Q", out.read_bytes()[:8])[0]
    assert header_len % 8 == 0


def test_export_to_hugging_face_layout(saved, hf, ws2, tmp_path, capsys):
    # The tied Llama: pretrained -> load_pretrained at world size 2 -> one step -> save ->
    # export as sharded files + index with its config -> transformers' from_pretrained.
    from transformers import LlamaForCausalLM

    root = saved[0]
    trained = ws2[0][0]["llama_round_trip"]["after_step"]
    out = tmp_path / "hf"
    argv = ["export", str(root / "llama-ckpt"), str(out), "--max-shard-size", "30KB",
            "--config", str(hf["tied"]["path"] / "config.json")]
    assert cli_main(argv) == 0
    assert f"wrote {len(trained)} tensors" in capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert files == sorted(shards + ["config.json", "model.safetensors.index.json"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(trained) and set(index["weight_map"].values()) == set(
        shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in trained.values())
    assert max((out / f).stat().st_size for f in shards) < 30_000 + 8_192  # a cap, + header

    loaded = LlamaForCausalLM.from_pretrained(out)
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is \
        loaded.model.embed_tokens.weight
    workers.assert_state_close(dict(sorted(loaded.state_dict().items())), dict(sorted(trained.items())))

    # Exporting again with everything in one file replaces the sharded files.
    assert checkpoint.export(root / "llama-ckpt", out, max_shard_size="1GB") == list(trained)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = LlamaForCausalLM.from_pretrained(out)
    workers.assert_state_close(dict(sorted(loaded.state_dict().items())), dict(sorted(trained.items())))


# --------------------------------------------------------------------------- pretrained weights


@pytest.mark.slow  # the world-3 launch
@pytest.mark.parametrize("world", [2, 3])
def test_load_pretrained_llama_matches_unsharded_original(hf, ws2, ws3, world):
    # World size 2: tied embeddings, one file; 3: untied, sharded files with an index.
    runs, expected = (ws2[0], hf["tied"]) if world == 2 else (ws3[0], hf["untied"])
    results = [r["llama_round_trip"] for r in runs]
    assert results[0]["tied"] == (world == 2)
    assert sorted(results[0]["names"]) == sorted(
        n for n in expected["after_step"] if not (world == 2 and n == "lm_head.weight"))
    for result in results:
        torch.testing.assert_close(result["logits"], expected["logits"], **TOL)
    torch.testing.assert_close(results[0]["loss"], expected["loss"], **TOL)
    workers.assert_state_close(dict(sorted(results[0]["grads"].items())),
                        dict(sorted(expected["grads"].items())))
    workers.assert_state_close(dict(sorted(results[0]["after_step"].items())),
                        dict(sorted(expected["after_step"].items())))


def test_load_pretrained_reads_only_this_ranks_rows(ws2):
    from safetensors import safe_open

    runs, big = ws2
    memory = [r["pretrained_memory"] for r in runs]
    if memory[0] is None:
        pytest.skip("peak RSS cannot be reset here (/proc/self/clear_refs)")
    model_mib = BIG_LAYERS * (BIG_DIM * BIG_DIM + BIG_DIM) * 4 / 2**20
    largest_mib = BIG_DIM * BIG_DIM * 4 / 2**20
    for m in memory:
        assert m["in_place"]  # loading again into materialised shards
        assert m["compiled_matches"]
        assert m["shard_mib"] == pytest.approx(model_mib / 2)
        # The rank's shard, plus at most one tensor and a little allocator noise (measured:
        # 65.0 MiB for a 64.1 MiB shard); the whole model would be twice the shard.
        assert m["peak_mib"] < m["shard_mib"] + largest_mib + 8, (m, model_mib)
    with safe_open(str(big), "pt") as f:
        for name in f.keys():
            total = sum(m["sums"][name] for m in memory)
            assert total == pytest.approx(f.get_tensor(name).double().sum().item(), abs=1e-6)


def test_load_into_a_model_never_materialised_names_materialize(saved, ws2):
    for result in [r["load_into_meta"] for r in ws2[0]]:  # every rank
        assert "meta device" in result["error"] and "graphshard.materialize(model)" in \
            result["error"], result["error"]
        assert not [w for w in result["warnings"] if "no-op" in w], result["warnings"]
    with torch.device("meta"):
        model = plain_zoo()  # unsharded: to_empty is the way
    with pytest.raises(checkpoint.CheckpointError, match=r"model.to_empty\(device=\.\.\.\)"):
        checkpoint.load(saved[0] / "ckpt", model)


def test_save_pretrained_of_a_sharded_model_is_refused_on_every_rank(hf, ws2):
    results = [r["save_pretrained_refused"] for r in ws2[0]]
    for result in results:
        assert result["error"] is not None and "graphshard.checkpoint.export" in result["error"]
        assert "save_pretrained cannot write a LlamaForCausalLM sharded by graphshard" in \
            result["error"]
        assert result["written"] is None  # nothing written: not even config.json
        assert result["grads"]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("remove", [[checkpoint.MANIFEST], [checkpoint.MANIFEST, ".metadata"]])
def test_incomplete_checkpoint(saved, tmp_path, capsys, remove):
    # What a save killed before its commit leaves behind (DCP written or not).
    partial = tmp_path / "ckpt.tmp-0123"
    shutil.copytree(saved[0] / "ckpt", partial)
    for name in remove:
        (partial / name).unlink()
    model, optimizer = workers.make(seed=5, sharded=False)
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="incomplete checkpoint"):
        checkpoint.load(partial, model, optimizer)
    assert cli_main(["export", str(partial), str(tmp_path / "o.safetensors")]) == 1
    assert "incomplete checkpoint" in capsys.readouterr().err


def test_export_bad_options(saved, tmp_path, capsys):
    ckpt = str(saved[0] / "ckpt")
    for argv, message in [
            ([str(tmp_path / "o.safetensors"), "--max-shard-size", "1GB"], "apply to a directory"),
            ([str(tmp_path / "d"), "--max-shard-size", "lots"], "invalid size 'lots'"),
            ([str(tmp_path / "d"), "--config", str(tmp_path / "none.json")], "config"),
            ([str(tmp_path / "no" / "d")], "does not exist")]:
        assert cli_main(["export", ckpt, *argv]) == 1
        assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


class _OtherModel(Zoo):
    """Another model: a bigger vocabulary, no `gate`, an extra layer."""

    def __init__(self):
        super().__init__(vocab=13)
        del self.gate
        self.extra = nn.Linear(6, 6)


def test_checkpoint_of_another_model(saved):
    model = _OtherModel()
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(saved[0] / "ckpt", model)
    message = str(info.value)
    assert "missing (in the model, not in the checkpoint)" in message and "'extra.weight'" in message
    assert "unexpected (in the checkpoint, not in the model)" in message and "'gate.weight'" in message
    assert "emb.weight: checkpoint (11, 6) vs model (13, 6)" in message
    assert "head.weight" in message

