"""The main job, end to end: `graphshard train` launches its own ranks, trains on real text and
reports; and the command line around it (dtype spellings, help, export's output)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch

from graphshard.tools import cli, train


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "graphshard", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # the demo end to end
def test_train_demo_compiled_shows_progress_losses_throughput_and_memory(tmp_path):
    # compiler=eager keeps the test fast: the graphshard passes run, Inductor is skipped
    plot = tmp_path / "loss.png"
    proc = _run("train", "--nproc", "2", "--steps", "4", "--option", "compiler=eager",
                "--batch", "4", "--seq", "16", "--log-every", "2", "--val-batches", "1",
                "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # the compile note names the compiler that runs (Inductor's note gives its usual time)
    assert "compiling (torch.compile, backend graphshard, compiler=eager)" in out
    assert "then Inductor" not in out
    assert re.search(r"data: [\d.]+ MiB in \d+ files for training, [\d.]+ MiB in \d+ held out", out)
    assert re.search(r"step +0/4 +val loss \d+\.\d+\n", out)
    assert re.search(r"step +1/4 +train loss \d+\.\d+ +\(first step, compile included", out)
    intervals = re.findall(r"step +(\d)/4 +train loss (\d+\.\d+) +val loss (\d+\.\d+) +(\d+) tok/s",
                           out)
    assert [int(s) for s, *_ in intervals] == [2, 4]
    assert all(int(tok) > 0 for *_, tok in intervals)
    first_val = float(re.search(r"step +0/4 +val loss (\d+\.\d+)", out).group(1))
    assert float(intervals[-1][2]) < first_val  # four steps already lower the held-out loss
    assert "params MiB" in out and "optimizer MiB" in out
    rows = re.findall(r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    full = float(re.search(r"full model parameters: ([\d.]+) MiB", out).group(1))
    assert len(rows) == 2
    for _, params, grads, optim in rows:  # each rank holds half of params / grads, 2x for Adam
        assert abs(float(params) - full / 2) < 0.05 and abs(float(optim) - full) < 0.1
    written = plot if "loss curve: " in out else plot.with_suffix(".csv")
    assert written.exists() and str(written) in out


def test_loss_curve_is_a_png_or_a_csv_without_matplotlib(tmp_path, monkeypatch):
    result = {"losses": [5.0, 4.0, 3.0], "val": [(0, 5.5), (3, 3.5)]}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    message = train.save_curve(result, str(tmp_path / "curve.png"), "t")
    assert "matplotlib is not installed" in message
    assert (tmp_path / "curve.csv").read_text().splitlines() == [
        "step,train_loss,val_loss", "1,5.000000,", "2,4.000000,", "3,3.000000,3.500000"]
    monkeypatch.undo()  # the real matplotlib again (its submodules may be loaded already)
    message = train.save_curve(result, str(tmp_path / "curve.png"), "t")
    assert message == f"loss curve: {tmp_path / 'curve.png'}"
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_held_out_files_are_not_trained_on(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_text(f"# file {i}\n" + "x = 1\n" * 10)
    text = train.load_text(str(tmp_path), seq=8)
    assert (text.train_files, text.val_files) == (18, 2)
    val = bytes(text.val.tolist()).decode()
    assert "# file 5\n" in val and "# file 15\n" in val
    assert "# file 5\n" not in bytes(text.train.tolist()).decode()


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "zero9"], "invalid choice: 'zero9'"),
    (["--option", "bucket_size=3"], "unknown graphshard option 'bucket_size'"),
    (["--nproc", "3", "--batch", "8"], "--batch 8 must be divisible by --nproc 3"),
    (["--param-dtype", "int8"], "'int8' is not a floating torch dtype"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--data", "/nonexistent"], "needs at least 2 *.py files"),
])
def test_train_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_help_gives_defaults_and_dtypes_take_both_spellings(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--steps", "150"), ("--seq", "64"), ("--lr", "2e-3")):
        assert re.search(rf"{flag} \w+ [^-]*\(default {re.escape(default)}\)", help_text), flag
    for spelling, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                            ("fp16", torch.float16), ("float32", torch.float32)):
        assert train.parse_args(["--param-dtype", spelling]).param_dtype == dtype
        assert cli.parse_dtype(spelling) == dtype  # the parser dump uses too


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save's, here
def test_export_prints_no_torch_distributed_warning(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ckpt"))
    proc = _run("export", str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and "wrote 1 tensors" in proc.stdout


@pytest.mark.slow  # the demo end to end
def test_train_demo_under_torchrun():
    def launch():
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             "-m", "graphshard", "train", "--steps", "2", "--no-compile", "--batch", "4",
             "--seq", "8", "--val-batches", "1", "--plot", ""],
            capture_output=True, text=True, timeout=300)

    proc = launch()
    if proc.returncode != 0 and "SIGABRT" in proc.stderr:
        # as the suite's own launcher does (tests/conftest.py): a gloo rank that aborted in
        # native code is relaunched once, with the report; an abort that recurs fails the test
        warnings.warn(f"a rank aborted; relaunching once:\n{proc.stderr[-2000:]}")
        proc = launch()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(re.findall(r"step +\d+/2 +train loss", proc.stdout)) == 2  # rank 0 reports once
    assert "params MiB" in proc.stdout


def _free_port() -> int:
    from graphshard.tools.launch import free_port

    return free_port()
