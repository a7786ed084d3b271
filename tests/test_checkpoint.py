"""Checkpoints: save at world size 4, resume at 2, 3 and 1 exactly as the uninterrupted run,
an interrupted save, export to safetensors, and clear errors for bad input.

One gloo run per world size; the world-size-4 reference run and its checkpoint are shared by
every test through a module-scoped fixture.
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
from graphshard.cli import main as cli_main
from graphshard.launch import run_local
from zoo import Zoo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TOL = dict(atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = run_local(workers.reference, 4, str(root))
    return root, results


def _assert_state_close(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOL, msg=name)


def _assert_continues(results: list[dict], reference: dict) -> None:
    for rank_result in results:
        torch.testing.assert_close(torch.tensor(rank_result["losses"]),
                                   torch.tensor(reference["losses"][workers.SAVE_STEP:]), **TOL)
    _assert_state_close(results[0]["final"], reference["final"])


def _leftovers(names: list[str]) -> list[str]:
    return [name for name in names if ".tmp-" in name or ".old-" in name]


def _plain_zoo(seed: int = 5, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return Zoo(**kwargs)


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
    _assert_state_close(results[0]["reloaded"], ref[0]["at_save"])


def test_resume_at_3_with_standard_dcp_calls(saved, tmp_path):
    root, ref = saved
    # Also a checkpoint of one unsharded process, to load sharded over 3 ranks: ranks 1 and 2
    # have no saved RNG state and derive theirs.
    model, optimizer = workers.make(seed=11, sharded=False)
    workers.train(model, optimizer, 0, 1)
    rng_state = torch.get_rng_state()
    checkpoint.save(tmp_path / "single", model, optimizer, step=1)

    results = run_local(workers.resume_plain_dcp, 3, str(root), str(tmp_path / "single"))
    _assert_continues(results, ref[0])
    _assert_state_close(results[0]["plain_reloaded"], results[0]["final"])
    assert results[0]["plain_next_loss"] == results[0]["next_loss"]  # optimizer state too

    _assert_state_close(results[0]["single_state"], model.state_dict())
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


def test_resume_into_unsharded_model_without_process_group(saved):
    root, ref = saved
    model, optimizer = workers.make(seed=9, sharded=False)
    info = checkpoint.load(root / "ckpt", model, optimizer)
    assert info.step == workers.SAVE_STEP
    _assert_state_close(workers.full_state(model), ref[0]["at_save"])
    torch.testing.assert_close(torch.tensor(workers.train(model, optimizer, workers.SAVE_STEP,
                                                          workers.LAST_STEP)),
                               torch.tensor(ref[0]["losses"][workers.SAVE_STEP:]), **TOL)
    _assert_state_close(workers.full_state(model), ref[0]["final"])


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


# --------------------------------------------------------------------------- export


def test_export_round_trips_into_unsharded_model(saved, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    root, ref = saved
    out = tmp_path / "model.safetensors"
    assert cli_main(["export", str(root / "ckpt"), str(out)]) == 0
    assert "wrote 10 tensors" in capsys.readouterr().out
    model = _plain_zoo()
    model.load_state_dict(load_file(out), strict=True)  # tied and buffer keys included
    _assert_state_close(model.state_dict(), ref[0]["at_save"])
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["graphshard_step"] == str(workers.SAVE_STEP)
    # The Python function writes the same bytes.
    assert checkpoint.export(root / "ckpt", tmp_path / "again.safetensors") == list(
        ref[0]["at_save"])
    assert (tmp_path / "again.safetensors").read_bytes() == out.read_bytes()
    header_len = struct.unpack("<Q", out.read_bytes()[:8])[0]
    assert header_len % 8 == 0


# --------------------------------------------------------------------------- bad input


def test_missing_path(tmp_path, capsys):
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="does not exist"):
        checkpoint.load(tmp_path / "nope", _plain_zoo())
    assert cli_main(["export", str(tmp_path / "nope"), str(tmp_path / "o.safetensors")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err
    assert not (tmp_path / "o.safetensors").exists()


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
    assert "missing keys" in message and "'extra.weight'" in message
    assert "unexpected keys" in message and "'gate.weight'" in message
    assert "emb.weight: checkpoint (11, 6) vs model (13, 6)" in message
    assert "head.weight" in message


def test_optimizer_requested_but_not_saved(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _plain_zoo(), step=0)
    model, optimizer = workers.make(seed=5, sharded=False)
    with pytest.raises(checkpoint.CheckpointError, match="no optimizer state"):
        checkpoint.load(tmp_path / "ckpt", model, optimizer)
    assert checkpoint.load(tmp_path / "ckpt", model).step == 0


def test_save_refuses_to_replace_other_data(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("precious")
    with pytest.raises(checkpoint.CheckpointError, match="refusing to replace"):
        checkpoint.save(tmp_path / "data", _plain_zoo())
    assert (tmp_path / "data" / "keep.txt").read_text() == "precious"
    with pytest.raises(TypeError, match="step must be an int"):
        checkpoint.save(tmp_path / "c", _plain_zoo(), step=1.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
